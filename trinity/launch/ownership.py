"""A run writes only into an output folder that is new, empty, or a trinity run's: never over files
that no trinity run wrote (a home folder, a data folder, another tool's results), unless
`trinity run --force`.

A trinity run's folder is told by the run marker (RUN_MARKER) that every run writes first, once it
holds the folder's lock; by a lock file (a run starting there now, trinity.launch.lock); by
`resolved_config.yaml`, which runs of versions without the marker wrote first; or by complete trinity
checkpoints under `checkpoints/` (copied there to resume from). A finished or interrupted run's
folder therefore stays accepted, and `trainer.resume: auto` goes on from its checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trinity import __version__
from trinity.errors import UserError
from trinity.launch.lock import LOCK_FILE
from trinity.launch.run_folder import CONFIG_FILE, complete_checkpoints

# Not hidden: a multi-node job's check for leftover temporary files (names starting with ".") must
# not see it, and a user listing the folder should.
RUN_MARKER = "trinity_run.json"


def is_trinity_folder(out: Path) -> bool:
    """Whether `out` holds a trinity run's marker, lock file, resolved config or complete checkpoints
    (see the module doc)."""
    if (out / RUN_MARKER).is_file() or (out / CONFIG_FILE).is_file():
        return True
    return any(out.glob(LOCK_FILE + "*")) or bool(complete_checkpoints(out / "checkpoints"))


def foreign_entries(out: Path) -> list[str]:
    """The names in `out` when it is an existing, non-empty folder that no trinity run wrote; [] otherwise."""
    try:
        names = sorted(p.name for p in out.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []  # a new folder, or a file: trinity.config.loader.check_output_dir reports that
    except OSError as exc:
        raise UserError(f"trainer.output_dir: cannot list {out}: {exc.strerror}; choose a folder you can read") from None
    if not names or is_trinity_folder(out):
        return []
    return names


def check_ownership(out: Path, *, force: bool) -> None:
    """UserError when `out` holds files no trinity run wrote and `force` is off."""
    names = [] if force else foreign_entries(out)
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise UserError(
            f"trainer.output_dir: {out} holds files no trinity run wrote ({shown}); choose a new or empty "
            "folder, or pass --force to write into it (files of the same name would be replaced)"
        )


def mark_run(out: Path) -> None:
    """Write the run marker into `out` unless there is one: the folder is a trinity run's from now on."""
    body = json.dumps({"tool": "trinity-mcore", "version": __version__, "created": time.time()}) + "\n"
    try:
        fd = os.open(out / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # an earlier run's, or another node's of this job: either says the same
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body)
