"""Job configs and checks of the multi-GPU matrix (tests/gpu/test_scale_gpu.py): tiny models of real
architectures, the arithmetic task's data, and `trinity run` as a user types it.

The RL jobs reward digits (`arithmetic_reward:digit_fraction`): a random model writes a digit ~4% of the
time and learns to write more within a dozen steps, so "the reward rises" is a check of learning that a
tiny model passes in seconds. Every prompt of their dataset is the same one, so the data-parallel ranks
answer the same prompt at every step: their answers must differ (a rank that reuses another's sampling
seed answers alike).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import trinity_run

# bf16 with another reduction order: an SFT loss of a right layout agrees to well under 1% in the first
# steps; a wrong shard or layer order is off by >10% from step 1.
REL = 2e-2
RL_STEPS = 12
# one on-policy update a step: its own forward gives the old log-probs (no old_logp phase)
PHASES = {"grpo": ("rollout", "reward", "ref", "update_actor"),
          "ppo": ("rollout", "reward", "ref", "values", "update_critic", "update_actor")}


def tiny_models(root: Path) -> tuple[Path, Path]:
    """(dense, moe): a tiny Qwen2 (4 layers, hidden 256) and a tiny Qwen3-MoE (4 experts) on the tiny
    tokenizer, in `root`."""
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer
    from trinity.testing.tiny_models import make_tiny_hf_model

    tok = make_tiny_tokenizer(root / "tok")
    dense = make_tiny_qwen2(root / "dense", tok, num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2)
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    moe = make_tiny_hf_model("qwen3_moe", root / "moe", vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             moe_intermediate_size=64, num_experts=4, num_local_experts=4, max_position_embeddings=1024)
    tokenizer.save_pretrained(str(moe))
    return dense, moe


def make_assets(root: Path) -> dict[str, Path]:
    from trinity.testing.tiny_assets import arithmetic_problem, write_dpo_dataset, write_sft_dataset

    dense, moe = tiny_models(root)
    import random

    prompt, answer = arithmetic_problem(random.Random(0))
    same = root / "same_prompt.jsonl"
    same.write_text("".join(json.dumps({"prompt": prompt, "answer": answer}) + "\n" for _ in range(256)))
    rng = random.Random(1)
    text = root / "pt.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join("".join(arithmetic_problem(rng)) for _ in range(8))}) + "\n"
                            for _ in range(400)))
    return {"dense": dense, "moe": moe, "sft": write_sft_dataset(root / "sft.jsonl", 2000, seed=0),
            "dpo": write_dpo_dataset(root / "dpo.jsonl", 400, seed=0), "pt": text, "same_prompt": same}


def trainer(out: Path, steps: int, **extra) -> dict:
    return {"total_steps": steps, "output_dir": str(out), "save_interval": None, "save_last": False, "log_interval": 1,
            "tensorboard": False, "export_hf": False, **extra}


def supervised_job(assets: dict[str, Path], algo: str, out: Path, nproc: int, megatron: dict, *,
                   model: str = "dense", steps: int = 8) -> dict:
    """SFT, PT or DPO: a global batch of 16 rows (pairs for DPO) at any layout, so the losses compare."""
    data = {"sft": {"train_files": [str(assets["sft"])], "seq_length": 256},
            "pt": {"train_files": [str(assets["pt"])], "seq_length": 128},
            "dpo": {"train_files": [str(assets["dpo"])], "seq_length": 128}}[algo]
    return {
        "algorithm": {"name": algo},
        "model": {"path": str(assets[model])},
        "data": data,
        "cluster": {"device": "cuda", "nproc_per_node": nproc},
        "trainer": trainer(out, steps, global_batch_size=16, micro_batch_size=2),
        "actor_rollout_ref": {"actor": {
            "optim": {"lr": 1e-3 if algo == "dpo" else 2e-3, "lr_warmup_steps": 2, "lr_scheduler": "constant",
                      "weight_decay": 0.0},
            "megatron": megatron,
        }},
    }


def rl_job(assets: dict[str, Path], algo: str, out: Path, nproc: int, megatron: dict | None = None, *,
           model: str = "dense", steps: int = RL_STEPS, **extra) -> dict:
    """`algo` on the same-prompt dataset: 16 prompts x 8 answers of 8 tokens a step, one on-policy update;
    the ref and the critic take the actor's layout."""
    megatron = dict(megatron or {})
    layout = {k: v for k, v in megatron.items() if not k.endswith("_offload")}
    cfg: dict = {
        "algorithm": {"name": "grpo" if algo == "gspo" else algo},
        "model": {"path": str(assets[model])},
        "data": {"train_files": [str(assets["same_prompt"])], "max_prompt_length": 64, "train_batch_size": 16},
        "cluster": {"device": "cuda", "nproc_per_node": nproc},
        "trainer": trainer(out, steps, micro_batch_size=16),
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 16, "use_kl_loss": algo != "ppo", "kl_loss_coef": 0.05,
                      "optim": {"lr": 3e-3, "lr_warmup_steps": 3, "weight_decay": 0.0, "clip_grad": 1.0},
                      "megatron": megatron},
            "ref": {"megatron": dict(layout)},
            "rollout": {"n": 8, "temperature": 1.0, "response_length": 8},
        },
        "reward": {"function": "trinity.rewards.arithmetic_reward:digit_fraction"},
    }
    if algo == "gspo":
        cfg["actor_rollout_ref"]["actor"]["policy_loss"] = {"loss_mode": "gspo"}
    if algo == "dapo":
        cfg["algorithm"]["filter_groups"] = {"enable": True, "max_num_gen_batches": 3}
        cfg["actor_rollout_ref"]["actor"]["clip_ratio_high"] = 0.28
    if algo == "ppo":
        cfg["algorithm"].update(use_kl_in_reward=True, kl_coef=0.05)
        cfg["critic"] = {"warmup_steps": 1, "cliprange_value": 0.5, "optim": {"lr": 1e-3, "weight_decay": 0.0},
                         "megatron": dict(layout)}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def note(text: str) -> None:
    """Print `text` and append it to $TRINITY_GPU_LOG (tests/gpu/conftest.py), which xdist workers share."""
    import os

    print(text)
    if os.environ.get("TRINITY_GPU_LOG"):
        with open(os.environ["TRINITY_GPU_LOG"], "a") as f:
            f.write(text + "\n")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_job(cfg: dict, path: Path, timeout: float = 420) -> list[dict]:
    proc = trinity_run(cfg, path, timeout=timeout, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return metrics(Path(cfg["trainer"]["output_dir"]))


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def check_rl(rows: list[dict], algo: str, *, steps: int = RL_STEPS, dp: int = 1) -> None:
    """Every phase of every step ran, the reward rose, the rollout's log-probs are the training forward's
    (the same weights: only kernel and cache noise between them), and DP ranks answered differently."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for phase in PHASES.get(algo, PHASES["grpo"]):
            if not (phase == "update_actor" and algo == "ppo" and r["step"] == 1):  # the critic's warm-up step
                assert r[f"time/{phase}_s"] > 0, (phase, r)
        assert all(v == v and abs(v) != float("inf") for v in r.values() if isinstance(v, float)), r
        # bf16: one answer's tokens through the KV-cache decode and through the whole-sequence pass
        assert r["rollout/logprob_diff_mean"] < 0.05, r
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    note(f"  {algo}: reward {first:.3f} (steps 1-3) -> {last:.3f} (last 3); rewards "
         f"{[round(r['reward/mean'], 3) for r in rows]}; logprob gap {[round(r['rollout/logprob_diff_mean'], 4) for r in rows]}; "
         f"step s {[round(r.get('step_time_s', 0), 2) for r in rows]}")
    assert last > first + 0.05, [round(r["reward/mean"], 3) for r in rows]


def check_ranks_differ(out: Path, dp: int, step: int = 1) -> None:
    """The step's answers, gathered in DP rank order: every rank answered the same prompt, and no two
    ranks gave the same list of answers (nor the same answer at the same position, past chance)."""
    rows = [json.loads(line) for line in (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
    assert len({r["prompt"] for r in rows}) == 1, "the dataset has one prompt"
    per = len(rows) // dp
    ranks = [[r["response"] for r in rows[i * per:(i + 1) * per]] for i in range(dp)]
    for i in range(dp):
        for j in range(i + 1, dp):
            same = sum(a == b for a, b in zip(ranks[i], ranks[j]))
            assert same <= per // 4, f"DP ranks {i} and {j} gave {same} of {per} identical answers: {ranks[i][:3]}"


def assert_losses_match(got: list[float], want: list[float], label: str) -> None:
    note(f"  {label}: 1 GPU {[round(x, 4) for x in want]}\n    here  {[round(x, 4) for x in got]}")
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=REL)
