"""Two "nodes" on one machine: two `trinity run` processes (nnodes=2, node_rank 0/1, 127.0.0.1, one CPU
process each) train the quickstart job together through torchrun's static rendezvous, and their losses
equal those of one node running two processes (DP=2 either way).

Only global rank 0 logs the loss (metrics.jsonl, console). Node 1's share is checked through what it
writes into the shared output folder (its rank's RNG state in every checkpoint) and its exit code; its
correctness through the loss: a node computing wrong gradients or another batch would change the
all-reduced loss from step 2 on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
JOB = [
    f"trainer.total_steps={STEPS}", "trainer.log_interval=1", "trainer.save_interval=1000",
    "trainer.export_hf=false", "trainer.keep_last=1",
]
RUN_TIMEOUT_S = 240

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _trinity(cwd: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trinity.cli.main", "run", "--config", "configs/quickstart.yaml", *JOB, *overrides]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path, timeout: float = RUN_TIMEOUT_S) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{log.name}: trinity run did not finish in {timeout} s:\n{log.read_text()[-3000:]}")
    assert code == 0, f"{log.name}: trinity run exited {code}:\n{log.read_text()[-3000:]}"


def _losses(output_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), f"{output_dir}: steps {[r['step'] for r in rows]}"
    return [float(r["loss"]) for r in rows]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trinity.testing.tiny_assets import make_quickstart_assets

    root = tmp_path_factory.mktemp("multinode")
    (root / "configs").mkdir()
    (root / "configs" / "quickstart.yaml").write_text((REPO / "configs" / "quickstart.yaml").read_text())
    make_quickstart_assets(root / "quickstart_assets")
    return root


@pytest.mark.timeout(600)
def test_two_nodes_train_together_and_match_one_node_dp2(workdir: Path):
    # One node, two processes: the reference losses.
    single = workdir / "runs" / "single"
    log_single = workdir / "single.log"
    _wait(_trinity(workdir, [f"trainer.output_dir={single}", "cluster.nproc_per_node=2"], log_single), log_single)
    assert "TP=1 PP=1 CP=1 DP=2" in log_single.read_text()
    want = _losses(single)

    # Two nodes sharing one output folder, as on a shared filesystem.
    shared = workdir / "runs" / "two_nodes"
    port = _free_port()
    cluster = ["cluster.nnodes=2", "cluster.nproc_per_node=1", "cluster.master_addr=127.0.0.1", f"cluster.master_port={port}"]
    logs = [workdir / "node0.log", workdir / "node1.log"]
    procs = []
    try:
        # Both nodes start together: each converts the HF model for <output_dir>/mcore_cache and writes
        # resolved_config.yaml into the same folder at the same time, as on a shared filesystem.
        for rank, log in enumerate(logs):
            procs.append(_trinity(workdir, [f"trainer.output_dir={shared}", *cluster, f"cluster.node_rank={rank}"], log))
        for proc, log in zip(procs, logs):
            _wait(proc, log)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for log in logs:
        text = log.read_text()
        assert "job: sft on 2 x cpu" in text and "TP=1 PP=1 CP=1 DP=2" in text, f"{log.name}: plan is not 2 ranks, DP=2"
        assert "--nnodes 2" in text and "--master-addr 127.0.0.1" in text and f"--master-port {port}" in text
    assert "--node-rank 0" in logs[0].read_text() and "--node-rank 1" in logs[1].read_text()
    caches = list((shared / "mcore_cache").iterdir())
    assert len(caches) == 1 and (caches[0] / "trinity_meta.json").is_file(), f"mcore_cache: {caches}"
    leftovers = [p.name for p in [*shared.iterdir(), *(shared / "mcore_cache").iterdir()] if p.name.startswith(".")]
    assert not leftovers, f"temporary files left in {shared}: {leftovers}"

    got = _losses(shared)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: two nodes loss {a} vs one node DP=2 {b}"
    assert got[-1] < got[0], f"loss did not fall over {STEPS} steps: {got}"

    # Both nodes wrote into the final checkpoint: one RNG state per global rank.
    ckpt = shared / "checkpoints" / f"step_{STEPS}"
    assert (ckpt / "complete").is_file(), f"{ckpt}: not complete"
    rng = sorted(p.name for p in (ckpt / "rng").iterdir())
    assert rng == ["rank_0.pt", "rank_1.pt"], f"{ckpt}/rng: {rng}"
