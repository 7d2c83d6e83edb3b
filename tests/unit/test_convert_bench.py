"""benchmarks/convert.py: each direction is compared with its own disk floor, in a markdown table."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_convert", REPO / "benchmarks" / "convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_each_direction_against_its_own_floor():
    gib = 1e9
    to_mcore = {"seconds": 20.0, "bytes": 10 * gib, "peak_rss": 3 * gib, "base_rss": 1 * gib, "peak_gpu": 10 * gib}
    to_hf = {"seconds": 16.0, "bytes": 10 * gib, "peak_rss": 2 * gib, "base_rss": 1 * gib, "peak_gpu": 12 * gib}
    text = _bench().table(10.0, read_s=2.0, write_s=8.0, to_mcore=to_mcore, to_hf=to_hf, device="cuda")
    lines = text.splitlines()
    header = _cells(lines[0])
    assert header[:6] == ["step", "seconds", "GB", "GB/s", "floor", "× floor"] and "peak host RSS" in header[6]
    assert all(len(_cells(line)) == len(header) for line in lines)  # a well-formed markdown table
    rows = {_cells(line)[0]: _cells(line) for line in lines[2:]}
    assert rows["read floor (read the HF shards)"][1] == "2.00"
    assert rows["write floor (write + fsync as many bytes)"][1] == "8.00"
    assert rows["read + write floor"][1] == "10.00"
    mcore = rows["hf-to-mcore (cuda)"]
    assert mcore[4] == "read + write" and mcore[5] == "2.00" and mcore[3] == "0.50"  # 20 s / (2 + 8) s
    hf = rows["mcore-to-hf (cuda)"]
    assert hf[4] == "write" and hf[5] == "2.00"  # 16 s / 8 s, not 16 / 10
    assert hf[6] == "2.00 (1.00)" and hf[7] == "12.00"
