"""How the CLI's own process stops on Ctrl-C, SIGTERM and SIGHUP outside a running job.

While the CLI supervises a child (the job's launcher, a conversion: trinity.launch.torchrun.supervise),
these signals are forwarded to it. Around that (the launch's preparations, the lock, the export of
`trinity convert mcore-to-hf`), SIGINT alone would raise KeyboardInterrupt and SIGTERM or SIGHUP would
end the process on the spot, leaving its temporary folder behind. `interruptible()` makes all three
raise `Interrupted` in the main thread, so the code in progress unwinds (its temporary folders removed)
and the CLI prints `interrupted`. A second signal ends the process at once: a user pressing Ctrl-C
twice wants out now, and what the clean-up leaves the next start removes (trinity.convert.outdir).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Iterator

from trinity.launch.child import FORWARDED


class Interrupted(KeyboardInterrupt):
    """A stop asked by signal `signum`; the CLI exits with 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal that stopped the process (a plain KeyboardInterrupt: SIGINT); it exits with 128 + it."""
    return getattr(exc, "signum", int(signal.SIGINT))


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block SIGINT, SIGTERM and SIGHUP raise `Interrupted` (main thread only, as Python runs
    signal handlers there); a second one exits with 128 + its number at once.

    Only for code that does not fork: a handler runs at the next instruction of the main thread, and
    right after a fork that is an at-fork hook (logging's), where Python prints the exception as
    "ignored" and goes on. That is how a Ctrl-C during the conversion was lost while megatron-core forked
    its checkpoint writers, and the job trained to the end: conversions run in a child process
    (trinity.convert.api.conversion_job), which the CLI stops as it stops a job."""
    stopping: dict[str, Any] = {"sig": None}

    def stop(signum: int, _frame: Any) -> None:
        if stopping["sig"] is not None:
            os._exit(128 + signum)
        stopping["sig"] = signum
        raise Interrupted(signum)

    old = {s: signal.signal(s, stop) for s in FORWARDED}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
