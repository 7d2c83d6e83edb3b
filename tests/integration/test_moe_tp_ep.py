"""MoE with TP x EP (#20, ROLL's layout family): TP=2, EP=2 with sequence parallel (megatron-core needs SP
when both are > 1) over 4 gloo ranks trains a tiny Qwen3-MoE to the losses and weights of TP=1 EP=1.

Each job is a real `trinity run`: one GRPO step at TP=2 EP=2 (DP=2) against TP=1 EP=1 on two ranks (DP=2:
each DP rank gets the same prompts and generator), so the rollout (decoded with SP switched off), the
log-probs, the loss and the updated weights must agree. The update is a forward and backward of packed
rows through the MoE layers at that layout, the part an SFT step shares with it; the SFT data and loss
are checked at the other layouts (tests/integration/test_sft_cpu.py), so a second pair of SFT jobs here
(~60 s of a 2-core CI runner, a 4-rank job among them) is left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import trinity_run

NOT_DETERMINISTIC = ("time/", "tokens_per_s/", "mem", "step_time_s", "tok", "throughput", "mfu")
TP_EP = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import make_tiny_tokenizer, write_prompt_dataset
    from trinity.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe_tp_ep_assets")
    tok = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(root / "tokenizer")))
    model = make_tiny_hf_model(
        "qwen3_moe", root / "model", vocab_size=-(-len(tok) // 64) * 64, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save_pretrained(str(model))
    reward = root / "length_reward.py"
    reward.write_text("def score(prompts, responses, answers):\n    return [float(len(r) % 4) for r in responses]\n")
    return {"reward": reward, "model": model,
            "prompts": write_prompt_dataset(root / "prompts.jsonl", 8, seed=0)}


# adam_eps 1 with lr 1: the first Adam step is ~ lr * grad, so the weights after it compare the gradients.
# With the default eps a gradient element near 1e-8 gets a step that its rounding decides (seen: one
# v_proj element 1.2e-5 apart after a change of the sampled responses).
OPTIM = {"lr": 1.0, "adam_eps": 1.0, "weight_decay": 0.0}


def _trainer(out: Path, **extra) -> dict:
    return {"total_steps": 1, "output_dir": str(out), "save_interval": 100, "log_interval": 1,
            "tensorboard": False, "export_hf": True, **extra}


def grpo_job(assets: dict[str, Path], out: Path, block: dict, nproc: int) -> dict:
    return {
        "algorithm": {"name": "grpo"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["prompts"])], "max_prompt_length": 32, "train_batch_size": 2},
        "cluster": {"device": "cpu", "nproc_per_node": nproc},
        "trainer": _trainer(out, micro_batch_size=2),
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": True, "optim": dict(OPTIM),
                      "megatron": dict(block)},
            "ref": {"megatron": dict(block)},
            "rollout": {"n": 2, "response_length": 5},
        },
        # a reward that varies between a group's responses, so the advantages and the update are not 0
        "reward": {"function": f"{assets['reward']}:score"},
    }


def _run(cfg: dict, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    proc = trinity_run(cfg, path, timeout=600, reuse_conversion=True)  # 4 ranks on a shared 2-core runner
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = Path(cfg["trainer"]["output_dir"])
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((out / "hf").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return row, weights


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict], keys: tuple[str, ...]) -> None:
    (ra, wa), (rb, wb) = a, b
    numbers = sorted(k for k, v in ra.items() if isinstance(v, (int, float)) and not k.startswith(NOT_DETERMINISTIC))
    assert set(keys) <= set(numbers), numbers
    for key in numbers:
        assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (key, ra[key], rb[key])
    assert sorted(wa) == sorted(wb) and any(".experts." in n for n in wa)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.multiproc
@pytest.mark.slow
def test_moe_tp2_ep2_sp_grpo_equals_tp1(assets, tmp_path):
    base = load_file(str(assets["model"] / "model.safetensors"))
    runs = {name: _run(grpo_job(assets, tmp_path / name, block, nproc), tmp_path / f"{name}.yaml")
            for name, block, nproc in (("grpo_tp1", {}, 2), ("grpo_tp_ep", TP_EP, 4))}
    _assert_same(runs["grpo_tp1"], runs["grpo_tp_ep"], ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                                        "reward/mean", "response_length/mean"))
    assert runs["grpo_tp_ep"][0]["reward/std"] > 0 and runs["grpo_tp_ep"][0]["actor/grad_norm"] > 0
    weights = runs["grpo_tp_ep"][1]  # the step moved the weights (experts included)
    assert [n for n in base if ".experts." in n and not torch.equal(weights[n], base[n])]
