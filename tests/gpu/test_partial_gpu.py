"""Partial rollouts learn as much per trained sample: GRPO on the arithmetic task (tests/gpu/jobs.py: the
tiny Qwen2, `arithmetic_reward:digit_fraction`) with actor_rollout_ref.rollout.partial on and off, 3 seeds
each, the same steps (so the same trained samples: data.train_batch_size groups a step either way).

The policy is measured by evaluation, not by the trained batches' reward: with partial rollouts most trained
answers were written (in part) by the previous step's policy, so `reward/mean` of a step lags the policy by
about one update on a task whose reward moves ~0.1 a step. Every 2 steps each job samples 4 answers at
temperature 1 to each of 32 held-out arithmetic prompts (`data.val_files`, `rollout.val_kwargs`,
`val/reward_mean`: greedy answers are all digits after a few steps either way, which compares nothing); the
mean of its last 3 evaluations (steps 8, 10, 12) with partial rollouts is not below the one without,
within the noise over the seeds. The trained reward must rise in both.

A random model rarely samples its one EOS: 40 of the ~260 tokens end an answer here (a copy of the model
with a generation_config.json that names them), so that answers end at different lengths and partial
rollouts carry some over. The 6 jobs run side by side, one per visible GPU at a time.

Run on a GPU machine: `python -m pytest tests/gpu/test_partial_gpu.py -q -s`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import trinity_run
from tests.gpu.jobs import make_assets, metrics, note, rl_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, SEEDS, VAL_EVERY = 12, (0, 1, 2), 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partial_gpu")
    assets = make_assets(root)
    model = root / "dense_eos"
    shutil.copytree(assets["dense"], model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(40, 80))}))
    from trinity.testing.tiny_assets import write_prompt_dataset

    return {**assets, "dense": model, "val": write_prompt_dataset(root / "val.jsonl", 32, seed=7)}


def _last_reward(rows: list[dict]) -> float:
    return sum(r["reward/mean"] for r in rows[-3:]) / 3


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def _run_side_by_side(jobs: dict[str, dict], tmp_path: Path) -> dict[str, list[dict]]:
    """Each job on one GPU of its own (CUDA_VISIBLE_DEVICES), as many at once as there are GPUs."""
    free: queue.Queue[str] = queue.Queue()
    for gpu in _gpus():
        free.put(gpu)

    def one(name: str) -> list[dict]:
        gpu = free.get()
        try:
            proc = trinity_run(jobs[name], tmp_path / f"{name}.yaml", timeout=420, env={"CUDA_VISIBLE_DEVICES": gpu},
                               reuse_conversion=True)
        finally:
            free.put(gpu)
        assert proc.returncode == 0, (name, proc.stdout[-4000:])
        return metrics(Path(jobs[name]["trainer"]["output_dir"]))

    with ThreadPoolExecutor(len(_gpus())) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))


def test_partial_rollouts_learn_as_much_per_sample(assets, tmp_path):
    jobs = {}
    for seed in SEEDS:
        for partial in (False, True):
            name = f"seed{seed}_{'partial' if partial else 'full'}"
            cfg = rl_job(assets, "grpo", tmp_path / name, 1, steps=STEPS,
                         trainer={"seed": seed, "val_interval": VAL_EVERY, "val_before_train": False})
            cfg["data"]["val_files"] = [str(assets["val"])]
            cfg["actor_rollout_ref"]["rollout"]["response_length"] = 32
            cfg["actor_rollout_ref"]["rollout"]["val_kwargs"] = {"do_sample": True, "temperature": 1.0, "n": 4}
            if partial:
                cfg["actor_rollout_ref"]["rollout"]["partial"] = {"enable": True}
            jobs[name] = cfg
    results = _run_side_by_side(jobs, tmp_path)
    got: dict[bool, list[float]] = {False: [], True: []}
    for seed in SEEDS:
        for partial in (False, True):
            rows = results[f"seed{seed}_{'partial' if partial else 'full'}"]
            train = [r for r in rows if "reward/mean" in r]
            val = [r for r in rows if "val/reward_mean" in r]
            assert [r["step"] for r in train] == list(range(1, STEPS + 1))
            assert [r["step"] for r in val] == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY)), val
            first = sum(r["reward/mean"] for r in train[:3]) / 3
            last = sum(r["reward/mean"] for r in train[-3:]) / 3
            got[partial].append(sum(r["val/reward_mean"] for r in val[-3:]) / 3)
            note(f"  seed {seed} partial {partial}: trained reward {first:.3f} -> {last:.3f}; val "
                 f"{[round(r['val/reward_mean'], 3) for r in val]}; step s "
                 f"{[round(r['step_time_s'], 2) for r in train]}" + (
                     f"; carried {[r['rollout/carried_over'] for r in train]}, staleness "
                     f"{[round(r['rollout/staleness_mean'], 2) for r in train]}, IS max "
                     f"{[round(r['rollout/is_weight_max'], 2) for r in train]}" if partial else ""))
            assert last > first + 0.05, (seed, partial, [round(r["reward/mean"], 3) for r in train])
            if partial:
                assert any(r["rollout/carried_over"] > 0 for r in train)
    diffs = [on - off for on, off in zip(got[True], got[False])]
    noise = 2 * statistics.stdev(got[False] + got[True]) / len(SEEDS) ** 0.5
    note(f"  val reward (last 3 evaluations) partial on {got[True]} off {got[False]}: mean difference "
         f"{statistics.mean(diffs):+.3f}, noise {noise:.3f}")
    assert statistics.mean(got[True]) >= statistics.mean(got[False]) - max(noise, 0.03), (got, noise)
