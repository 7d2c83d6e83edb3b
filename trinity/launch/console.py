"""What the launcher and the workers agree on about the console (no torch): whether `trinity run`'s
stdout is a live terminal, told to the workers through TRINITY_TTY, and the prefix the relay puts before
each worker line. The progress bar itself is `trinity.trainer.progress`'s."""

from __future__ import annotations

from typing import Mapping, TextIO

# Set by `trinity run` for its workers ("1"/"0"): whether a live bar belongs on `trinity run`'s stdout.
# Under torchrun a worker's stdout is a log file that torchrun tails (prefixed) onto that terminal, so
# the worker cannot find out itself.
TTY_ENV = "TRINITY_TTY"


def live_console(environ: Mapping[str, str], stream: TextIO) -> bool:
    """Whether `stream` is a terminal a person watches: not under CI (CI runners may hand a job a
    pseudo-terminal, and their logs keep every frame), not with TERM=dumb, not a pipe or a file."""
    if environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    if environ.get("TERM", "").strip() == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def relay_prefix(local_rank: int | str) -> str:
    """What torchrun's `--tee` (and trinity.launch.single) puts before each line of a worker of local
    rank `local_rank` on the console."""
    return f"[default{local_rank}]:"
