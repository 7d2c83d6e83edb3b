"""The launch command of a job (pure: torchrun, or trinity.launch.single for one process), pre-flight checks,
and the supervised child process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Mapping

from trinity.config.schema import JobConfig
from trinity.errors import UserError
from trinity.compat import quiet
from trinity.launch.child import FORWARDED, die_with_parent, group_alive

WORKER_MODULE = "trinity.trainer.worker"
_POLL_S = 0.2  # how often supervise() checks the grace period after forwarding a signal


def launch_command(cfg: JobConfig, config_path: str | Path, *, python: str = sys.executable) -> list[str]:
    """The command that starts this node's workers: `trinity.launch.single` for a job of one process
    (one node, one process, no restarts: torchrun's own start-up, ~3.5 s, would buy it nothing), else
    torchrun (`torchrun_command`). Both put every rank's stdout/stderr under <output_dir>/logs/ and show
    rank 0 on the console, prefixed `[default0]:`."""
    c = cfg.cluster
    if c.nnodes == 1 and c.nproc_per_node == 1 and c.max_restarts == 0 and not c.rdzv_endpoint:
        return [python, "-m", "trinity.launch.single", "--log-dir", str(Path(cfg.trainer.output_dir) / "logs"),
                "-m", WORKER_MODULE, str(config_path)]
    return torchrun_command(cfg, config_path, python=python)


def torchrun_command(cfg: JobConfig, config_path: str | Path, *, python: str = sys.executable) -> list[str]:
    """torchrun arguments for this node: standalone on one node, static or c10d rendezvous on several.

    Every rank's stdout/stderr goes to <output_dir>/logs/; the console shows rank 0 only.
    """
    c = cfg.cluster
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(c.nnodes), "--nproc-per-node", str(c.nproc_per_node)]
    if c.rdzv_endpoint:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", c.rdzv_endpoint, "--rdzv-id", "trinity"]
    elif c.nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += ["--node-rank", str(c.node_rank), "--master-addr", c.master_addr, "--master-port", str(c.master_port)]
    cmd += [
        "--max-restarts", str(c.max_restarts),
        "--log-dir", str(Path(cfg.trainer.output_dir) / "logs"),
        "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
        "-m", WORKER_MODULE, str(config_path),
    ]
    return cmd


def worker_env(environ: Mapping[str, str], stream: IO[str], *, debug: bool = False) -> dict[str, str]:
    """The environment of torchrun and its workers: `environ`, plus whether `trinity run`'s stdout
    (`stream`) is a terminal to draw the progress bar on (TRINITY_TTY, decided by
    trinity.trainer.progress: the workers' own stdout is a log file or a pipe) and, on a terminal, its
    width (COLUMNS, for rich). PYTHONUNBUFFERED makes the workers write their output as it comes, the
    progress bar's partial lines included. TRINITY_DEBUG=1 (`--debug`) keeps the third-party warnings
    that trinity.compat.quiet filters otherwise."""
    from trinity.launch.console import TTY_ENV, live_console

    env = dict(environ)
    env[quiet.DEBUG_ENV] = "1" if debug else "0"
    tty = live_console(environ, stream)
    env[TTY_ENV] = "1" if tty else "0"
    env["PYTHONUNBUFFERED"] = "1"
    if tty and "COLUMNS" not in environ:
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        if columns > 0:  # a pseudo-terminal nobody sized reports 0
            env["COLUMNS"] = str(columns)
    return env


def preflight(cfg: JobConfig) -> None:
    """Refuse to start what cannot work: missing GPUs, no NCCL, a taken rendezvous port."""
    c = cfg.cluster
    if c.device == "cuda":
        import torch
        import torch.distributed as dist

        gpu_preflight(c.nnodes * c.nproc_per_node, c.nproc_per_node, torch.cuda.device_count(),
                      dist.is_available() and dist.is_nccl_available())
    if c.nnodes > 1 and c.node_rank == 0 and not c.rdzv_endpoint and not port_is_free(c.master_port):
        raise UserError(f"cluster.master_port: port {c.master_port} is in use on this machine; choose another")


def gpu_preflight(world: int, nproc_per_node: int, visible: int, nccl: bool) -> None:
    """A CUDA job of `world` ranks, `nproc_per_node` of them here, on a machine that shows `visible` GPUs
    and has NCCL (`nccl`) or not: one process per GPU, and several processes talk over NCCL."""
    if visible == 0:
        raise UserError("cluster.device: cuda, but no GPU is visible; set cluster.device: cpu for a CPU run")
    if nproc_per_node > visible:
        raise UserError(
            f"cluster.nproc_per_node: {nproc_per_node} processes need {nproc_per_node} GPUs, "
            f"but {visible} are visible (CUDA_VISIBLE_DEVICES); lower it to {visible}"
        )
    if world > 1 and not nccl:
        raise UserError(
            f"cluster.device: cuda with {world} processes needs NCCL, which this build of torch lacks; "
            "install a CUDA build of torch with NCCL, or run one process (cluster.nproc_per_node: 1)"
        )


def port_is_free(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_ROOT_CAUSE = re.compile(r"\s*(rank|host|exitcode)\s*:\s*(\S+)")
# torchrun's own log lines (glog style: W1125 13:17:31.134000 <pid> <file>:<line>] ...) about stopping
# torchrun's "Setting OMP_NUM_THREADS" banner: an empty line, then stars, the text, stars (with or without
# a glog prefix, depending on how its logging is set up)
_GLOG = r"(?:[WI]\d{4} [\d:.]+ \d+ \S+\] )?"
_OMP_BANNER = re.compile(_GLOG + r"(\*{41}|Setting OMP_NUM_THREADS environment variable for each process)")
_EMPTY = re.compile(_GLOG + r"\s*$")
_STOP_NOISE = re.compile(r"[WI]\d{4} [\d:.]+ \d+ \S+\] (Received \w+ death signal|Sending process \d+ closing signal)")


def _relay_stderr(
    stream: IO[str], out: IO[str], debug: bool, cause: dict[str, str] | None = None, stopping: dict[str, Any] | None = None
) -> None:
    """Copy torchrun's stderr, except its own ChildFailedError traceback after a worker failed.

    Worker lines arrive prefixed (`[default0]:`, from --tee) and always pass; the failed rank has
    already printed its one-line error, so torchrun's 30-line report becomes one line (all of it with
    --debug). `cause` receives the report's first rank, host and exitcode. When `trinity run` itself
    stopped the job (`stopping["sig"]` set: Ctrl-C, SIGTERM, SIGHUP) no rank failed: the report is
    dropped without a line, and the caller says the job was interrupted."""
    swallowed = in_report = False
    cause = {} if cause is None else cause
    stopping = {} if stopping is None else stopping
    held = ""  # an empty line, passed on unless the OMP banner follows it
    for line in iter(stream.readline, ""):
        if not debug and _EMPTY.fullmatch(line):
            _write(out, held)
            held = line
            continue
        if held and not (not debug and _OMP_BANNER.match(line)):
            _write(out, held)
        held = ""
        if line.startswith("Traceback (most recent call last):"):
            in_report = True
            swallowed = not debug
        if in_report:
            m = _ROOT_CAUSE.match(line)
            if m:
                cause.setdefault(m.group(1), m.group(2))
        if swallowed:
            continue
        if stopping.get("sig") is not None and not debug and _STOP_NOISE.match(line):
            continue  # torchrun's log of the stop we asked for; the caller prints `interrupted`
        if not debug and _OMP_BANNER.match(line):
            # torchrun's "Setting OMP_NUM_THREADS ... to be 1" banner: misleading, the workers pick
            # their thread count themselves (trinity.distributed.parallel)
            continue
        _write(out, line)
    _write(out, held)
    if swallowed and stopping.get("sig") is None:
        out.write(
            f"torchrun: rank {cause.get('rank', '?')} on {cause.get('host', '?')} failed first "
            f"(exit code {cause.get('exitcode', '?')}); run with --debug for torchrun's traceback\n"
        )
        out.flush()


def _write(out: IO[str], text: str) -> None:
    if not text:
        return
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):  # the terminal is gone (SIGHUP): keep draining torchrun's pipe
        pass


def supervise(
    cmd: list[str], *, env: dict[str, str] | None = None, grace_s: float = 30.0, debug: bool = False,
    pass_fds: tuple[int, ...] = (), stopped: dict[str, Any] | None = None,
) -> int:
    """Run the launcher (`launch_command`: torchrun, or trinity.launch.single) as a child in its own
    process group; forward Ctrl-C, SIGTERM and SIGHUP (terminal or ssh session closed) so no orphans
    remain, and have the child die with us on kill -9.

    Returns the job's exit code: the exit code of the rank that failed first (2 for a UserError, as a
    command outside torchrun), 128 + signal number when it was stopped by a signal (also put in
    `stopped["sig"]`). `pass_fds` stay open in torchrun (the output folder's lock).
    """
    env = dict(os.environ if env is None else env)
    env["TRINITY_CLI_PID"] = str(os.getpid())  # read by trinity.launch.child's watchdog in every worker
    cause: dict[str, str] = {}
    stopping: dict[str, Any] = {"sig": None, "deadline": None}
    job: dict[str, subprocess.Popen] = {}

    def forward(signum, _frame):
        stopping["sig"] = signum
        if stopping["deadline"] is None:
            stopping["deadline"] = time.monotonic() + grace_s
        if "proc" in job:
            try:
                os.killpg(job["proc"].pid, signal.SIGTERM)  # torchrun passes it to every worker
            except ProcessLookupError:
                pass

    # The handlers go in BEFORE torchrun starts: a signal in between (a CI runner or terminal closing
    # right after the launch) would otherwise kill this process with the default action and leave the
    # job to the parent-death signal alone.
    old = {s: signal.signal(s, forward) for s in FORWARDED}
    code, relay = 0, None
    try:
        proc = job["proc"] = subprocess.Popen(
            cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True, bufsize=1,
            pass_fds=pass_fds, preexec_fn=die_with_parent())
        if stopping["sig"] is not None:  # stopped while torchrun was being started
            forward(stopping["sig"], None)
        relay = threading.Thread(target=_relay_stderr, args=(proc.stderr, sys.stderr, debug, cause, stopping), daemon=True)
        relay.start()
        while True:
            # Wait in short slices: a blocking wait() is resumed after the signal handler returns
            # (PEP 475), so a torchrun that ignores SIGTERM would never see the grace period end.
            try:
                code = proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if stopping["deadline"] is not None and time.monotonic() >= stopping["deadline"]:
                    _reap_group(proc.pid)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if "proc" in job:
            _reap_group(job["proc"].pid)
        if relay is not None:
            relay.join(timeout=5)
    if stopped is not None:
        stopped["sig"] = stopping["sig"]
    if stopping["sig"] is not None:
        return 128 + stopping["sig"]
    if code == 1 and cause.get("exitcode", "").isdigit() and int(cause["exitcode"]) > 0:
        return int(cause["exitcode"])  # torchrun's own 1 for "a worker failed": pass the worker's code on
    return code if code >= 0 else 128 - code


def _reap_group(pgid: int, wait_s: float = 10.0) -> None:
    """Kill whatever of the job's process group outlived torchrun (a hung worker, a checkpoint writer, a
    reward process), and wait until it is gone: what the job left in its output folder is only removed
    once no process of it can write there any more (trinity.cli.commands.run)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
