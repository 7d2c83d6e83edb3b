"""`trinity convert` on the real model: HF -> megatron-core at TP=3 (three gloo ranks) -> HF, each way with
`--verify`; TP=2 is refused (9 attention heads). TP=1's conversion is the one every `trinity run` of the
real model makes (tests/real/test_real_sft.py and the others start from it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trinity.convert.verify import compare_folders

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(600)]


def _trinity(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "trinity.cli.main", *args], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _max_diff(out: str) -> float:
    m = re.search(r"max \|Δ\| ([0-9.e+-]+)", out)
    assert m, out
    return float(m.group(1))


def test_tp2_is_refused_before_any_work(real_model, tmp_path):
    # 9 query heads / 3 KV heads: TP must divide both
    proc = subprocess.run([sys.executable, "-m", "trinity.cli.main", "convert", "hf-to-mcore", "--hf-path", str(real_model),
                           "--output", str(tmp_path / "mc"), "--tp", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --tp: 9 attention heads are not divisible by TP=2"
    assert not (tmp_path / "mc").exists()


@pytest.mark.multiproc
def test_round_trip_tp3(real_model, tmp_path):
    """TP=3 (the model's 9 heads / 3 KV heads allow 1 and 3): three gloo ranks write their shards."""
    out = _trinity("convert", "hf-to-mcore", "--hf-path", str(real_model), "--output", str(tmp_path / "mc"),
                   "--dtype", "fp32", "--tp", "3", "--verify")
    assert "TP=3" in out and _max_diff(out) <= 1e-4
    assert len(list((tmp_path / "mc").glob("__*_*.distcp"))) >= 3  # every rank wrote its shards
    back = _trinity("convert", "mcore-to-hf", "--mcore-path", str(tmp_path / "mc"), "--output", str(tmp_path / "hf"),
                    "--verify")
    assert "bit for bit" in back and _max_diff(back) == 0.0
    compare_folders(tmp_path / "hf", real_model, what="real tp3 round trip")
