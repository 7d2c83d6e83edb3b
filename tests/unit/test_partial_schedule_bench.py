"""benchmarks/partial_schedule.py runs and its table says what the engine did: the fixed-length rollout
decodes to that length, the lognormal one to its longest answer, and the partial rollouts train whole
groups of every call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "partial_schedule.py"


def test_partial_schedule_table():
    out = subprocess.run([sys.executable, str(BENCH), "--prompts", "4", "--n", "2", "--response-length", "16",
                          "--calls", "2", "--staleness", "1"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m[0].strip(): [float(x) for x in m[1:]] for m in re.findall(
        r"^\| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.MULTILINE)}
    fixed = next(k for k in rows if k.startswith("fixed:"))
    assert set(rows) == {"lognormal", fixed, "partial s=1 o=8"}, out.stdout
    # one rollout of 8 answers: the longest one's steps (its first token comes from the prefill)
    assert rows[fixed][0] == int(fixed[6:]) - 1
    assert 1 <= rows["lognormal"][0] <= 15
    calls = re.findall(r"^partial s=1 o=8, call \d+: .*trained tokens (\d+)", out.stdout, re.MULTILINE)
    assert len(calls) == 2 and all(int(t) > 0 for t in calls)
    # each call's decode steps and prefill forwards are parts of its wall time
    assert all(0 < v[7] <= v[6] and 0 < v[8] <= v[6] and v[7] + v[8] <= v[6] + 1e-3 for v in rows.values()), rows
