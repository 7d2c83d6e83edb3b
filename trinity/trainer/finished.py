"""A finished job's record: <output_dir>/trinity_done.json, written by rank 0 once the job has
trained its last step, saved its checkpoints and exported; removed by `trinity run` before it starts
a job in the folder (so it only ever describes a job that ran to its end).

A second `trinity run` of the same job (`same_job`: the same config, save for the keys that never
change what a job computes) whose record, final checkpoint and exports are all still there has
nothing to do: `complete_line` says so and the CLI launches nothing. Anything else (a changed config,
a missing export) runs as usual: resume from the newest checkpoint, train what is left, export.

Torch-free: the CLI reads it before it imports anything heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from trinity.launch.run_folder import COMPLETE
from trinity.trainer.resume import IGNORED, flatten

DONE_FILE = "trinity_done.json"


def job_identity(config: dict[str, Any]) -> str:
    """A digest of a resolved config (model_dump(mode="json")) without the keys that say where a job
    reads or writes (resume.IGNORED): the CLI's config before conversion and the workers' resolved one
    give the same digest."""
    kept = {k: v for k, v in flatten(config).items() if not any(k == i or k.endswith(i) for i in IGNORED)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def write_done(out: Path, *, config: dict[str, Any], step: int, checkpoint: Path | None, exports: list[Path]) -> Path:
    """Record that the job of `config` ended at `step`, with its last checkpoint and export folders
    (paths relative to `out` where inside it). Written beside and renamed: never half-written."""
    body = {
        "identity": job_identity(config), "step": step,
        "checkpoint": _rel(checkpoint, out) if checkpoint is not None else None,
        "exports": [_rel(p, out) for p in exports],
    }
    path = out / DONE_FILE
    tmp = path.with_name(f".{DONE_FILE}.{socket.gethostname()}-{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)
    return path


def clear_done(out: Path) -> None:
    (out / DONE_FILE).unlink(missing_ok=True)


def _rel(path: Path, out: Path) -> str:
    try:
        return str(Path(path).relative_to(out))
    except ValueError:
        return str(path)


def read_done(out: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((out / DONE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def complete_line(out: Path, config: Any) -> str | None:
    """The line `trinity run` prints instead of launching when the job of `config` (a JobConfig) already
    ran to its end in `out` and left everything it writes; None when there is something to run."""
    done = read_done(out)
    if done is None or config.trainer.resume != "auto" or done.get("identity") != job_identity(config.model_dump(mode="json")):
        return None
    ckpt = out / done["checkpoint"] if done.get("checkpoint") else None
    exports = [out / p for p in done.get("exports") or []]
    if ckpt is not None and not (ckpt / COMPLETE).is_file():
        return None
    if not all(p.is_dir() and any(p.iterdir()) for p in exports):
        return None
    where = [f"checkpoint {ckpt}"] if ckpt is not None else []
    where += [f"export {p}" for p in exports]
    return (f"job already complete: {out} trained all {done.get('step')} steps ({', '.join(where) or 'metrics.jsonl'}); "
            f"nothing to run (raise trainer.total_steps to train on, or use a new trainer.output_dir to start over)")
