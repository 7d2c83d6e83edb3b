"""How the CLI reports outcomes: user errors as one clean block, bugs with a hint (or a traceback)."""

from __future__ import annotations

import sys
from typing import Callable

from trinity.errors import ConfigError, UserError


def run_guarded(fn: Callable[[], int | None], debug: bool) -> int:
    """Run a command body and turn its outcome into an exit code.

    UserError -> its message on stderr, exit 2 (no traceback: the user can fix it from the message).
    Any other exception is a bug: re-raised with --debug, otherwise one line saying how to see it.
    """
    try:
        code = fn()
        return int(code or 0)
    except ConfigError as exc:
        n = len(exc.problems)
        print(f"error: the config has {n} problem{'s' if n != 1 else ''}:", file=sys.stderr)
        for p in exc.problems:
            print(f"  {p}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (trinity.launch.stop.interruptible)
        from trinity.launch.stop import signal_of

        print("interrupted", file=sys.stderr)
        return 128 + signal_of(exc)
    except BaseException as exc:  # torch's CheckpointException (a full disk under it) is a BaseException
        from trinity.launch.failures import disk_error, disk_error_message

        err = disk_error(exc)
        if err is not None:  # a full or read-only disk: the user's to fix, one line naming the file
            if debug:
                raise
            print(f"error: {disk_error_message(err)}", file=sys.stderr)
            return UserError.exit_code
        if debug or isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        # a bug: never hide it, but keep the default output short
        message = " ".join(str(exc).split())  # one line even when the exception's text has several
        print(
            f"internal error: {type(exc).__name__}: {message} (re-run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
