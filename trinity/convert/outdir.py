"""Atomic output folders: write into a temporary sibling, rename at the end, leave nothing on failure.

Temporary siblings are named `.<name>.tmp-<host>-<pid>-<random>` (and `.<name>.old-<host>-<pid>-<random>`
for a folder being replaced, `.<name>.build-...` for `trinity run`'s conversion), so that a conversion
killed before it could clean up (kill -9, OOM, a lost node) is recognised later: `check_output` removes
the siblings of the same output that this host made from processes that no longer exist, and
`trinity run` those in its output folder (`stale_temps`). Other hosts' siblings (shared filesystems)
and live processes' are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from trinity.errors import UserError


def _host() -> str:
    # '-' separates the fields of the name, so the host part keeps only characters it cannot contain.
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def temp_sibling(out: Path, kind: str = "tmp") -> Path:
    """A fresh name for a temporary sibling of `out` that records this host and process."""
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# `.<name>.<kind>-<host>-<pid>-<8 hex>`; <name> may itself be a temporary's (a conversion into a build folder)
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old|build)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _owner_alive(pid: int) -> bool:
    from trinity.launch.child import alive

    return pid == os.getpid() or alive(pid)


def stale_temps(folder: str | Path) -> list[Path]:
    """Temporary folders (our naming pattern only) in `folder` left by dead processes of this host.
    Other hosts' (a shared filesystem) and live processes' are never included: a conversion running
    beside us may be writing them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = []
    for p in folder.iterdir():
        m = _TEMP.match(p.name)
        if m and m["host"] == _host() and not _owner_alive(int(m["pid"])):
            stale.append(p)
    return sorted(stale)


def stale_siblings(out: str | Path) -> list[Path]:
    """The `stale_temps` of the output `out` itself (`.<out name>.tmp-...`), beside it."""
    out = Path(out).resolve()
    return [p for p in stale_temps(out.parent) if _TEMP.match(p.name)["name"] == out.name]  # type: ignore[index]


def remove_temps(paths: Iterable[Path]) -> list[Path]:
    """Remove `paths` (folders or files); returns them."""
    removed = []
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def remove_stale_siblings(out: str | Path) -> list[Path]:
    """Remove what `stale_siblings` finds; returns the removed paths."""
    return remove_temps(stale_siblings(out))


def check_not_overlapping(output: str | Path, sources: Iterable[str | Path], *, inside_ok: bool = False) -> None:
    """Refuse an output that is or contains one of `sources`, or an existing output inside one (paths
    resolved, so symlinks count): `--force` replaces the output folder, which would delete the source
    it converts from or, inside it, a part of it (the `hf/` folder of a dist checkpoint). A new folder
    inside the source deletes nothing (`trinity run --no-cache` converts into `<output_dir>/mcore_cache/`,
    wherever the output dir is). `inside_ok`: never refuse the inside case (a training run's checkpoints and
    export replace only what the run itself wrote there)."""
    out = Path(output).resolve()
    for source in sources:
        src = Path(source).resolve()
        if out == src:
            how = "is the source folder"
        elif out in src.parents:
            how = "contains the source folder"
        elif src in out.parents and out.exists() and not inside_ok:
            how = "is inside the source folder"
        else:
            continue
        raise UserError(f"{out}: the output {how} {src}; choose an output folder outside the source")


def check_output(
    output: str | Path, force: bool, *, sources: Iterable[str | Path] = (), inside_ok: bool = False
) -> Path:
    """Refuse an existing non-empty output unless `force`, and any output overlapping one of `sources`
    (the folders being read); returns the resolved path. Removes the temporary siblings that
    interrupted conversions into the same output left behind."""
    check_not_overlapping(output, sources, inside_ok=inside_ok)
    out = Path(output).resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: output exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out}: output folder exists and is not empty (pass --force to replace it)")
    remove_stale_siblings(out)
    return out


@contextmanager
def atomic_dir(
    output: str | Path, *, force: bool, sources: Iterable[str | Path] = (), inside_ok: bool = False
) -> Iterator[Path]:
    """Yield a temporary sibling of `output`; on success it replaces `output`, on error it is removed.
    `sources`: folders being read, which the output must not overlap (see `check_output`)."""
    out = check_output(output, force, sources=sources, inside_ok=inside_ok)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`, replacing an old `out` (only reached when force allowed it)."""
    old = None
    if out.exists():
        old = temp_sibling(out, "old")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
