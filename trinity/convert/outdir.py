"""Atomic output folders: write into a temporary sibling, rename at the end, leave nothing on failure."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trinity.errors import UserError


def check_output(output: str | Path, force: bool) -> Path:
    """Refuse an existing non-empty output unless `force`; returns the resolved path."""
    out = Path(output).resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: output exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out}: output folder exists and is not empty (pass --force to replace it)")
    return out


@contextmanager
def atomic_dir(output: str | Path, *, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `output`; on success it replaces `output`, on error it is removed."""
    out = check_output(output, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
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
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
