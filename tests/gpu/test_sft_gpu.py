"""SFT on one GPU in bf16 through `trinity run` (torchrun, NCCL): the job of the CPU tests at a
GPU-sized step. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest

from tests.conftest import trinity_run

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_sft_one_gpu_bf16_learns_resumes_and_exports(tmp_path):
    from trinity.testing.tiny_assets import make_tiny_qwen2, make_tiny_tokenizer, write_sft_dataset

    tok = make_tiny_tokenizer(tmp_path / "tok")
    model = make_tiny_qwen2(tmp_path / "model", tok, num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2)
    data = write_sft_dataset(tmp_path / "sft.jsonl", 4000, seed=0)
    out = tmp_path / "run"
    cfg = {
        "algorithm": {"name": "sft"},
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "seq_length": 512},
        "cluster": {"device": "cuda", "nproc_per_node": 1},
        "trainer": {"total_steps": 40, "global_batch_size": 16, "micro_batch_size": 4, "output_dir": str(out),
                    "save_interval": 20, "log_interval": 10, "tensorboard": False},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 2e-3, "lr_warmup_steps": 4, "weight_decay": 0.0}}},
    }
    proc = trinity_run(cfg, tmp_path / "job.yaml", timeout=540)
    assert proc.returncode == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert all(r["mem_peak_gib"] > 0 for r in rows)
    meta = json.loads((out / "checkpoints" / "step_40" / "trinity_meta.json").read_text())
    assert meta["dtype"] == "bfloat16"

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.bfloat16)
    assert next(hf.parameters()).dtype == torch.bfloat16
