"""Overlapping the I/O of a conversion: a thread pool that keeps results in order and memory bounded.

Reading a tensor (`os.preadv`), writing one (`os.pwrite`), fsync and torch's copies all release the
GIL, so threads overlap them. One stream at a time left the disk and the page cache far under what they
deliver with a few requests in flight (benchmarks/convert.py measures both).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Bytes read ahead of the tensor being consumed: bounds a loader's extra host memory.
READ_AHEAD_BYTES = 1 << 30


def io_workers() -> int:
    """Threads (or writer processes) per rank for file I/O: I/O-bound, so twice the cores of this
    rank's share of the node (torchrun's LOCAL_WORLD_SIZE ranks share it), at least 2, at most 8."""
    cpus = os.cpu_count() or 2
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(2, min(8, 2 * cpus // local_world))


def ordered_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    size: Callable[[T], int] = lambda _: 1,
    budget: int = READ_AHEAD_BYTES,
    workers: int | None = None,
) -> Iterator[tuple[T, R]]:
    """Yield `(item, fn(item))` in the order of `items`, running `fn` on a thread pool.

    Items are started while the sizes of those started but not yet yielded stay within `budget` (one
    is always started, however large). The first failure in item order is raised; items not started by
    then never start.
    """
    pending: deque[tuple[T, int, Future[R]]] = deque()
    source = iter(items)
    in_flight = 0
    done = object()
    with ThreadPoolExecutor(max_workers=workers or io_workers(), thread_name_prefix="trinity-io") as pool:
        try:
            nxt = next(source, done)
            while True:
                while nxt is not done and (not pending or in_flight + size(nxt) <= budget):  # type: ignore[arg-type]
                    n = size(nxt)  # type: ignore[arg-type]
                    pending.append((nxt, n, pool.submit(fn, nxt)))  # type: ignore[arg-type]
                    in_flight += n
                    nxt = next(source, done)
                if not pending:
                    return
                item, n, fut = pending.popleft()
                in_flight -= n
                yield item, fut.result()
        finally:
            for _, _, fut in pending:
                fut.cancel()
