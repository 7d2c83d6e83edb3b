"""megatron-core module attributes replaced for one block: dist checkpoints load past torch's one-thread 1.4 GB/s, weights-only.

megatron-core builds some objects inside its own methods through module-level names (the dist-checkpoint
loader's reader and planner: `trinity.convert.dist_ckpt`, which reads with its thread pools and unpickles
weights-only); `replaced` swaps them for the call and puts the originals back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from trinity.compat.checks import require


@contextmanager
def replaced(patch: str, module: Any, **values: Any) -> Iterator[None]:
    """`module`'s attributes named in `values` replaced for the duration; UserError naming patch `patch`
    and the pinned megatron-core where one of them does not exist."""
    require(patch, module, *values)
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
