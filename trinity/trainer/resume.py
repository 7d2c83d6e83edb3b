"""Resume with a config that differs from the checkpoint's: say what differs, apply what can apply,
refuse what cannot (naming the key).

Every checkpoint stores the resolved config that wrote it (`resolved_config.yaml` beside `complete`).
On resume the two are compared key by key:
- applied: optimizer settings and the LR schedule's length (the schedule and the optimizer's
  hyper-parameters are rebuilt from the config, only the step count comes from the checkpoint),
  logging, checkpoint interval, step count, parallel layout and offload flags (checkpoints reshard),
  rollout and loss settings;
- refused: what makes the checkpoint another job's: the model, the algorithm, the critic, and the
  settings that define the data order the saved data position counts in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trinity.errors import UserError

from trinity.launch.run_folder import CONFIG_FILE
# A checkpoint is the folder <output_dir>/checkpoints/step_<N>; it is complete once trinity.trainer.checkpoint
# has written COMPLETE into it. Here, without torch, for the CLI (`trinity run` names the last complete
# checkpoint after a run; `trinity generate` loads the newest).
# Keys that never matter for a resume: where it resumes from, where the output goes, and where the
# initial weights come from (a resume loads the checkpoint's).
IGNORED = ("trainer.resume", "trainer.output_dir", ".megatron.dist_checkpointing_path", ".megatron.use_dist_checkpointing",
           ".megatron.use_mbridge")

# Prefixes (or whole keys) that cannot change on resume, and why.
REFUSED: tuple[tuple[str, str], ...] = (
    ("model.", "the checkpoint holds another model's weights"),
    ("algorithm.name", "the checkpoint was written by another algorithm"),
    ("data.train_files", "the saved data position counts rows of the checkpoint's data"),
    ("data.seq_length", "the saved data position counts rows packed at the checkpoint's length"),
    ("data.packing", "the saved data position counts rows of the checkpoint's packing"),
    ("data.shuffle", "the saved data position counts rows in the checkpoint's order"),
    ("data.max_prompt_length", "the saved data position counts the checkpoint's prompts"),
    ("data.train_batch_size", "the saved data position counts batches of the checkpoint's size"),
    ("trainer.global_batch_size", "the saved data position counts batches of the checkpoint's size"),
    ("trainer.seed", "the saved data position counts rows in the checkpoint's shuffled order"),
)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b.c": leaf} of a nested dict; lists are leaves."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        if not tree and prefix:
            out[prefix[:-1]] = {}
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any, str | None]]:
    """(key, checkpoint's value, config's value, why it is refused or None) for every key that differs."""
    changes: list[tuple[str, Any, Any, str | None]] = []
    if (saved.get("critic") is None) != (current.get("critic") is None):
        changes.append(("critic", saved.get("critic"), current.get("critic"), "the checkpoint's roles differ"))
        saved, current = {k: v for k, v in saved.items() if k != "critic"}, {k: v for k, v in current.items() if k != "critic"}
    a, b = flatten(saved), flatten(current)
    # A key only one side has comes from another trinity version's schema (a new field at its default),
    # not from the user: only keys both configs have are compared.
    for key in sorted(set(a) & set(b)):
        if any(key == i or key.endswith(i) for i in IGNORED):
            continue
        old, new = a[key], b[key]
        if old == new:
            continue
        why = next((reason for prefix, reason in REFUSED
                    if key == prefix or key.startswith(prefix if prefix.endswith(".") else prefix + ".")), None)
        changes.append((key, old, new, why))
    return changes


def check_resume_config(checkpoint: Path, cfg: Any) -> list[str]:
    """Lines that say which settings differ from `checkpoint`'s and are applied; UserError naming the
    first key that cannot change. A checkpoint without a stored config (older versions) gives none."""
    path = Path(checkpoint) / CONFIG_FILE
    if not path.is_file():
        return []
    saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    changes = config_changes(saved, cfg.model_dump(mode="json"))
    for key, old, new, why in changes:
        if why is not None:
            raise UserError(
                f"{key}: {new!r} differs from {old!r} in the checkpoint {checkpoint} ({why}); "
                f"restore it to resume, or start a new run (trainer.resume=disable or another trainer.output_dir)"
            )
    return [f"resume: {key} is {new!r} (the checkpoint had {old!r}): applied" for key, old, new, _ in changes]
