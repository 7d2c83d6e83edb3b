"""What rank 0 shows while it trains, decided without torch (`trinity run` asks too, before any import of
it): whether a live progress bar is drawn, which steps print their line, and the bar itself.

The bar is drawn only on someone's terminal: `trinity run`'s stdout is a terminal, not under CI (CI
runners may hand a job a pseudo-terminal, and their logs keep every frame) and TERM is not `dumb`. Anything
else (a pipe, `> run.log`, `| tee`) gets plain lines only."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Mapping, TextIO

from trinity.launch.console import TTY_ENV, live_console, relay_prefix


def console_is_terminal(environ: Mapping[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """Whether rank 0 draws the bar: what `trinity run` said (TRINITY_TTY) when it launched this
    process, else whether its own stdout is a live console."""
    environ = os.environ if environ is None else environ
    stream = sys.stdout if stream is None else stream
    said = environ.get(TTY_ENV, "").strip()
    if said:
        return said == "1"
    return live_console(environ, stream)


def line_due(step: int, *, interval: int, start_step: int, total_steps: int) -> bool:
    """Whether step `step` prints its line (or its samples, with their interval): the run's first step,
    so that the console shows something at once, every `interval`-th step, and the last."""
    return step == start_step + 1 or step % interval == 0 or step == total_steps


def rate(steps_per_s: float | None) -> str:
    """A step rate as people read it: `2.41 s/step` below one step a second, `3.2 steps/s` above."""
    if not steps_per_s:
        return "-- s/step"
    if steps_per_s < 1:
        return f"{1 / steps_per_s:.2f} s/step"
    return f"{steps_per_s:.1f} steps/s"


class TailSafe:
    """A stream for rich's live display that a relay passes on line by line onto a terminal, with its
    prefix before each line.

    rich redraws the bar after a carriage return, but torchrun reads the log with universal newlines
    (`tail_logfile`), where a lone `\\r` ends a line: every redraw would become a new line. Cursor to
    column 1 (`ESC [ G`) does the same on the terminal without ending the line; torchrun and
    trinity.launch.single pass the unfinished line on as it comes, so the bar is redrawn in place. The
    redraw erases the line (`ESC [ 2K`), the relay's prefix with it: it is written again after the
    erase, so that the bar and the lines printed above it read on a terminal as they do in a pipe."""

    def __init__(self, stream: TextIO, prefix: str):
        self._stream, self._prefix = stream, prefix

    def write(self, text: str) -> int:
        safe = text.replace("\r\n", "\n").replace("\r\x1b[2K", "\x1b[G\x1b[2K" + self._prefix)
        # Cursor visibility stays the terminal's: a worker killed with the cursor hidden would leave it
        # so, and torchrun's tail would put its prefix before such a lone sequence.
        safe = safe.replace("\x1b[?25l", "").replace("\x1b[?25h", "")
        self._stream.write(safe.replace("\r", "\x1b[G"))
        self._stream.flush()
        return len(text)

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def progress_bar(total_steps: int, start_step: int, stream: TextIO) -> Any:
    """A started rich Progress on `stream`: `train ━━━━━╸━━━ 12/60 0.25 s/step eta 0:00:12 <info>`;
    `update(completed=step, info=...)` moves it, `console.print` prints a line above it. The bar stays
    on screen when stopped (a transient one is erased by moving the cursor up, which leaves the relay's
    prefix behind on the line below)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(rate(task.speed), style="progress.data.speed")

    real = stream.isatty()
    if real:
        console = Console(file=stream)
    else:
        # Relayed (a worker's stdout is a pipe or a log file that reaches `trinity run`'s terminal): draw
        # as on a terminal as wide as `trinity run`'s (COLUMNS) less the relay's prefix, without carriage
        # returns (TailSafe), and only when a step ends, so that the log gets one frame per step.
        prefix = relay_prefix(os.environ.get("LOCAL_RANK", "0"))
        width = max(shutil.get_terminal_size().columns - len(prefix), 40)
        console = Console(file=TailSafe(stream, prefix), force_terminal=True, width=width)
    bar = Progress(
        TextColumn("[bold]train"), BarColumn(bar_width=30), MofNCompleteColumn(), RateColumn(),
        TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
        auto_refresh=real, console=console,
    )
    bar.add_task("train", total=total_steps, completed=start_step, info="")
    bar.start()
    return bar
