"""One megatron-core conversion per model: the cache `trinity run` converts HF folders into.

Layout of the cache folder (`mcore_cache_dir()`, default `~/.cache/trinity/mcore`):
    <key>/          a complete dist checkpoint; only ever made by a rename, so never half-written
    <key>.lock      the entry's lock file (flock): exclusive while converting or removing the entry,
                    shared by every job that reads it (held by its workers through the job's life)
    .<key>.tmp/     everything half-made or half-removed for <key>: a conversion in progress, or an
                    entry being deleted; whoever holds <key>.lock exclusively may delete it

The key names what changes the converted bytes: the HF folder's fingerprint, the dtype, and
CONVERTER_VERSION. The lock is a flock, which the kernel drops when its holders die: a converter
killed with -9 leaves no lock behind, only a `.<key>.tmp/` folder the next holder removes.

Torch-free: `trinity run` looks up the cache before it knows whether it must import megatron-core.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trinity.errors import UserError

# Bumped whenever trinity's HF -> dist checkpoint conversion writes different bytes for the same
# source and dtype: entries of an older converter are then never reused (and age out of the cache).
CONVERTER_VERSION = "1"
# The cache's size bound without TRINITY_MCORE_CACHE_GB: about six 7B models in bf16.
DEFAULT_BOUND_GB = 100.0
META = "trinity_meta.json"  # trinity.convert.dist_ckpt.META, written last into a checkpoint
ENTRY_NAME = re.compile(r"^[0-9a-f]{16}-(?:bf16|fp16|fp32)-c\d+$")
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class NoLocks(Exception):
    """The cache's file system has no flock: the cache cannot be shared safely there."""


def cache_root() -> Path:
    """`$TRINITY_CACHE`, else `$XDG_CACHE_HOME/trinity`, else `~/.cache/trinity`."""
    if os.environ.get("TRINITY_CACHE"):
        return Path(os.environ["TRINITY_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "trinity"


def mcore_cache_dir() -> Path:
    """`$TRINITY_MCORE_CACHE`, else `<cache_root()>/mcore`."""
    if os.environ.get("TRINITY_MCORE_CACHE"):
        return Path(os.environ["TRINITY_MCORE_CACHE"]).expanduser()
    return cache_root() / "mcore"


def bound_bytes() -> int:
    """The size the cache is cut back to after a conversion: `$TRINITY_MCORE_CACHE_GB` (GB), else DEFAULT_BOUND_GB."""
    text = os.environ.get("TRINITY_MCORE_CACHE_GB", "").strip()
    try:
        gb = float(text) if text else DEFAULT_BOUND_GB
    except ValueError:
        raise UserError(f"TRINITY_MCORE_CACHE_GB: {text!r} is not a number of GB (e.g. 50)") from None
    if gb < 0:
        raise UserError(f"TRINITY_MCORE_CACHE_GB: {text} is negative; give a size in GB (e.g. 50)")
    return int(gb * 1e9)


def entry_key(hf_dir: str | Path, dtype: str) -> str:
    """The name of the conversion of `hf_dir` to `dtype` (bf16, fp16, fp32)."""
    from trinity.convert.fingerprint import source_fingerprint

    return f"{source_fingerprint(hf_dir)}-{dtype}-c{CONVERTER_VERSION}"


def is_complete(entry: Path) -> bool:
    return (entry / META).is_file()


def is_cache_entry(path: str | Path) -> bool:
    """Whether `path` names a conversion made by `trinity run` (shared cache or <output_dir>/mcore_cache)."""
    return bool(ENTRY_NAME.match(Path(path).name))


@dataclass
class CachedConversion:
    """A complete cache entry this process holds a shared lock on (through `fd`): no cleanup removes
    it until every process holding the descriptor (the job's workers too) has ended."""

    path: Path
    fd: int
    converted: bool  # this call made it (False: an earlier or concurrent job did)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def use_entry(root: Path, key: str, build: Callable[[Path], None], *,
              say: Callable[[str], None] = lambda line: None) -> CachedConversion:
    """The complete entry `key` of the cache `root`, made by `build(folder)` unless it exists, held
    with a shared lock. One job converts; another asking for the same key meanwhile waits for it and
    reuses its entry. Raises NoLocks where the file system has no flock."""
    entry = root / key
    lock_file = root / f"{key}.lock"
    _make_root(root)
    waiting = _once(lambda: say(f"waiting for another trinity job that is converting into {entry}"))
    while True:
        fd = _lock(lock_file, fcntl.LOCK_SH, waiting)  # blocks while a converter or a cleanup holds it
        if is_complete(entry):
            _touch(entry)
            return CachedConversion(entry, fd, converted=False)
        os.close(fd)
        fd = _lock(lock_file, fcntl.LOCK_EX, waiting)
        converted = False
        try:
            if not is_complete(entry):  # else another job made it while this one waited
                _discard_leftovers(root, key)
                _build(root, key, build)
                converted = True
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        # Turning the exclusive lock into a shared one is not atomic: a cleanup may have removed the
        # entry in between. Then go round again.
        if is_complete(entry):
            _touch(entry)
            return CachedConversion(entry, fd, converted=converted)
        os.close(fd)


def _touch(entry: Path) -> None:
    """Mark the entry's last use, for the least-recently-used cleanup. In a cache shared by several
    users only an entry's owner may: the others' uses do not count."""
    try:
        os.utime(entry)
    except PermissionError:
        pass


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()

    return call


def _make_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the conversion cache {root}: {exc.strerror}; set TRINITY_CACHE to a "
                        "folder you can write to, or pass `trinity run --no-cache`") from None


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UserError(f"cannot create the lock file {path}: {exc.strerror}; set TRINITY_CACHE to a folder "
                        "you can write to, or pass `trinity run --no-cache`") from None


