"""Per-step metrics on rank 0, for every recipe: metrics.jsonl (every step), a console line at the first
step and every log_interval steps (the recipe says what it shows; the logger adds elapsed time and ETA),
a live progress bar (trinity.trainer.progress) when the user watches a terminal, and TensorBoard (finite
numbers only) when it is installed and asked for."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

from trinity.launch.console import TTY_ENV  # noqa: F401 - one name for tests
from trinity.trainer.progress import console_is_terminal, line_due, progress_bar


def peak_memory_gib(device: Any) -> float:
    """Peak memory of this process (`device`: a torch.device): allocated CUDA memory on GPU, max resident
    set size on CPU."""
    if device.type == "cuda":
        import torch  # here: the console and metrics.jsonl need no torch (trinity.testing.progress_worker)

        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def hms(seconds: float) -> str:
    """0:00:07, 1:02:03 (hours unbounded)."""
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    """Writes metrics on rank 0; other ranks get a logger that does nothing."""

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        log_interval: int,
        tensorboard: bool,
        line: Callable[[dict[str, Any]], list[str]] | None = None,
        trackers: list[Any] | None = None,
    ):
        """`line(metrics)`: the parts of a step's console line after `step i/N` (the first also labels
        the progress bar); SFT's by default."""
        self.enabled, self.log_interval, self.total_steps = enabled, log_interval, total_steps
        self.line = line or sft_line
        self.start_step = start_step
        self._t0 = time.perf_counter()
        self._file = None
        self._tb = None
        self._progress = None
        self._trackers = list(trackers or [])  # trinity.trainer.trackers: wandb, mlflow
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / "metrics.jsonl"
        _keep_steps_up_to(path, start_step)
        self._file = path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                print("trainer.tensorboard: tensorboard is not installed; metrics go to metrics.jsonl only")
        if console_is_terminal():
            self._progress = progress_bar(total_steps, start_step, sys.stdout)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(metrics["step"])
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, step)
        for tracker in self._trackers:
            tracker.log(metrics, step)
        parts = self.line(metrics)
        if self._progress is not None:
            task = self._progress.task_ids[0]
            self._progress.update(task, completed=step, info=parts[0] if parts else "", refresh=True)
        if self.line_due(step):
            self.print(" | ".join([f"step {step}/{self.total_steps}", *parts, *self._timing(step)]
                                  + (["profiled"] if metrics.get("profiled") else [])))

    @property
    def live(self) -> bool:
        """Whether the progress bar is drawn (until close)."""
        return self._progress is not None

    def line_due(self, step: int, interval: int | None = None) -> bool:
        """Whether step `step` prints its line (`interval`: another one's, e.g. the samples')."""
        return line_due(step, interval=interval or self.log_interval, start_step=self.start_step,
                        total_steps=self.total_steps)

    def log_val(self, metrics: dict[str, Any]) -> None:
        """An evaluation's row (`step` and val/* keys; step 0 is before training): metrics.jsonl, the
        trackers (TensorBoard tag as the key) and one console line."""
        if not self.enabled:
            return
        step = int(metrics["step"])
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        values = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        for tracker in self._trackers:
            tracker.log(metrics, step)
        self.print(" | ".join([f"val step {step}/{self.total_steps}", *(f"{k} {_fmt(float(v))}" for k, v in values.items())]))

    def _timing(self, step: int) -> list[str]:
        """Elapsed time of this run (since the logger started) and the time the remaining steps take at
        this run's mean pace so far."""
        elapsed = time.perf_counter() - self._t0
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        return [f"elapsed {hms(elapsed)}", f"eta {hms(eta)}"]

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            # as written: no markup, emoji or highlighting (a sample's `[/x]` is text), and no wrapping
            # at the console's width (the terminal wraps; a log keeps one line)
            self._progress.console.print(text, markup=False, emoji=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def where(self) -> list[tuple[str, str]]:
        """(name, place) of each experiment tracker's run, for the run's closing summary."""
        return [(name, place) for name, place in (t.where() for t in self._trackers) if place]

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None  # later lines print plainly
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close()
        if self._file is not None:
            self._file.close()


def sft_line(metrics: dict[str, Any]) -> list[str]:
    return [
        f"loss {_fmt(metrics['loss'])}", f"lr {_fmt(metrics['lr'])}", f"grad_norm {_fmt(metrics['grad_norm'])}",
        f"{metrics['tokens_per_s']:.0f} tok/s", f"{metrics['step_time_s']:.3f} s/step", f"mem {metrics['mem_peak_gib']:.2f} GiB",
    ]


def _keep_steps_up_to(path: Path, step: int) -> None:
    """Drop metrics lines after `step`: a resumed run redoes those steps (a fresh run keeps none)."""
    kept = []
    if step > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
