"""`trinity convert` on the real model: HF -> megatron-core -> HF, at TP=1 and TP=2 (gloo)."""

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


def test_round_trip_tp1(real_model, tmp_path):
    out = _trinity("convert", "hf-to-mcore", "--hf-path", str(real_model), "--output", str(tmp_path / "mc"),
                   "--dtype", "fp32", "--verify")
    assert "verified logits vs transformers" in out and _max_diff(out) <= 1e-4
    back = _trinity("convert", "mcore-to-hf", "--mcore-path", str(tmp_path / "mc"), "--output", str(tmp_path / "hf"),
                    "--verify")
    assert "bit for bit" in back and _max_diff(back) == 0.0
    # every tensor equal, tied embedding kept tied (no lm_head written), tokenizer + chat template carried
    compare_folders(tmp_path / "hf", real_model, what="real round trip")
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == (real_model / "chat_template.jinja").read_text()


@pytest.mark.multiproc
def test_round_trip_tp2(real_model, tmp_path):
    out = _trinity("convert", "hf-to-mcore", "--hf-path", str(real_model), "--output", str(tmp_path / "mc"),
                   "--dtype", "fp32", "--tp", "2", "--verify")
    assert "TP=2" in out and _max_diff(out) <= 1e-4
    assert len(list((tmp_path / "mc").glob("__*_*.distcp"))) >= 2  # both ranks wrote their shards
    _trinity("convert", "mcore-to-hf", "--mcore-path", str(tmp_path / "mc"), "--output", str(tmp_path / "hf"))
    compare_folders(tmp_path / "hf", real_model, what="real tp2 round trip")
