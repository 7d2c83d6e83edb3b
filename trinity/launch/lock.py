"""One job per output folder: an exclusive lock on <output_dir>/.trinity.lock for the life of the job.

Two jobs writing one output folder race on its checkpoints and metrics and ruin both runs, so the
second `trinity run` is refused before it writes anything there, with a line naming the holder.

The lock is an `flock` on the file (released by the kernel when its holders die, so a job killed
with -9 never leaves a lock behind that blocks the next run); the file holds the holder's pid and
host for the message. The file descriptor is passed on to torchrun: the lock stays held while any
process of the job that can write outputs is alive, even if `trinity run` itself was killed.

File systems without `flock` (some Lustre / old NFS mounts answer ENOLCK or EOPNOTSUPP) fall back to
creating the file exclusively; a lock file left by a dead process of this host is reclaimed, one of
another host is reported with its path so the user can remove it once that job is gone.

Multi-node: every node runs `trinity run` on the same output_dir (often on a shared file system), so
only one of them may hold the folder's lock (`lock_name`): node_rank 0 with a static rendezvous; with
a c10d rendezvous (`cluster.rdzv_endpoint`) node ranks are assigned at run time, so each node locks a
file of its own host (`.trinity.lock.<host>`), which keeps two jobs of one machine apart.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from trinity.errors import UserError
from trinity.launch.child import alive

LOCK_FILE = ".trinity.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def lock_name(cluster: Any) -> str | None:
    """The lock file this node takes in the output folder, or None when another node holds the job's."""
    if cluster.nnodes == 1:
        return LOCK_FILE
    if cluster.rdzv_endpoint:
        return f"{LOCK_FILE}.{socket.gethostname()}"
    return LOCK_FILE if cluster.node_rank == 0 else None


class OutputDirLock:
    """A held lock; `release()` (or leaving the `with` block) removes the file and lets it go."""

    def __init__(self, path: Path, fd: int, flocked: bool):
        self.path, self.fd, self.flocked = path, fd, flocked

    def release(self) -> None:
        if self.fd < 0:
            return
        # Remove the file while still holding it: a job waiting on this inode then sees it is gone
        # (acquire() checks the inode after locking) and takes a new file instead.
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text() -> bytes:
    return (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}) + "\n").encode()


def _read_holder(path: Path) -> dict[str, Any]:
    # The holder writes its line right after locking: give it a moment before saying "unknown".
    for _ in range(10):
        try:
            holder = json.loads(path.read_text(encoding="utf-8") or "{}")
            if isinstance(holder, dict) and "pid" in holder:
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def _refuse(out: Path, key: str, holder: dict[str, Any], extra: str = "") -> UserError:
    return UserError(
        f"{key}: {out} is in use by another trinity run (pid {holder.get('pid', '?')} on "
        f"{holder.get('host', '?')}); wait for it to end or choose another {key}{extra}"
    )


def acquire(out: Path, name: str = LOCK_FILE, key: str = "trainer.output_dir") -> OutputDirLock:
    """Take the lock of the (existing) folder `out`, or raise a UserError naming the holder."""
    path = out / name
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"{key}: cannot create the lock file {path}: {exc.strerror}") from None
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refuse(out, key, _read_holder(path)) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_FLOCK:
                raise UserError(f"{key}: cannot lock {path}: {exc.strerror}") from None
            return _acquire_exclusive(out, path, key)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the previous holder removed the file between our open and our lock: retry
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text(), 0)
        return OutputDirLock(path, fd, flocked=True)
    raise UserError(f"{key}: could not lock {path}: it keeps being replaced; is another job starting there?")


def _acquire_exclusive(out: Path, path: Path, key: str) -> OutputDirLock:
    """The fallback without flock: the file's existence is the lock."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            pid, host = holder.get("pid"), holder.get("host")
            if host == socket.gethostname() and isinstance(pid, int) and not alive(pid):
                try:  # a dead job of this machine: its lock is stale
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                continue
            raise _refuse(out, key, holder, f" (this file system has no flock: delete {path} if that job is gone)") from None
        except OSError as exc:
            raise UserError(f"{key}: cannot create the lock file {path}: {exc.strerror}") from None
        os.write(fd, _holder_text())
        return OutputDirLock(path, fd, flocked=False)
    raise UserError(f"{key}: could not lock {path}: it keeps being replaced; is another job starting there?")


def prepare_output_dir(out: Path, key: str = "trainer.output_dir") -> None:
    """Create `out` (and its parents) or raise a UserError naming `key` and the reason."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{key}: {out} is a file, not a folder; choose a folder path") from None
    except OSError as exc:
        raise UserError(f"{key}: cannot create {out}: {exc.strerror}; choose a folder you can write to") from None
    if not out.is_dir():
        raise UserError(f"{key}: {out} is a file, not a folder; choose a folder path")
