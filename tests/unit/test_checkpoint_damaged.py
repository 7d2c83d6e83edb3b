"""A damaged training checkpoint is refused before any rank reads it, in one line that names the next
older complete checkpoint to resume from (or says none is left)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trinity.errors import UserError


def test_damaged_checkpoint_names_the_next_older_complete_one(tmp_path: Path):
    from trinity.trainer.checkpoint import CheckpointManager

    root = tmp_path / "checkpoints"
    for step in (2, 5, 9):
        (root / f"step_{step}" / "actor").mkdir(parents=True)
    (root / "step_2" / "complete").write_text("")
    (root / "step_5" / "complete").write_text("")
    manager = CheckpointManager(root, keep_last=3, is_rank0=True, engines={}, data=None)
    with pytest.raises(UserError, match=f"no metadata.json.*use trainer.resume={root / 'step_2'}$"):
        manager._check_readable(root / "step_5", root / "step_5" / "actor")
    with pytest.raises(UserError, match="no older complete checkpoint is left: use trainer.resume=disable"):
        manager._check_readable(root / "step_2", root / "step_2" / "actor")
