"""Set-up of every worker process, called first thing in trinity.trainer.worker.main().

- quiet the known third-party warnings (trinity.compat.quiet) unless `trinity run --debug`
  (TRINITY_DEBUG=1), and install trinity's patches of megatron-core that must precede its import
  (`trinity.compat.install_all()`);
- stop this rank when the `trinity run` that started the job is gone (TRINITY_CLI_PID). torchrun
  starts each worker in a session of its own and gets a parent-death signal from `trinity run`
  (trinity.launch.torchrun.supervise), but if torchrun itself is killed with -9 or hangs on its way
  out, nothing else would end the workers: they would train on under PID 1 and hold GPUs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from trinity import compat
from trinity.compat import quiet
from trinity.parent_death import arm_parent_death, linux_prctl

CLI_PID_ENV = "TRINITY_CLI_PID"
DEBUG_ENV = quiet.DEBUG_ENV
_WATCH_S = 0.5


def setup() -> None:
    quiet.install(os.environ.get(DEBUG_ENV) == "1")
    compat.install_all()  # before the worker imports megatron-core
    start_watchdog()


def _identity(pid: int) -> str | None:
    """The start time of a live process (which tells a reused pid apart), None when it is gone or
    a zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (macOS): existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of stat: starttime


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it writes and holds nothing any more)."""
    return _identity(pid) is not None


def group_alive(pgid: int) -> bool:
    """Whether a process of process group `pgid` runs, zombies aside (Linux /proc; elsewhere: any member)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):  # fields 3 and 5 of stat: state, pgrp
            return True
    return False


def start_watchdog(environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Watch the `trinity run` named by TRINITY_CLI_PID; exit this process when it is gone."""
    raw = (os.environ if environ is None else environ).get(CLI_PID_ENV, "")
    if not raw.isdigit():
        return None  # started by hand (python -m trinity.trainer.worker / torchrun): nothing to watch
    pid = int(raw)
    ident = _identity(pid)
    if ident is None:
        _stop(pid)

    def watch() -> None:
        while True:
            time.sleep(_WATCH_S)
            if _identity(pid) != ident:
                _stop(pid)

    def start() -> threading.Thread:
        thread = threading.Thread(target=watch, name="trinity-run-watchdog", daemon=True)
        thread.start()
        return thread

    # A fork keeps no thread but the caller's: megatron-core's checkpoint writer forks a process per
    # save (filesystem_async.write_preloaded_data_multiproc), which, when its rank was stopped mid-save,
    # waited on its queue under PID 1 for good (the kill -9 test showed it). Each forked
    # child watches `trinity run` too.
    def start_in_fork() -> None:
        # Arm the fork's parent-death signal (forks_die_with_this_process) before its watchdog thread
        # starts, not after: a second thread in a fork then means it is armed (tests freeze writers on
        # that sign), and a fork stopped between the two hooks could not be killed by its parent's death.
        _guard_forked_child()
        start()

    os.register_at_fork(after_in_child=start_in_fork)
    return start()


def _stop(pid: int) -> None:
    rank = os.environ.get("RANK", "?")
    try:
        sys.stderr.write(f"trinity run (pid {pid}) is gone; rank {rank} stops\n")
        sys.stderr.flush()
    finally:
        os._exit(143)  # as if SIGTERM: no clean-up that could block on the other ranks


def exit_without_teardown(code: int) -> None:
    """End a process that has finished its work (a training or conversion rank, the CLI): what the
    interpreter's exit would do first (join non-daemon threads, run the atexit handlers, flush
    stdout/stderr), then os._exit. The rest of a normal exit, deallocating every module and object that
    torch, megatron-core and transformers loaded, is ~1.3 s of CPU per process that ends nothing
    (measured: 5.6 s from the last log line to the end of a 4-rank job on 2 cores). Callers have
    destroyed their process groups and closed their files before this point."""
    import atexit

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # the handlers the interpreter runs at exit (logging's flush among them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to lose
            pass
    os._exit(code)


def end_process(code: int) -> None:
    """Exit with `code`: as the interpreter does while nothing heavy is loaded (instant), without its
    teardown (`exit_without_teardown`) once torch is (the CLI's commands that ran a job or a conversion)."""
    if "torch" not in sys.modules:
        sys.exit(code)
    exit_without_teardown(code)


# What both launchers pass on to their child as a stop (supervise() to the launcher, trinity.launch.single
# to its worker): Ctrl-C, SIGTERM, and SIGHUP when the terminal or ssh session closes.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
def die_with_parent() -> Any:
    """A preexec_fn that arms `arm_parent_death` in the child; None where that does not exist. `trinity run`
    gives it to the launcher (trinity.launch.torchrun.supervise), trinity.launch.single to its worker.

    supervise() and trinity.launch.single run in the main thread (signal handlers need it). SIGKILL, not
    SIGTERM: torchrun's SIGTERM path (stop the workers, wait for them, write to a stderr nobody reads
    any more) was seen to outlive the CLI by over 30 s under load, while a SIGKILL cannot be caught or
    hang. The workers then stop by themselves: trinity.launch.child's watchdog in every worker ends it
    within a second of `trinity run`'s death."""
    prctl = linux_prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        arm_parent_death(parent, prctl)

    return preexec


# The process that `forks_die_with_this_process` guards now (None outside its block; forks check it).
_guarded_forks: dict[str, Any] = {"parent": None, "prctl": None, "hooked": False}


def _guard_forked_child() -> None:
    if _guarded_forks["parent"] is not None:
        arm_parent_death(_guarded_forks["parent"], _guarded_forks["prctl"])


@contextlib.contextmanager
def forks_die_with_this_process() -> Iterator[None]:
    """Children forked inside the block (megatron-core's dist-checkpoint writer processes, one per file)
    die with this process, kill -9 included (`arm_parent_death`), and are killed when the block ends
    with an exception (a stop, a failed save).

    Why: a `trinity convert` killed with -9 mid-save left writers running under PID 1, and a save
    interrupted in this process left its writers to finish files nobody would read."""
    import multiprocessing

    if not _guarded_forks["hooked"]:
        os.register_at_fork(after_in_child=_guard_forked_child)
        _guarded_forks["hooked"] = True
    before = set(multiprocessing.active_children())
    outer = _guarded_forks["parent"], _guarded_forks["prctl"]
    _guarded_forks["parent"], _guarded_forks["prctl"] = os.getpid(), linux_prctl()
    try:
        yield
    except BaseException:
        started = set(multiprocessing.active_children()) - before
        for p in started:
            p.kill()
        for p in started:
            p.join(timeout=5)
        raise
    finally:
        _guarded_forks["parent"], _guarded_forks["prctl"] = outer
