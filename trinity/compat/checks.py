"""What trinity's megatron-core patches replace, checked when each is installed.

Each patch (listed in docs/architecture.md, "megatron-core patches") replaces names inside
megatron-core 0.16.1 (`PINNED`). A megatron-core release that moved or renamed one of them would otherwise leave
the patch silently unapplied (or fail mid-step); `require` makes it one clear error when the patch is
enabled, at the start of the job.
"""

from __future__ import annotations

import inspect
from typing import Any

from trinity.errors import UserError

PINNED = "0.16.1"  # the megatron-core version of pyproject.toml, which every patch was written against


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # pragma: no cover - megatron-core imported from a source tree
        return "unknown"


def require(patch: str, owner: Any, *names: str) -> None:
    """UserError unless every name in `names` is an attribute of `owner` (a megatron-core module or
    class) that patch `patch` replaces or relies on."""
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        where = getattr(owner, "__module__", None) if isinstance(owner, type) else None
        label = f"{where}.{owner.__qualname__}" if where else getattr(owner, "__name__", repr(owner))
        raise UserError(
            f"megatron-core {_version()}: {label} has no {', '.join(missing)}, which trinity's {patch} patch "
            f"replaces; install the megatron-core version trinity pins, {PINNED} (pip install -e . in the repository)"
        )


def require_global(patch: str, function: Any, *names: str) -> None:
    """UserError unless `function`'s code still refers to each global name in `names` (the patch
    provides that global)."""
    # megatron-core decorates some of them (custom_bwd on the GEMM backward): the code is the wrapped one's
    code = getattr(inspect.unwrap(function), "__code__", None)
    missing = [n for n in names if code is None or n not in code.co_names]
    if missing:
        raise UserError(
            f"megatron-core {_version()}: {function.__module__}.{function.__qualname__} no longer uses "
            f"{', '.join(missing)}, which trinity's {patch} patch provides; install the megatron-core "
            f"version trinity pins, {PINNED} (pip install -e . in the repository)"
        )
