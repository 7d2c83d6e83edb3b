"""CPU workers pick their own intra-op thread count (trinity.distributed.parallel.set_cpu_threads):
the host's cores shared over the local ranks, unless the user set OMP_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trinity.distributed.parallel import cpu_threads_per_rank

REPO = Path(__file__).resolve().parents[2]
CORES = len(os.sched_getaffinity(0))
PRINT_THREADS = (
    "import os, torch\n"
    "from trinity.distributed.parallel import set_cpu_threads\n"
    "set_cpu_threads()\n"
    "print(os.environ.get('RANK', '-'), torch.get_num_threads(), flush=True)\n"
)


def _env(**extra: str) -> dict[str, str]:
    # tests/conftest.py sets OMP_NUM_THREADS=1 for the suite; these children start without it unless given.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def _threads(args: list[str], env: dict[str, str]) -> list[str]:
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return sorted(line for line in out.stdout.splitlines() if line.strip())


def test_cores_shared_over_local_ranks():
    assert cpu_threads_per_rank(1, cores=2) == 2
    assert cpu_threads_per_rank(2, cores=2) == 1
    assert cpu_threads_per_rank(3, cores=2) == 1  # more ranks than cores: one thread each, never 0
    assert cpu_threads_per_rank(2, cores=16) == 8
    assert cpu_threads_per_rank(3, cores=16) == 5


def test_worker_without_omp_num_threads_takes_its_share():
    # torch's default would be one thread per core in each of the 2 ranks.
    got = _threads([sys.executable, "-c", PRINT_THREADS], _env(LOCAL_WORLD_SIZE="2"))
    assert got == [f"- {max(1, CORES // 2)}"]
    got = _threads([sys.executable, "-c", PRINT_THREADS], _env())
    assert got == [f"- {CORES}"]


def test_users_omp_num_threads_is_kept():
    # One rank would take all the cores; the user's 1 wins. (torch caps the variable at the core count.)
    got = _threads([sys.executable, "-c", PRINT_THREADS], _env(OMP_NUM_THREADS="1"))
    assert got == ["- 1"]


@pytest.mark.multiproc
def test_under_torchrun_each_rank_takes_its_share(tmp_path: Path):
    script = tmp_path / "threads.py"
    script.write_text(PRINT_THREADS)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    # Unset, torchrun sets 1 for its ranks (its environment, not the user's): the workers replace it
    # with their share of the cores (the same 1 on a 2-core host, 8 on a 16-core one).
    share = max(1, CORES // 2)
    assert _threads(torchrun, _env()) == [f"0 {share}", f"1 {share}"]