def _lock(path: Path, mode: int, blocked: Callable[[], None] = lambda: None) -> int:
    """A descriptor of `path` locked in `mode`, calling `blocked()` before it waits for another holder.
    A cleanup unlinks lock files it holds exclusively: a lock taken on such a removed file is retried
    on the new one."""
    while True:
        fd = _open_lock_file(path)
        try:
            if not _try_lock(fd, mode):
                blocked()
                fcntl.flock(fd, mode)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_FLOCK:
                raise NoLocks(str(path)) from None
            raise
        if _still_there(path, fd):
            return fd
        os.close(fd)


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _still_there(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _work(root: Path, key: str) -> Path:
    return root / f".{key}.tmp"


def _discard_leftovers(root: Path, key: str) -> None:
    """Under the exclusive lock: what a dead converter or cleanup left for `key`, and an entry that
    lacks its metadata (damaged by hand: entries are only made complete, by a rename)."""
    work = _work(root, key)
    if (root / key).exists():
        work.mkdir(exist_ok=True)
        os.rename(root / key, work / "old")
    shutil.rmtree(work, ignore_errors=True)


def _build(root: Path, key: str, build: Callable[[Path], None]) -> None:
    """`build` into `.<key>.tmp/ckpt`, then rename it into place; on failure nothing stays."""
    work = _work(root, key)
    work.mkdir()
    try:
        build(work / "ckpt")
        if not is_complete(work / "ckpt"):
            raise RuntimeError(f"the conversion into {work / 'ckpt'} wrote no {META}")
        os.rename(work / "ckpt", root / key)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def entry_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def clean(root: Path, bound: int) -> list[tuple[Path, int]]:
    """Remove the least recently used entries until the cache holds at most `bound` bytes, skipping
    every entry a job holds (the caller's own included), and the leftovers of dead conversions.
    Returns (entry, bytes) of each removed entry."""
    if not root.is_dir():
        return []
    for work in root.glob(".*.tmp"):
        key = work.name[1:-len(".tmp")]
        if ENTRY_NAME.match(key):
            _remove_if_free(root, key, entry=False)
    entries = [(p.stat().st_mtime, p, entry_bytes(p)) for p in root.iterdir()
               if p.is_dir() and ENTRY_NAME.match(p.name) and is_complete(p)]
    total = sum(size for _, _, size in entries)
    removed = []
    for _, path, size in sorted(entries, key=lambda e: e[0]):
        if total <= bound:
            break
        if _remove_if_free(root, path.name, entry=True):
            removed.append((path, size))
            total -= size
    return removed


def _remove_if_free(root: Path, key: str, *, entry: bool) -> bool:
    """Remove what the cache holds for `key` (the entry too if `entry`) unless a job holds its lock,
    or it is not this user's to remove (a cache shared by several users)."""
    path = root / f"{key}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        if not _try_lock(fd, fcntl.LOCK_EX) or not _still_there(path, fd):
            return False
        if entry:
            _discard_leftovers(root, key)
        else:
            shutil.rmtree(_work(root, key), ignore_errors=True)
        if not (root / key).exists():
            os.unlink(path)  # while still locked: a job waiting on it retries on a new file
        return True
    except OSError:  # no flock here, or another user's files
        return False
    finally:
        os.close(fd)
