"""Continued pre-training (algorithm.name: pt) end to end on CPU through `trinity run`.

A Megatron indexed dataset is made in the test with megatron-core's IndexedDatasetBuilder from the
quickstart tokenizer; a job on it trains, and a second job resumed from its middle checkpoint gives the
same losses as the uninterrupted run. A job on a text jsonl learns (its loss falls) and exports HF.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import trinity_run


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    import random

    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    from trinity.testing.tiny_assets import arithmetic_problem, make_tiny_qwen2, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("pt_assets")
    tok_dir = make_tiny_tokenizer(root / "tokenizer")
    model = make_tiny_qwen2(root / "model", tok_dir, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    rng = random.Random(0)
    # Documents of arithmetic lines: regular enough for a tiny model to learn within a few steps.
    texts = [" ".join("".join(arithmetic_problem(rng)) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    builder = IndexedDatasetBuilder(str(root / "arith_text_document.bin"), dtype=np.uint16)
    for text in texts[:200]:  # as `preprocess_data.py --append-eod` writes them
        builder.add_item(torch.tensor(tok(text)["input_ids"] + [tok.eos_token_id]))
        builder.end_document()
    builder.finalize(str(root / "arith_text_document.idx"))
    jsonl = root / "arith.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[200:]))
    return {"model": model, "indexed": root / "arith_text_document", "jsonl": jsonl}


def job(assets: dict[str, Path], out: Path, train_files: list, **trainer) -> dict:
    return {
        "algorithm": {"name": "pt"},
        "model": {"path": str(assets["model"])},
        "data": {"train_files": train_files, "seq_length": 64},
        "cluster": {"device": "cpu", "nproc_per_node": 1},
        "trainer": {
            "total_steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "output_dir": str(out),
            "keep_last": 2, "log_interval": 1, "tensorboard": False, "export_hf": False, **trainer,
        },
        "actor_rollout_ref": {"actor": {"optim": {
            "lr": 3e-3, "lr_warmup_steps": 1, "lr_scheduler": "constant", "weight_decay": 0.0, "clip_grad": 1.0,
        }}},
    }


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 6-step job on the indexed dataset, checkpointing at 3 and 6: (output_dir, its output)."""
    tmp = tmp_path_factory.mktemp("pt_base")
    proc = trinity_run(job(assets, tmp / "run", [str(assets["indexed"])], save_interval=3), tmp / "base.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return tmp / "run", proc.stdout


@pytest.mark.slow
def test_indexed_dataset_trains(baseline):
    out, text = baseline
    assert "data: pt: 200 documents" in text and "(indexed: 200 documents" in text
    assert "rows of 64 tokens per epoch (concatenated, 0.0% padding)" in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["loss_tokens"] == 8 * 64 for r in rows)  # every token of every row is trained
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_indexed_dataset_resumes_at_the_same_position(assets, baseline, tmp_path):
    """A new run resumed from the middle checkpoint reads the rows the uninterrupted run read next:
    the same losses."""
    base, _ = baseline
    full = losses(base)
    out = tmp_path / "resumed"
    cfg = job(assets, out, [str(assets["indexed"])], resume=str(base / "checkpoints" / "step_3"))
    proc = trinity_run(cfg, tmp_path / "resumed.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"resumed from {base / 'checkpoints' / 'step_3'} at step 3" in proc.stdout
    again = losses(out)
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(full[step], rel=1e-6, abs=0), (step, full, again)


@pytest.mark.slow
def test_text_jsonl_job_learns_and_exports(assets, tmp_path):
    out = tmp_path / "run"
    cfg = job(assets, out, [str(assets["jsonl"])], total_steps=12, export_hf=True)
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=240, reuse_conversion=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "(records: 200 documents" in proc.stdout
    b = losses(out)
    assert b[12] < 0.6 * b[1], b
    assert (out / "hf" / "config.json").is_file()


def test_the_example_config_validates(assets, monkeypatch, capsys):
    """configs/pt_tiny_cpu.yaml (the repository's docs as a blend) with a model of its tokenizer."""
    from trinity.cli.commands import validate

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert validate(Path("configs/pt_tiny_cpu.yaml"), [f"model.path={assets['model']}"], json_out=True) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    assert [s["path"] for s in data["sources"]] == ["README.md", "docs/quickstart.md", "docs/parallelism.md"]
    assert sum(s["rows_per_epoch"] for s in data["sources"]) == data["rows_per_epoch"]
    assert [s["share"] for s in data["sources"]] == pytest.approx([0.25, 0.25, 0.5], abs=0.01)  # weights 1:1:2
    assert data["packing"] is False and data["total_steps"] == 40
