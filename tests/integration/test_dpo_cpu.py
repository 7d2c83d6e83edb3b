"""DPO end to end on CPU through a real `trinity run` (validation, HF -> dist cache, torchrun, the DPO
recipe over the actor and the frozen ref engines, checkpoint, resume on another layout).

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
    cfg["trainer"].update(total_steps=steps, output_dir=str(out), save_interval=4, keep_last=2, export_hf=False)
    return cfg


def rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory) -> tuple[Path, str]:
    """8 steps of the example config at TP=PP=DP=1, 4 pairs per micro batch: (run folder, console output)."""
    root = tmp_path_factory.mktemp("dpo_run")
    proc = trinity_run(job(assets, root / "run", 8), root / "job.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return root / "run", proc.stdout


@pytest.mark.slow
def test_dpo_starts_at_log_2_and_learns_the_preference(assets, baseline, tmp_path):
    out, stdout = baseline
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
    assert "step 1/8 | loss 0.6931 | acc 0.00 | margin 0.0000 |" in stdout


@pytest.mark.slow
def test_dpo_resumes_exactly_on_another_layout(assets, baseline, tmp_path):
    """The baseline's step-4 checkpoint resumed at PP=2 with one pair per micro batch: steps 5-6 equal the
    baseline's. This checks the resume through the loop's generic checkpoint manager (actor, optimizer,
    data position; the ref is rebuilt from the initial weights, never saved), the ref's log-probs
    broadcast from the last stage, and the loss normalisation (8 micro batches instead of 2)."""
    import shutil

    out = tmp_path / "pp2"
    shutil.copytree(baseline[0] / "checkpoints" / "step_4", out / "checkpoints" / "step_4")
    cfg = job(assets, out, 6)
    cfg["cluster"]["nproc_per_node"] = 2
    cfg["trainer"].update(micro_batch_size=1, save_interval=None, export_hf=False)
    for role in ("actor", "ref"):
        cfg["actor_rollout_ref"].setdefault(role, {})["megatron"] = {"pipeline_model_parallel_size": 2}
    proc = trinity_run(cfg, tmp_path / "pp2.yaml", timeout=170, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    base, pp = rows(baseline[0]), rows(out)
    assert sorted(pp) == [5, 6]
    for step in (5, 6):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "grad_norm"):
            assert pp[step][key] == pytest.approx(base[step][key], rel=1e-5, abs=1e-5), (step, key)
