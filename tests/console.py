"""What a documented command may not print by default: third-party warnings, progress bars, stray blank
lines (trinity.compat.quiet hides them; `--debug` shows them). Used by the tests that run documented
commands and keep their console output."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

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



def on_a_terminal(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, columns: int,
                  on_output: Callable[[bytes], None] | None = None) -> tuple[int, bytes]:
    """Run `cmd` with stdout and stderr on a pseudo-terminal of `columns` columns, as a user in a shell
    has it; `on_output(everything received so far)` after each read. (exit code, all the terminal
    received); the process is killed if it outlives `timeout`."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    received = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            received += chunk
            if on_output is not None:
                on_output(bytes(received))
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), bytes(received)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
