"""GRPO and PPO end to end on CPU through `trinity.cli.commands.run` (config -> torchrun -> worker -> RL loop).

A tiny random Qwen2 (2 layers, hidden 64) on the arithmetic prompts, with the dense closeness reward;
few steps: these check that every phase runs, metrics.jsonl holds what it should, every trained role is
checkpointed, and a run resumed from its step-2 checkpoint repeats step 3 of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import trinity_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_prompt_dataset

    root = tmp_path_factory.mktemp("rl_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    return {"model": model, "data": write_prompt_dataset(root / "prompts.jsonl", 64, seed=0)}


def job(assets: dict[str, Path], out: Path, algo: str, steps: int, **extra) -> dict:
    offload = {"param_offload": True, "grad_offload": True, "optimizer_offload": True}
    cfg = {
        "algorithm": {"name": algo, "use_kl_in_reward": algo == "ppo"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": [str(assets["data"])], "max_prompt_length": 32, "train_batch_size": 4},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {"total_steps": steps, "micro_batch_size": 4, "output_dir": str(out), "save_interval": 2,
                    "keep_last": 2, "log_interval": 1, "tensorboard": False, "export_hf": False},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": algo == "grpo", "entropy_coeff": 0.01,
                      "optim": {"lr": 1e-3, "weight_decay": 0.0}, "megatron": dict(offload)},
            "ref": {"megatron": {"param_offload": True}},
            "rollout": {"n": 2, "response_length": 6},
        },
        "reward": {"function": "trinity.rewards.arithmetic_reward:closeness"},
    }
    if algo == "ppo":
        cfg["critic"] = {"warmup_steps": 1, "optim": {"lr": 1e-3, "weight_decay": 0.0}, "megatron": dict(offload)}
    cfg.update(extra)
    return cfg


def run_job(cfg: dict, path: Path) -> str:
    proc = trinity_run(cfg, path, timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


RESUME_KEYS = ("actor/pg_loss", "reward/mean", "actor/grad_norm")


def resume_at_step_2(cfg: dict, out: Path, path: Path) -> list[dict]:
    """Rerun the same job from its step-2 checkpoint: the process starts fresh, loads the checkpoint
    (weights, optimizer, LR schedule, data position, RNG) and redoes step 3. The 3-step job itself wrote
    that checkpoint, so the LR schedule (cosine to total_steps) is the one of the uninterrupted run."""
    resumed = dict(cfg, trainer={**cfg["trainer"], "resume": str(out / "checkpoints" / "step_2")})
    log = run_job(resumed, path)
    assert "resumed from" in log and "at step 2" in log
    return rows(out)


NOT_DETERMINISTIC = ("time/", "tokens_per_s/", "mem/", "step_time_s")


def assert_same_step(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    """`keys` must be there; every other number that is not a time, a rate or a memory reading must match too.
    On CPU in fp32 they are bit for bit equal (measured); the tolerance only allows for another torch build."""
    for key in keys:
        assert isinstance(a[key], float), key
    numbers = sorted(k for k, v in a.items() if isinstance(v, (int, float)) and not k.startswith(NOT_DETERMINISTIC))
    assert set(keys) <= set(numbers) and sorted(k for k in b if k in numbers) == numbers
    for key in numbers:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-12), (key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.multiproc  # its last run resumes at CP=2 (two ranks)
def test_grpo_runs_checkpoints_and_resumes_exactly(assets, tmp_path):
    out = tmp_path / "grpo"
    cfg = job(assets, out, "grpo", 3)
    cfg["trainer"]["profile_step"] = 3
    log = run_job(cfg, tmp_path / "a.yaml")
    first = rows(out)
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [r.get("profiled") for r in first] == [None, None, 1]
    assert f"profiled step 3: trace {out / 'profile' / 'step_3.rank_0.json.gz'}" in log
    assert (out / "profile" / "step_3.rank_0.json.gz").stat().st_size > 1000
    # the profiled step's summary also times the rollout's decode steps per batch bucket: they add up to
    # the step's decode steps, printed and written beside the trace
    import re

    head = re.search(r"rollout: (\d+) decode steps, ([0-9.]+) ms in them; per batch bucket", log)
    assert head and int(head.group(1)) == first[2]["rollout/decode_steps"], log[-3000:]
    table = [re.sub(r"^\[\w+\]:", "", line) for line in log[head.end():].splitlines()[2:]]  # torchrun's prefix
    buckets = [line.split(" | ") for line in table if re.match(r"^\d+ \| \d+ \| ", line)]
    assert buckets and sum(int(b[1]) for b in buckets) == int(head.group(1)), table[:12]
    assert all(float(b[3]) > 0 for b in buckets), buckets
    assert head.group(0) in (out / "profile" / "step_3.rank_0.txt").read_text()
    for key in ("reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/entropy",
                "actor/kl_loss", "actor/ref_kl", "actor/pg_clipfrac", "advantages/mean", "time/rollout_s",
                "time/ref_s", "time/old_logp_s", "time/update_actor_s", "tokens_per_s/rollout"):
        assert all(isinstance(r[key], float) for r in first), key
    for phase in ("rollout", "reward", "ref", "old_logp", "update_actor"):
        for key in (f"mem/{phase}_gib", f"mem/{phase}_end_gib"):
            assert all(isinstance(r[key], float) and r[key] > 0 for r in first), key
    assert first[0]["actor/ref_kl"] == 0.0  # actor == ref before the first update
    limit = cfg["actor_rollout_ref"]["rollout"]["response_length"]
    for r in first:  # one DP rank: some response reached response_length exactly when the longest did
        assert 0.0 <= r["response_length/clip_ratio"] <= 1.0
        assert (r["response_length/clip_ratio"] > 0) == (r["response_length/max"] == limit), r
    assert 0.0 <= first[0]["reward/mean"] <= 1.0
    step2 = out / "checkpoints" / "step_2"
    assert (step2 / "complete").is_file() and (step2 / "actor" / "trinity_meta.json").is_file()
    assert not (step2 / "critic").exists()

    again = resume_at_step_2(cfg, out, tmp_path / "b.yaml")
    assert [r["step"] for r in again] == [1, 2, 3]
    assert again[:2] == first[:2]
    assert_same_step(first[2], again[2], RESUME_KEYS)

    # context parallelism: step 3 once more from the same checkpoint at CP=2 (two ranks, DP=1): checkpoints
    # do not depend on CP, and ring attention, the row split and the gathered log-probs give CP=1's metrics
    cp = dict(cfg, cluster={**cfg["cluster"], "nproc_per_node": 2}, trainer={**cfg["trainer"], "profile_step": None})
    cp["actor_rollout_ref"] = {role: ({**v, "megatron": {**v["megatron"], "context_parallel_size": 2}}
                                      if role in ("actor", "ref") else v)
                               for role, v in cfg["actor_rollout_ref"].items()}
    on_cp2 = resume_at_step_2(cp, out, tmp_path / "c.yaml")
    assert [r["step"] for r in on_cp2] == [1, 2, 3]
    # fp32 in another summation order (a loss near 0 differs by rounding alone); the rows the update computes
    # are padded to 2·CP chunks (padding_fraction/update_actor differs by design)
    a, b = first[2], on_cp2[2]
    for key in (*RESUME_KEYS, "actor/entropy", "actor/kl_loss", "actor/ref_kl", "actor/ppo_kl", "actor/loss",
                "reward/std", "advantages/max", "response_length/mean", "rollout/decode_steps"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


@pytest.mark.slow
def test_ppo_saves_during_critic_warmup_and_resumes_exactly(assets, tmp_path):
    """PPO with one warm-up step (only the critic trains), saving every step. The checkpoint written
    during the warm-up holds an actor optimizer that has never stepped: it saves, and the run resumed from
    it trains the actor's first step and the step after exactly as the uninterrupted run did, the critic
    included (its values feed the advantages and its own loss)."""
    out = tmp_path / "ppo"
    cfg = job(assets, out, "ppo", 3)
    cfg["trainer"].update(save_interval=1, keep_last=3)
    run_job(cfg, tmp_path / "p.yaml")
    r1, r2, r3 = rows(out)
    assert r1["actor/warmup"] is True and "actor/pg_loss" not in r1  # warm-up: only the critic trains
    assert r2["actor/warmup"] is False and isinstance(r2["actor/pg_loss"], float)
    for r in (r1, r2, r3):
        assert isinstance(r["critic/vf_loss"], float) and r["critic/vf_loss"] >= 0
        assert "time/values_s" in r and "time/update_critic_s" in r
    step1 = out / "checkpoints" / "step_1"
    assert (step1 / "complete").is_file()
    for role in ("actor", "critic"):
        assert (step1 / role / "trinity_meta.json").is_file(), role

    resumed = dict(cfg, trainer={**cfg["trainer"], "resume": str(step1)})
    log = run_job(resumed, tmp_path / "q.yaml")
    assert f"resumed from {step1} at step 1" in log
    again = rows(out)
    assert [r["step"] for r in again] == [1, 2, 3] and again[0] == r1
    keys = RESUME_KEYS + ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean")
    assert_same_step(r2, again[1], keys)
    assert_same_step(r3, again[2], keys)


FAILING_REWARD = '''
def score(prompts, responses, answers):
    out = []
    for answer in answers:
        if answer == {bad!r}:
            raise ValueError("cannot score answer " + answer)
        out.append(0.5)
    return out
'''


@pytest.mark.slow
def test_failing_user_reward_is_a_clean_error_naming_the_sample(assets, tmp_path):
    """A user reward function (a .py file) that raises on one prompt's samples: `trinity run` exits 2 (a
    UserError) and names the function, the sample and the error, without a traceback."""
    data = assets["data"].read_text().splitlines()[:4]  # train_batch_size 4: step 1 scores all of them
    (tmp_path / "prompts.jsonl").write_text("\n".join(data) + "\n")
    bad = json.loads(data[2])["answer"]
    reward = tmp_path / "my_reward.py"
    reward.write_text(FAILING_REWARD.format(bad=bad))
    cfg = job(assets, tmp_path / "run", "grpo", 2, reward={"function": f"{reward}:score"})
    cfg["data"]["train_files"] = [str(tmp_path / "prompts.jsonl")]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def trinity_run(*flags: str) -> tuple[int, str]:
        proc = subprocess.run(["trinity", "run", "--config", str(tmp_path / "job.yaml"), *flags], cwd=REPO,
                              env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
        print(proc.stdout[-3000:])
        return proc.returncode, proc.stdout

    code, text = trinity_run()
    assert code == 2, (code, text[-3000:])
    found = re.search(rf"reward function {re.escape(str(reward))}:score failed on sample (\d+) \(prompt '.*', "
                      rf"response '.*'\): ValueError: cannot score answer {re.escape(bad)}", text)
    assert found and 0 <= int(found.group(1)) < 8, text[-3000:]
    assert "error (rank 0)" in text
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]
    assert "job failed with exit code 2" in text
    assert not (tmp_path / "run" / "checkpoints" / "step_1").exists()
    # --debug shows the worker's traceback (this job of one process runs without torchrun); the exit code
    # and the worker's line stay the same
    code, text = trinity_run("--debug")
    assert code == 2 and "Traceback" in text and found.group(0) in text, (code, text[-3000:])
    # reward.on_error: zero: the job trains; the bad prompt's 2 samples score 0 in each step, counted in
    # reward/errors, with one warning per step
    code, text = trinity_run("reward.on_error=zero")
    assert code == 0, text[-3000:]
    assert [r["reward/errors"] for r in rows(tmp_path / "run")] == [2, 2]
    warnings = re.findall(rf"warning: reward function {re.escape(str(reward))}:score failed on 2 of 8 samples this "
                          rf"step, scored 0 \(reward.on_error: zero\); the first: reward function .* failed on sample "
                          rf"\d+ \(prompt .*\): ValueError: cannot score answer {re.escape(bad)}", text)
    assert len(warnings) == 2, text[-3000:]
