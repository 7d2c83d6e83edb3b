"""A one-process job without torchrun: `python -m trinity.launch.single --log-dir DIR -m MODULE ARGS...`.

Why: torchrun's own process imports torch to supervise its workers: 3.6 s of CPU and ~3.5 s of every
job's start on a 2-core machine, before the worker has started its own imports. A job of one process
(one node, `nproc_per_node: 1`, no restarts; `trinity.launch.torchrun.launch_command` decides) needs
none of its rendezvous, so this light relay (it imports neither torch nor trinity's config) does what
torchrun does for a single worker:
- the worker is rank 0 of a world of one (LOCAL_RANK, RANK; without WORLD_SIZE the worker makes its own
  process-group store, `trinity.distributed.parallel`);
- its stdout and stderr go, as torchrun's `--redirects 3 --tee 3` put them, into
  DIR/<run id>/attempt_0/0/stdout.log and stderr.log and onto this process's own, each line prefixed
  `[default0]:`, an unfinished line as it comes (as torchrun's tail does);
- Ctrl-C, SIGTERM and SIGHUP are passed on to it as SIGTERM, and it dies with this process (kill -9
  included: the kernel's parent-death signal);
- its exit code is this process's (128 + N for a worker ended by signal N, or for a stop by signal N).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

from trinity.launch.child import FORWARDED, die_with_parent
from trinity.launch.console import relay_prefix

PREFIX = relay_prefix(0).encode()


def prefixed(chunk: bytes, at_line_start: bool) -> bytes:
    """`chunk` of the worker's output with the prefix at the start of each of its lines (its first only
    when `at_line_start`: the previous chunk ended a line)."""
    body, end = (chunk[:-1], b"\n") if chunk.endswith(b"\n") else (chunk, b"")
    return (PREFIX if at_line_start else b"") + body.replace(b"\n", b"\n" + PREFIX) + end


def _relay(pipe: IO[bytes], log: IO[bytes], console: IO[bytes]) -> None:
    """Copy the worker's output into its log file and, prefixed, onto the console as it comes, unfinished
    lines included (the progress bar redraws its line without ending it, trinity.trainer.progress);
    keep draining when the console is gone (a closed terminal), so the worker never blocks on a full pipe."""
    at_line_start = True
    for chunk in iter(lambda: pipe.read1(65536), b""):
        log.write(chunk)
        log.flush()
        try:
            console.write(prefixed(chunk, at_line_start))
            console.flush()
        except (OSError, ValueError):
            pass
        at_line_start = chunk.endswith(b"\n")


def _rank0_env(environ: dict[str, str]) -> dict[str, str]:
    """Rank 0 of one, as torchrun would set it for its only local worker."""
    env = dict(environ)
    env.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", LOCAL_WORLD_SIZE="1")
    env.pop("WORLD_SIZE", None)  # the worker's own store, not env:// (trinity.distributed.parallel)
    return env


def run(log_dir: Path, argv: list[str]) -> int:
    attempt = log_dir / f"{uuid.uuid4()}_single" / "attempt_0" / "0"
    attempt.mkdir(parents=True, exist_ok=True)
    stopping: dict[str, Any] = {"sig": None}
    job: dict[str, subprocess.Popen] = {}

    def forward(signum: int, _frame: Any) -> None:
        stopping["sig"] = signum
        if "proc" in job and job["proc"].poll() is None:
            job["proc"].send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    threads: list[threading.Thread] = []
    with open(attempt / "stdout.log", "wb") as out_log, open(attempt / "stderr.log", "wb") as err_log:
        try:
            proc = job["proc"] = subprocess.Popen(
                [sys.executable, "-u", *argv], env=_rank0_env(dict(os.environ)), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, preexec_fn=die_with_parent())
            if stopping["sig"] is not None:  # stopped while the worker was being started
                forward(stopping["sig"], None)
            for pipe, log, console in ((proc.stdout, out_log, sys.stdout.buffer), (proc.stderr, err_log, sys.stderr.buffer)):
                t = threading.Thread(target=_relay, args=(pipe, log, console), daemon=True)
                t.start()
                threads.append(t)
            # a signal interrupts the wait, forward() runs, the wait goes on (PEP 475); a worker that ignores
            # SIGTERM is killed with the whole process group by supervise()'s grace period
            code = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if "proc" in job and job["proc"].poll() is None:
                job["proc"].kill()
            deadline = time.monotonic() + 5  # a grandchild of the worker may hold the pipes open
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
    if stopping["sig"] is not None:
        return 128 + int(stopping["sig"])
    return code if code >= 0 else 128 - code


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    if len(args) < 4 or args[0] != "--log-dir" or args[2] != "-m":
        print("usage: python -m trinity.launch.single --log-dir DIR -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    return run(Path(args[1]), args[2:])


if __name__ == "__main__":
    sys.exit(main())
