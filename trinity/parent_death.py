"""A child process that dies with its parent, kill -9 included (Linux): what every process trinity starts
arms (the launcher, the workers, the reward process). Here, below every package that starts processes."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def linux_prctl() -> Any:
    """Linux's prctl through ctypes, None elsewhere. Resolved before a fork: nothing to load after it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def arm_parent_death(parent: int, prctl: Any = None) -> None:
    """In a child of `parent`: have the kernel SIGKILL this process when its parent dies, even by kill -9
    (Linux prctl PR_SET_PDEATHSIG; nothing elsewhere), and exit now if the parent is already gone.

    The signal fires when the parent's *thread* that forked this process ends, not the process: the
    callers fork from their main thread, which only ends with the process."""
    prctl = prctl if prctl is not None else linux_prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(128 + int(signal.SIGKILL))
