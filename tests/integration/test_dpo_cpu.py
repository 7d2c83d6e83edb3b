"""DPO end to end on CPU through a real `trinity run` (validation, HF -> dist cache, torchrun, the DPO
recipe over the actor and the frozen ref engines, checkpoint, resume).

The pairs prefer one answer style over another: chosen is the exact result of an arithmetic prompt,
rejected is "no idea". At step 1 the policy is the reference, so every pair's loss is log 2 and its
rewards are 0; over the steps the policy moves towards the chosen style, so accuracy and margin rise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import trinity_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_dpo_dataset

    root = tmp_path_factory.mktemp("dpo_assets")
    tok = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    # chosen: the exact result; rejected: "no idea"; half the pairs as chat messages
    data = write_dpo_dataset(root / "pairs.jsonl", 64, seed=0)
    return {"model": model, "data": data}


def job(assets: dict[str, Path], out: Path, steps: int) -> dict:
    """configs/dpo_tiny_cpu.yaml on the test's assets: what the docs show is what runs here."""
    cfg = yaml.safe_load((REPO / "configs" / "dpo_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(assets["model"])
    cfg["data"]["train_files"] = [str(assets["data"])]
    cfg["trainer"].update(total_steps=steps, output_dir=str(out), save_interval=4)
    return cfg


def rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_dpo_learns_the_preferred_style_and_resumes(assets, tmp_path):
    out = tmp_path / "run"
    proc = trinity_run(job(assets, out, 8), tmp_path / "job.yaml", timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:]
    m = rows(out)
    assert sorted(m) == list(range(1, 9))
    first, last = m[1], m[8]
    # policy == ref at step 1: h = 0 for every pair
    assert abs(first["loss"] - math.log(2)) < 1e-5
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert first["rewards/accuracies"] == 0.0  # ties are not wins
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "lr"):
        assert math.isfinite(first[key]), key
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    # the policy learns the preference
    assert last["rewards/accuracies"] >= 0.9, [r["rewards/accuracies"] for r in m.values()]
    assert last["rewards/margins"] > 0.5, [r["rewards/margins"] for r in m.values()]
    assert last["loss"] < 0.5 * math.log(2)
    margins = [m[i]["rewards/margins"] for i in range(1, 9)]
    assert margins == sorted(margins), margins  # rises step by step on this easy preference
    assert "step 1/8 | loss 0.6931 | acc 0.00 | margin 0.0000 |" in proc.stdout

    # resume through the loop's checkpoint manager: the actor and the data position come back, the ref
    # is the initial model again (never saved)
    import shutil

    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints" / "step_8", again / "checkpoints" / "step_8")  # keep_last 1: only step 8
    proc = trinity_run(job(assets, again, 10), tmp_path / "resume.yaml", timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resumed from" in proc.stdout
    r = rows(again)
    assert sorted(r) == [9, 10]
    # the ref is still the initial model after resume: the rewards keep growing from where they were
    assert r[10]["rewards/accuracies"] >= 0.9 and r[10]["rewards/margins"] > last["rewards/margins"] * 0.5
