"""Partial rollouts learn as much per trained sample: GRPO on the arithmetic task (tests/gpu/jobs.py: the
tiny Qwen2, `arithmetic_reward:digit_fraction`) with actor_rollout_ref.rollout.partial on and off, 3 seeds
each, the same steps (so the same trained samples: data.train_batch_size groups a step either way). The
mean reward of the last 3 steps with partial rollouts is not below the one without, within the noise
over the seeds; both rise.

A random model rarely samples its one EOS: 40 of the ~260 tokens end an answer here (a copy of the model
with a generation_config.json that names them), so that answers end at different lengths and partial
rollouts carry some over.

Run on a GPU machine: `python -m pytest tests/gpu/test_partial_gpu.py -q -s` (about 6 jobs of 12 steps).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from tests.gpu.jobs import make_assets, note, rl_job, run_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, SEEDS = 12, (0, 1, 2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partial_gpu")
    assets = make_assets(root)
    model = root / "dense_eos"
    shutil.copytree(assets["dense"], model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(40, 80))}))
    return {**assets, "dense": model}


def _last_reward(rows: list[dict]) -> float:
    return sum(r["reward/mean"] for r in rows[-3:]) / 3


# Not met yet (issue 43): on 4 H100s (lanes of 2, one GPU used) the last-3-step reward was 0.816 / 0.864 / 0.892
# with partial rollouts against 0.918 / 0.927 / 0.909 without (difference -0.061, noise 0.048). Oldest-first
# training makes most trained groups one update old (rollout/staleness_mean 0.5-0.9), and this task's reward
# moves ~0.1 a step, so a one-step lag shows. Kept as the target's check; the xfail is not strict so that it
# reports the day it passes.
@pytest.mark.xfail(reason="partial rollouts lag ~0.06 reward per sample on this fast-moving task (issue 43)",
                   strict=False)
def test_partial_rollouts_learn_as_much_per_sample(assets, tmp_path):
    got: dict[bool, list[float]] = {False: [], True: []}
    for seed in SEEDS:
        for partial in (False, True):
            out = tmp_path / f"seed{seed}_{'partial' if partial else 'full'}"
            cfg = rl_job(assets, "grpo", out, 1, steps=STEPS, trainer={"seed": seed})
            cfg["actor_rollout_ref"]["rollout"]["response_length"] = 32
            if partial:
                cfg["actor_rollout_ref"]["rollout"]["partial"] = {"enable": True}
            rows = run_job(cfg, tmp_path / f"{out.name}.yaml")
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
            first = sum(r["reward/mean"] for r in rows[:3]) / 3
            got[partial].append(_last_reward(rows))
            note(f"  seed {seed} partial {partial}: reward {first:.3f} -> {got[partial][-1]:.3f}; step s "
                 f"{[round(r['step_time_s'], 2) for r in rows]}" + (
                     f"; carried {[r['rollout/carried_over'] for r in rows]}, staleness "
                     f"{[round(r['rollout/staleness_mean'], 2) for r in rows]}, IS max "
                     f"{[round(r['rollout/is_weight_max'], 2) for r in rows]}" if partial else ""))
            assert got[partial][-1] > first + 0.05, (seed, partial, [round(r["reward/mean"], 3) for r in rows])
            if partial:
                assert any(r["rollout/carried_over"] > 0 for r in rows)
    diffs = [on - off for on, off in zip(got[True], got[False])]
    noise = 2 * statistics.stdev(got[False] + got[True]) / len(SEEDS) ** 0.5
    note(f"  partial on {got[True]} off {got[False]}: mean difference {statistics.mean(diffs):+.3f}, noise {noise:.3f}")
    assert statistics.mean(got[True]) >= statistics.mean(got[False]) - max(noise, 0.03), (got, noise)
