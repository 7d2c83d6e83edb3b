"""Per-step metrics on rank 0, for every recipe: metrics.jsonl (every step), a console line every
log_interval steps (the recipe says what it shows; the logger adds elapsed time and ETA), a rich
progress bar when the user watches a terminal, and TensorBoard (finite numbers only) when it is
installed and asked for."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import torch

# Set by `trinity run` for its workers ("1"/"0"): whether `trinity run`'s own stdout is a terminal.
# Under torchrun a worker's stdout is a log file that torchrun tails (prefixed) onto that terminal, so
# the worker cannot find out itself.
TTY_ENV = "TRINITY_TTY"


def console_is_terminal(environ: Mapping[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """Whether rank 0 should draw the progress bar: what `trinity run` said (TRINITY_TTY) when it
    launched this process, else whether `stream` (stdout) is a terminal."""
    environ = os.environ if environ is None else environ
    stream = sys.stdout if stream is None else stream
    said = environ.get(TTY_ENV)
    if said is not None and said.strip() != "":
        return said.strip() == "1"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory on GPU, max resident set size on CPU."""
    if device.type == "cuda":
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


class _TailSafe:
    """A stream for rich's live display that torchrun tails line by line onto a terminal.

    rich redraws the bar after a carriage return, but torchrun reads the log with universal newlines
    (`tail_logfile`), where a lone `\r` ends a line: every redraw would become a new line. Cursor to
    column 1 (`ESC [ G`) does the same on the terminal without ending the line; torchrun passes the
    unfinished line on as it comes, so the bar is redrawn in place."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(text.replace("\r\n", "\n").replace("\r", "\x1b[G"))
        self._stream.flush()
        return len(text)

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


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
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
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
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            real = sys.stdout.isatty()
            # Under torchrun stdout is a log file that torchrun tails onto `trinity run`'s terminal:
            # draw as on a terminal (COLUMNS from `trinity run` sets the width), without carriage
            # returns (see _TailSafe), and only when a step ends, so the log gets one bar per step.
            console = Console() if real else Console(file=_TailSafe(sys.stdout), force_terminal=True)
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), transient=True, auto_refresh=real, console=console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(metrics["step"])
        self.first = self.first or metrics
        self.last = metrics
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
            self._progress.update(self._task, completed=step, info=parts[0] if parts else "", refresh=True)
        if step % self.log_interval == 0 or step == self.total_steps:
            self.print(" | ".join([f"step {step}/{self.total_steps}", *parts, *self._timing(step)]
                                  + (["profiled"] if metrics.get("profiled") else [])))

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
            self._progress.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
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
