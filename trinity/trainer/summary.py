"""The closing summary of a run (rank 0, after the HF export): where its files are and how its main
metrics moved, from what the run left in its output folder. Without torch: `trinity plot` reads the same
metrics.jsonl.

    run summary: runs/quickstart
      loss        5.7645 (step 1) -> 1.3512 (step 60)
      metrics     runs/quickstart/metrics.jsonl
      ...
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# The metrics a person judges a run by, in the order shown: the training loss (SFT, pt, DPO), DPO's
# preference accuracy, the RL reward, and the val metric of each kind of job (trinity.trainer.evaluation).
MAIN_METRICS = ("loss", "rewards/accuracies", "reward/mean", "val/loss", "val/reward_mean")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (training steps and evaluations), skipping a line that is not a JSON
    object with a step (a run killed mid-write leaves half a line)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def number(value: Any) -> float | None:
    """`value` as a finite float, or None (missing, not a number, inf, nan)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def first_last(rows: list[dict[str, Any]], key: str) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """((step, value), (step, value)) of the first and last rows with a finite `key`; None without one."""
    found = [(row["step"], v) for row in rows if (v := number(row.get(key))) is not None]
    return (found[0], found[-1]) if found else None


def last_checkpoint(out: Path) -> Path | None:
    from trinity.launch.run_folder import complete_checkpoints

    found = complete_checkpoints(out / "checkpoints")
    return found[-1][1] if found else None


def run_paths(out: Path) -> list[tuple[str, Path]]:
    """(label, path) of what a run leaves in `out`, for those that exist."""
    places = [
        ("metrics", out / "metrics.jsonl"), ("logs", out / "logs"), ("checkpoint", last_checkpoint(out)),
        ("hf export", out / "hf"), ("samples", out / "samples"), ("curves", out / "curves.png"),
        ("tensorboard", out / "tensorboard"), ("profile", out / "profile"),
    ]
    return [(label, path) for label, path in places if path is not None and path.exists()]


def summary_lines(out: Path, rows: list[dict[str, Any]], trackers: list[tuple[str, str]] = ()) -> list[str]:
    """The summary block: a title, the first and last value of each main metric the run has, then its
    files and tracker runs (`trackers`: (name, where))."""
    values = []
    for key in MAIN_METRICS:
        ends = first_last(rows, key)
        if ends is not None:
            (s0, v0), (s1, v1) = ends
            values.append((key, f"{v0:.4f} (step {s0}) -> {v1:.4f} (step {s1})"))
    entries = values + [(label, str(path)) for label, path in run_paths(out)] + list(trackers)
    width = max((len(label) for label, _ in entries), default=0)
    return [f"run summary: {out}"] + [f"  {label.ljust(width)}  {text}" for label, text in entries]
