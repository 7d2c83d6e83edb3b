"""A run's output folder as every process reads it: its checkpoints (`step_N/`, complete once the
`complete` marker is written) and the resolved config beside them. The launcher reads it before a job
starts (who owns the folder, where a resume goes on from); the trainer writes it."""

from __future__ import annotations

import re
from pathlib import Path

from trinity.config.loader import RESOLVED_CONFIG_FILE as CONFIG_FILE  # noqa: F401

COMPLETE = "complete"
STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints under root, oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = STEP_DIR.match(child.name)
            if m and child.is_dir() and (child / COMPLETE).is_file():
                found.append((int(m.group(1)), child))
    return sorted(found)
