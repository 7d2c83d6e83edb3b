"""`trinity run`'s launcher: GPU pre-flight, the workers' environment (the progress bar's terminal),
and supervise() forwarding SIGTERM so that no process of the job outlives it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from trinity.cli import commands
from trinity.cli.report import run_guarded
from trinity.launch.torchrun import worker_env
from trinity.trainer.metrics import TTY_ENV, MetricsLogger, console_is_terminal


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


# --- GPU pre-flight ------------------------------------------------------------------------------


def test_run_refuses_more_processes_than_visible_gpus(write_job, small_job, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    small_job["cluster"] = {"device": "cuda", "nproc_per_node": 2}
    out = tmp_path / "run"
    path = write_job(small_job)
    code = run_guarded(lambda: commands.run(path, [f"trainer.output_dir={out}"]), debug=False)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cluster.nproc_per_node: 2 processes need 2 GPUs, but 1 are visible (CUDA_VISIBLE_DEVICES); lower it to 1"), err
    assert not out.exists()  # refused before converting weights or starting a process


# --- the progress bar's terminal -----------------------------------------------------------------


@pytest.mark.parametrize(
    "env,tty,expected",
    [
        ({}, True, True),  # run directly in a terminal
        ({}, False, False),  # run directly, stdout redirected
        ({TTY_ENV: "1"}, False, True),  # a torchrun worker (stdout is a log file) of a `trinity run` in a terminal
        ({TTY_ENV: "0"}, False, False),  # a torchrun worker of a `trinity run` whose stdout is a file
        ({TTY_ENV: "0"}, True, False),  # what trinity run said wins
        ({TTY_ENV: ""}, True, True),  # unset in effect
    ],
)
def test_console_is_terminal(env, tty, expected):
    assert console_is_terminal(env, _Stream(tty)) is expected


def test_worker_env_says_whether_run_is_on_a_terminal():
    base = {"PATH": "/bin", "COLUMNS": "123"}
    on_tty = worker_env(base, _Stream(True))
    assert on_tty[TTY_ENV] == "1" and on_tty["PATH"] == "/bin" and on_tty["COLUMNS"] == "123"
    assert on_tty["PYTHONUNBUFFERED"] == "1"
    assert worker_env(base, _Stream(False))[TTY_ENV] == "0"
    assert base == {"PATH": "/bin", "COLUMNS": "123"}  # not modified
    # A real pseudo-terminal: its width is passed on for rich.
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as stream:
            assert "COLUMNS" not in worker_env({}, stream)  # not sized yet: rich keeps its default
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 97, 0, 0))
        with open(slave, "w", closefd=False) as stream:
            env = worker_env({}, stream)
        assert env[TTY_ENV] == "1" and env["COLUMNS"] == "97"
    finally:
        os.close(master)
        os.close(slave)


def _log_three_steps(out: Path) -> None:
    logger = MetricsLogger(out, enabled=True, total_steps=3, start_step=0, log_interval=1, tensorboard=False)
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
                    "step_time_s": 0.1, "mem_peak_gib": 0.25})
    logger.print("done")
    logger.close()


@pytest.mark.parametrize("tty", ["1", "0"])
def test_metrics_logger_bar_in_a_log_file(tmp_path, monkeypatch, tty):
    """A worker whose stdout is a file draws the bar when TRINITY_TTY=1; the step lines and
    metrics.jsonl are the same either way."""
    monkeypatch.setenv(TTY_ENV, tty)
    monkeypatch.setenv("COLUMNS", "100")
    log = tmp_path / "stdout.log"
    with log.open("w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        _log_three_steps(tmp_path / "run")
    raw = log.read_bytes()
    assert b"\r" not in raw  # torchrun reads a carriage return as the end of a line
    text = raw.decode()
    for step in (1, 2, 3):
        assert f"step {step}/3 | loss {2.0 / step:.4f} | lr 0.0010 | grad_norm 0.5000" in text, text
    assert "done" in text
    bar = "━" in text and "3/3" in text and "train" in text
    assert bar is (tty == "1"), text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss"] == 1.0


# --- supervise(): SIGTERM reaches every process of the job ---------------------------------------

_GRANDCHILD = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a hung worker: only SIGKILL ends it
    pathlib.Path(sys.argv[1]).write_text("ready")
    time.sleep(600)
    """
)
_CHILD = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    if sys.argv[3] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a torchrun that does not stop either
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    time.sleep(600)
    """
)
_DRIVER = textwrap.dedent(
    """
    import json, sys
    from trinity.launch.torchrun import supervise
    cmd = json.loads(sys.argv[1])
    sys.exit(supervise(cmd, grace_s=float(sys.argv[2])))
    """
)


def _wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("child_ignores_term", [False, True], ids=["child_stops", "child_hangs"])
def test_supervise_forwards_sigterm_and_leaves_no_process(tmp_path, child_ignores_term):
    import psutil

    ready = tmp_path / "grandchild_ready"
    cmd = [sys.executable, "-c", _CHILD, _GRANDCHILD, str(ready), "1" if child_ignores_term else "0"]
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(cmd), "1.0"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job: list[int] = []
    try:
        _wait_for(ready.is_file, "the grandchild to start")
        job = _wait_for(lambda: [p.pid for p in psutil.Process(driver.pid).children(recursive=True)] or None,
                        "the job's processes")
        assert len(job) == 2, job  # child (torchrun's stand-in) and grandchild (a worker)
        assert all(_running(pid) for pid in job)
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        if driver.returncode != 128 + signal.SIGTERM:  # the test failed: end what we started, by pid
            for pid in job:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
    assert driver.returncode == 128 + signal.SIGTERM, (driver.returncode, out, err)
    for pid in job:
        _wait_for(lambda: not _running(pid), f"process {pid} to end", timeout_s=10)


# --- trinity.launch.single: a job of one process without torchrun -------------------------------


def _single(tmp_path: Path, body: str) -> subprocess.Popen:
    """`python -m trinity.launch.single --log-dir <tmp>/logs -m fake_worker` with `body` as the worker."""
    (tmp_path / "fake_worker.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "trinity.launch.single", "--log-dir", str(tmp_path / "logs"),
                             "-m", "fake_worker", "arg1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_single_relays_prefixed_lines_keeps_logs_and_the_exit_code(tmp_path):
    proc = _single(tmp_path, """
        import os, sys
        print("hello", sys.argv[1:], os.environ["RANK"], os.environ["LOCAL_RANK"], "WORLD_SIZE" in os.environ)
        print("oops", file=sys.stderr)
        sys.exit(3)
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out.decode().splitlines() == ["[default0]:hello ['arg1'] 0 0 False"]
    assert err.decode().splitlines() == ["[default0]:oops"]
    (attempt,) = (tmp_path / "logs").glob("*/attempt_0/0")  # torchrun's layout
    assert (attempt / "stdout.log").read_text() == "hello ['arg1'] 0 0 False\n"
    assert (attempt / "stderr.log").read_text() == "oops\n"


def test_single_passes_sigterm_on_and_ends_with_its_worker(tmp_path):
    import psutil

    proc = _single(tmp_path, """
        import os, signal, sys, time
        def stop(signum, frame):
            print("stopping", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("pid", os.getpid(), flush=True)
        time.sleep(120)
    """)
    line = proc.stdout.readline().decode()
    assert line.startswith("[default0]:pid "), line
    worker = int(line.split()[-1])
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM  # a stop, whatever the worker's own code
    assert b"[default0]:stopping" in out
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
