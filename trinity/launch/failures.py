"""A full or read-only disk as one line naming the file, wherever it is hit: in `trinity run` itself
(the weight conversion), or in a rank, whose line only its log may hold (torchrun shows local rank 0).

`disk_error` finds the OSError under what third-party code wraps it in (megatron-core's checkpoint
writer re-raises a `RuntimeError(...) from` it, torch's distributed checkpoint collects it in a
`CheckpointException`, a BaseException); `disk_error_message` is its line. Each rank prints that line as
`error (rank <r>): <line>` (trinity.trainer.worker), and `rank_disk_error` finds it in the job's logs
after a failed job, so the CLI's last line names the cause instead of "see the logs".
"""

from __future__ import annotations

import errno
import io
import os
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trinity.errors import UserError

# errno -> (what happened, how to fix it). These are the user's to fix, not bugs.
DISK_ERRNOS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free space on that disk or write to a folder on another one"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or write to a folder on another disk"),
    errno.EFBIG: ("file too large for the file size limit (ulimit -f) or the file system",
                  "raise the limit or write to a folder on another file system"),
    errno.EROFS: ("read-only file system", "write to a folder on a writable disk"),
    errno.EACCES: ("permission denied", "fix the permissions or write to a folder you can write to"),
}
_RANK_LINE = re.compile(
    r"^error \(rank (\d+)\): ((?:" + "|".join(errno.errorcode[n] for n in DISK_ERRNOS) + r"): .*)$"
)


# Less free space than this where a write failed: the disk is full, whatever the error says.
FULL_BYTES = 16 << 20


def disk_error(exc: BaseException, folder: str | Path | None = None) -> OSError | None:
    """The OSError of DISK_ERRNOS that `exc` is or wraps (its causes, contexts and torch checkpoint
    failures), or None. An exit or interrupt is never one, whatever it was raised while handling.

    With `folder` (where the failed code was writing), an error on a disk left with less than
    FULL_BYTES free is an ENOSPC too: torch's C++ checkpoint writer turns the OSError of a full disk
    into a RuntimeError without an errno ("unexpected pos 704 vs 598")."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
        return None
    found = _wrapped_os_error(exc)
    if found is None and folder is not None and free_bytes(Path(folder)) < FULL_BYTES:
        found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return found


def free_bytes(folder: Path) -> int:
    """Bytes this process may still write on the file system of `folder` (or of its nearest existing
    parent); root may use the blocks reserved for it."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return FULL_BYTES  # not known: not called full
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def _wrapped_os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
    return None


def _file_being_written(exc: BaseException) -> str | None:
    """The file an OSError without a file name was raised on: a write() on an open file object names
    nothing, but that object is a local of the innermost frame that called it."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def disk_error_message(err: OSError, folder: str | Path | None = None) -> str:
    """`ENOSPC: no space left on device: <path>; <fix>`; `folder`, the folder being written, stands in
    when neither the error nor its traceback names the file."""
    what, fix = DISK_ERRNOS[err.errno]
    path = err.filename or _file_being_written(err)
    where = str(path) if path is not None else (f"writing under {folder}" if folder else "(the file is not known)")
    return f"{errno.errorcode[err.errno]}: {what}: {where}; {fix}"


@contextmanager
def disk_errors(folder: Path) -> Iterator[None]:
    """Run the block; a disk error in it (see `disk_error`, with `folder` where it writes) becomes a
    UserError of one line."""
    try:
        yield
    except UserError:
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        err = disk_error(exc, folder)
        if err is None:
            raise
        raise UserError(disk_error_message(err, folder)) from exc


def rank_disk_error(log_dir: Path, since: float) -> tuple[int, str] | None:
    """(rank, line) of the first rank (lowest number) whose log, written since `since` (this job's), ends
    with a disk error line of trinity.trainer.worker; None when there is none."""
    found: list[tuple[int, str]] = []
    for log in log_dir.glob("*/attempt_*/*/stderr.log") if log_dir.is_dir() else []:
        try:
            if log.stat().st_mtime < since:
                continue
            lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = _RANK_LINE.match(line)
            if m:
                found.append((int(m.group(1)), m.group(2)))
                break
    return min(found) if found else None


def job_failure_line(out: Path, code: int, since: float) -> str:
    """What `trinity run` says last about a job that failed: the disk error a rank hit (its log may be
    the only place that says it), or where the logs are."""
    logs = out / "logs"
    found = rank_disk_error(logs, since)
    if found is not None:
        rank, line = found
        return f"error: {line} (rank {rank}; every rank's log is under {logs})"
    return f"job failed with exit code {code}; every rank's log is under {logs}"
