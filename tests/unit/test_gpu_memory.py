"""The estimate against this machine's GPUs: `trinity validate` / `trinity run` warn when the estimated peak per
GPU is above 90% of the smallest visible GPU's memory, read with nvidia-smi (here a stand-in script on PATH
printing what nvidia-smi prints for that query)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trinity.launch.gpu_memory import memory_warning, visible_gpu_memory

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Puts an `nvidia-smi` on PATH that answers the query with `rows` (index, uuid, MiB)."""
    def install(rows: list[tuple[int, str, int]]) -> None:
        script = tmp_path / "bin" / "nvidia-smi"
        script.parent.mkdir(exist_ok=True)
        body = "".join(f"{i}, {u}, {m}\n" for i, u, m in rows)
        script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{body}EOF\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


def test_smallest_visible_gpu_by_index_or_uuid(nvidia_smi, monkeypatch):
    nvidia_smi([(0, "GPU-aaa", 81559), (1, "GPU-bbb", 40960), (2, "GPU-ccc", 143771)])
    assert visible_gpu_memory() == 40960 * 2**20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert visible_gpu_memory() == 81559 * 2**20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ccc")
    assert visible_gpu_memory() == 143771 * 2**20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert visible_gpu_memory() is None


def test_no_nvidia_smi_means_no_reading(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpu_memory() is None


def test_the_warning_starts_above_90_percent():
    assert memory_warning(70 * GIB, 80 * GIB) is None
    assert memory_warning(90 * GIB, None) is None
    text = memory_warning(int(72.5 * GIB), 80 * GIB)
    assert text is not None and "72.50 GiB" in text and "80.00 GiB each" in text
    assert "actor.ppo_max_token_len_per_gpu" in text and "recompute_granularity" in text


def test_validate_warns_for_a_7b_grpo_job_on_small_gpus(nvidia_smi, capsys, monkeypatch):
    from trinity.cli.commands import validate

    overrides = ["model.path=tests/fixtures/hf_configs/qwen2_5_7b", "data.train_files=[tests/fixtures/data/prompts.jsonl]"]
    monkeypatch.chdir(REPO)
    nvidia_smi([(i, f"GPU-{i}", 81559) for i in range(8)])
    assert validate(Path("configs/grpo_qwen2_5_7b_8gpu.yaml"), overrides) == 0
    assert "warning: the estimated peak per GPU" not in capsys.readouterr().out  # 31.92 GiB on 80 GB GPUs
    nvidia_smi([(i, f"GPU-{i}", 24576) for i in range(8)])
    assert validate(Path("configs/grpo_qwen2_5_7b_8gpu.yaml"), overrides) == 0
    out = capsys.readouterr().out
    assert "warning: the estimated peak per GPU, 31.92 GiB, is more than 90% of this machine's GPUs (24.00 GiB each" in out
