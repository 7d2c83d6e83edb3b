"""trinity.convert.parallel_io: results in item order, a bounded amount in flight, the first failure in
order raised, and the worker count per rank."""

from __future__ import annotations

import threading

import pytest

from trinity.convert import parallel_io
from trinity.convert.parallel_io import io_workers, ordered_map


def test_results_come_in_item_order_even_when_later_items_finish_first():
    first_may_finish = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            assert first_may_finish.wait(timeout=30)  # item 0 ends only after item 3 has ended
        if i == 3:
            first_may_finish.set()
        return i * i

    out = list(ordered_map(work, range(6), workers=4))
    assert out == [(i, i * i) for i in range(6)]


def test_items_in_flight_stay_within_the_budget():
    lock = threading.Lock()
    yielded = 0
    started: list[int] = []
    seen_in_flight: list[int] = []

    def work(i: int) -> int:
        with lock:
            started.append(i)
            seen_in_flight.append(len(started) - yielded)
        return i

    for _ in ordered_map(work, range(20), size=lambda i: 3, budget=9, workers=8):
        with lock:
            yielded += 1
    # size 3 against a budget of 9: at most 3 items started and not yet handed out (+1 being handed out)
    assert max(seen_in_flight) <= 4 and len(started) == 20


def test_an_item_larger_than_the_budget_still_runs():
    assert [r for _, r in ordered_map(lambda i: i + 1, [5], size=lambda i: 10**12, budget=1)] == [6]


def test_the_first_failure_in_item_order_is_raised_and_later_items_do_not_start():
    started: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            started.append(i)
        if i in (2, 4):
            raise ValueError(f"item {i}")
        return i

    got = []
    with pytest.raises(ValueError, match="item 2"):
        for item, _ in ordered_map(work, range(100), size=lambda i: 1, budget=4, workers=2):
            got.append(item)
    assert got == [0, 1]
    assert max(started) < 10  # the budget kept the rest from ever starting


@pytest.mark.parametrize("cpus,local_world,expected", [(2, None, 4), (16, None, 8), (16, "8", 4), (16, "16", 2), (1, None, 2)])
def test_io_workers_share_the_node_between_its_ranks(monkeypatch, cpus, local_world, expected):
    monkeypatch.setattr(parallel_io.os, "cpu_count", lambda: cpus)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    assert io_workers() == expected
