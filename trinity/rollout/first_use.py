"""The first-use check of the decode kernels and the sampler: whether Triton runs on a device, and one verdict
per process and shape from a comparison with the torch ops (a kernel that fails it is not used)."""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def triton_runs(device: torch.device) -> bool:
    """Triton is installed and runs on `device`: CUDA, or anywhere under its interpreter (TRITON_INTERPRET=1,
    the CPU tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def checked_once(cache: dict, key: tuple, check) -> bool:
    """`check()`'s verdict for `key`, computed at the first call of a process (a kernel's first-use check)."""
    if key not in cache:
        cache[key] = check()
    return cache[key]


def verdict(check, disabled: str) -> bool:
    """Run a kernel's first-use check: `check()` returns None when the kernel agrees with the torch ops,
    else the reason it does not; an exception (a Triton build or launch problem on this machine) is a
    reason too. False comes with the warning `disabled` (a format string of `reason`): the torch ops
    still work, the rollout is slower."""
    import warnings

    try:
        reason = check()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    if reason is None:
        return True
    warnings.warn(disabled.format(reason=reason), stacklevel=3)
    return False
