"""What a documented command may not print by default: third-party warnings, progress bars, stray blank
lines (trinity.launch.quiet hides them; `--debug` shows them). Used by the tests that run documented
commands and keep their console output."""

from __future__ import annotations

import re

# trinity's own warnings (the plan's `warning: <key>: ...`, also from a rank: `[default0]:warning: ...`)
OWN_WARNING = re.compile(r"^(\[default\d+\]:)?warning: [\w.]+: ")
NOISE = {
    "a warning": re.compile(r"(?i)warn"),  # UserWarning, FutureWarning, warnings.warn(, [W... Warning:
    "a progress bar": re.compile(r"\d+%\||\d+/\d+ \[\d\d:\d\d|it/s\]|s/it\]|\r"),
}


def noise(text: str, *, blank_lines: bool = False) -> list[str]:
    """The lines of `text` that are noise, each with what it is; blank lines count unless `blank_lines`."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            found += [] if blank_lines else [f"line {n}: a blank line"]
            continue
        if OWN_WARNING.match(line):
            continue
        found += [f"line {n}: {what}: {line!r}" for what, pattern in NOISE.items() if pattern.search(line)]
    return found

