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


def test_each_direction_against_its_own_fastest_floor():
    gib = 1e9
    to_mcore = {"seconds": 20.0, "bytes": 10 * gib, "peak_rss": 3 * gib, "base_rss": 1 * gib, "peak_gpu": 10 * gib,
                "phases": {"build": 0.5, "load": 4.0, "save": 15.5}}
    to_hf = {"seconds": 16.0, "bytes": 10 * gib, "peak_rss": 2 * gib, "base_rss": 1 * gib, "peak_gpu": 12 * gib}
    reads = {1: 4.0, 2: 2.0, 4: 2.5}  # the floor is the fastest stream count, not the single stream
    writes = {1: 12.0, 2: 8.0, 4: 9.0}
    text = _bench().table(10.0, reads, writes, to_mcore=to_mcore, to_hf=to_hf, device="cuda")
    table, _, note = text.partition("\n\n")
    lines = table.splitlines()
    header = _cells(lines[0])
    assert header[:7] == ["step", "seconds", "GB", "GB/s", "floor", "× floor", "phases (s)"] and "peak host RSS" in header[7]
    assert all(len(_cells(line)) == len(header) for line in lines)  # a well-formed markdown table
    rows = {_cells(line)[0]: _cells(line) for line in lines[2:]}
    assert rows["read, 1 stream"][1] == "4.00" and rows["read, 2 streams"][1] == "2.00"
    assert rows["write + fsync, 4 streams"][1] == "9.00"
    assert rows["read + write floor (fastest of each)"][1] == "10.00"  # 2 + 8
    mcore = rows["hf-to-mcore (cuda)"]
    assert mcore[4] == "read + write" and mcore[5] == "2.00" and mcore[3] == "0.50"  # 20 s / (2 + 8) s
    assert mcore[6] == "build 0.50, load 4.00, save 15.50"
    hf = rows["mcore-to-hf (cuda)"]
    assert hf[4] == "write" and hf[5] == "2.00"  # 16 s / 8 s, not 16 / 10
    assert hf[6] == "" and hf[7] == "2.00 (1.00)" and hf[8] == "12.00"
    # ... and, for comparison with older runs, the ratios to the single-stream floors.
    assert "read 4.00 s, write 12.00 s" in note and "hf-to-mcore 1.25x, mcore-to-hf 1.33x" in note
