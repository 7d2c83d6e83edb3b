"""GRPO on the real model (configs/smollm2_grpo_cpu.yaml, its first step): one-digit additions, "answer
with the number only", exact-match reward. The base model is right about a quarter of the time at
temperature 0.7 (it often explains instead of answering); one update lifts its greedy pass@1 on 64
held-out sums from 27/64 by more than 0.3, on two reduction orders.

The example's exact numbers depend on the processor (the order of floating-point sums: SIMD width, BLAS
kernels), so the test runs it twice, differently rounded, and checks that both runs land in the documented
range rather than on one machine's digits:
  - run A: the suite's settings (one intra-op thread, the best SIMD kernels torch finds here);
  - run B: ATEN_CPU_CAPABILITY=default (torch's non-vectorised kernels: other sums, so other low bits from
    the first forward on) and another trainer.seed. The seed is there because rounding alone changes a
    sampled token only after some steps (on the 2-core AMD machine the docs were measured on, the two
    capabilities sampled the same tokens for 5 steps); a processor whose rounding flips a token early
    gives a run that differs like another seed's, which is what the issue's machine did.
A 1-step prefix of the example is the example itself up to step 1 (constant lr; the data order and each
step's sampling seed do not depend on total_steps or on the evaluations). One step, not two: each step of
the 135M model is ~60 s of CPU time on 2 cores, and one update already moves the held-out score by
0.34-0.39 (49 and 52 of 64 measured after step 1, against 27).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import trinity_run

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
# One update, then the held-out evaluation (val_interval = STEPS): measured 52/64 (run A) and 49/64 (run B)
# against the base model's 27/64, the same as after step 2 of the full example (49-52 of 64 over the
# settings in docs/real-model.md).
STEPS = 1
BASE_VAL = 27 / 64  # the base model's greedy pass@1, on every setting measured
MIN_RISE = 0.3

VARIANTS = {
    "A": ({}, {}),
    "B": ({"ATEN_CPU_CAPABILITY": "default"}, {"seed": 1, "val_before_train": False}),
}


def _run(real_assets: Path, tmp_path: Path, name: str) -> list[dict]:
    env, trainer = VARIANTS[name]
    cfg = yaml.safe_load((REPO / "configs" / "smollm2_grpo_cpu.yaml").read_text())
    cfg["model"]["path"] = str(real_assets / "model")
    cfg["data"]["train_files"] = [str(real_assets / "data" / "grpo_add_train.jsonl")]
    cfg["data"]["val_files"] = [str(real_assets / "data" / "grpo_add_val.jsonl")]
    out = tmp_path / f"run_{name}"
    # no final checkpoint (save_last): nothing reads it, and saving ~1.6 GB costs 10-17 s of CI time;
    # val_interval = STEPS: one evaluation at the end (and before step 1 unless val_before_train is off)
    cfg["trainer"].update(total_steps=STEPS, val_interval=STEPS, output_dir=str(out), save_interval=None,
                          save_last=False, **trainer)
    proc = trinity_run(cfg, tmp_path / f"grpo_{name}.yaml", timeout=700, env=env, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_reward_rises_on_two_reduction_orders(real_assets, tmp_path):
    runs = {name: _run(real_assets, tmp_path, name) for name in VARIANTS}
    for name, rows in runs.items():
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        assert len(rewards) == STEPS, (name, rewards)
        val = {r["step"]: r["val/reward_mean"] for r in rows if "val/reward_mean" in r}
        step1 = next(r for r in rows if "reward/mean" in r)
        # answers of real lengths: some rows end at the model's EOS, some reach response_length (12), and
        # the rollout ran only as many decode steps as its longest row needed (measured: mean 9.7, max 12,
        # half of the rows clipped)
        assert 0.0 < step1["response_length/clip_ratio"] < 1.0, (name, step1)
        assert step1["response_length/mean"] < step1["response_length/max"], (name, step1)
        # the update's rows are packed (no padding); in fp32 the rollout's log-probs and the training
        # forward's agree (measured: mean 1.7e-5, max 6.3e-5)
        assert step1["padding_fraction/update_actor"] == 0.0, (name, step1)
        assert step1["rollout/logprob_diff_max"] < 1e-3, (name, step1)
        # step 1 is the base model's rollout (0.156 and 0.406 measured, by seed)
        assert rewards[0] < 0.5, (name, rewards)
        # the documented range after the first update: held-out greedy pass@1
        assert val[STEPS] - BASE_VAL > MIN_RISE, (name, val)
        if name == "A":
            # greedy pass@1 of the base model on the 64 held-out sums (27/64); run B skips this evaluation
            assert sorted(val) == [0, STEPS], val
            assert val[0] == pytest.approx(BASE_VAL), val
        else:
            assert sorted(val) == [STEPS], val
    # the two runs took different paths (other prompts and samples from step 1 on), not one run twice
    responses = [(tmp_path / f"run_{name}" / "samples" / "step_1.jsonl").read_text() for name in VARIANTS]
    assert responses[0] != responses[1]
