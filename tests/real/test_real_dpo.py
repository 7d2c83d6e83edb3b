"""DPO of the real model (issue 22): on 8 pairs that prefer the right sum of two digits over a wrong one,
asked through the tokenizer's own chat template, the preference accuracy on those training pairs rises
from 0 (policy = reference at step 1, so no pair is preferred yet) and the reward margin grows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from tests.conftest import trinity_run

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def _pairs(path: Path, n: int, seed: int = 0) -> Path:
    from trinity.testing.real_model import ADDITION_PROMPT

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            wrong = a + b + rng.choice([-2, -1, 1, 2])
            f.write(json.dumps({"prompt": ADDITION_PROMPT.format(a=a, b=b), "chosen": str(a + b),
                                "rejected": str(wrong)}) + "\n")
    return path


def test_dpo_preference_accuracy_rises(real_assets, tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "dpo_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(real_assets / "model")
    # 8 pairs, one global batch: every step sees the same training pairs, whose accuracy is measured.
    # seq_length 48: the pairs are 46-47 tokens (the template's system prompt, the question, 1-2 digits and
    # the end of turn), and every row is padded to seq_length: 64 trained and referenced 25% padding
    pairs = _pairs(tmp_path / "pairs.jsonl", 8)
    cfg["data"].update(train_files=[str(pairs)], seq_length=48, shuffle=False)
    # 2 steps: measured accuracies 0, 0.75 (then 0.875, 0.875) and margins 0, 0.27 (then 0.54, 0.84); each
    # step of the 135M model is ~15-40 s of CI time, so the test stops at the first update's effect
    cfg["trainer"].update(output_dir=str(tmp_path / "run"), total_steps=2, global_batch_size=8,
                          micro_batch_size=4, save_interval=None, export_hf=False,
                          save_last=False)  # nothing reads a checkpoint here: saving ~1.6 GB costs 10-17 s
    cfg["actor_rollout_ref"]["actor"]["optim"].update(lr=2.0e-5, lr_warmup_steps=0)
    proc = trinity_run(cfg, tmp_path / "dpo.yaml", timeout=800, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]

    # every pair whole: none cut to seq_length
    assert "0 truncated, 0 dropped" in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rewards/accuracies" in r]
    assert [r["step"] for r in rows] == [1, 2]
    acc = [r["rewards/accuracies"] for r in rows]
    margins = [r["rewards/margins"] for r in rows]
    # step 1: the policy is the reference, every implicit reward is 0 and the loss is log 2
    assert acc[0] == 0.0 and abs(rows[0]["loss"] - 0.6931472) < 1e-4, rows[0]
    # the same pairs at every step: one update moves the policy towards the right sums (6 of 8 measured)
    assert acc[-1] >= 0.625, acc
    assert margins[-1] > 0.1, margins
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05, rows
    # save_last: false wrote no checkpoint
    assert not list((tmp_path / "run").glob("checkpoints/step_*")), list((tmp_path / "run").rglob("step_*"))
