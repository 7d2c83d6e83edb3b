"""A running batch of turns, stepped by `trinity.workflows.batcher.RunningBatcher` on its worker thread.

A `TurnStream` takes requests between steps (`add`), runs one engine iteration per `step` and returns the
requests that ended in it, and drops a request on `cancel` (its row ends at the next step and frees its
KV slot). Two kinds:
- `SchedulerStream`: the continuous engine's `ContinuousScheduler` (`trinity.rollout.continuous.open_engine`),
  the way partial rollouts drive it: a request is a row added between decode steps; its draws are keyed by
  (episode, turn, token index) (`Sampler(keyed=True)` on CPU, the fused sampler on CUDA), so a row's tokens
  do not depend on which other rows share its steps; output rows are reused once their result is read;
- `BatchStream`: any `ChatBackend` (one `generate` call per step for every request added since the last),
  for backends that cannot stream (the scripted one, the static reference engine).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from trinity.rollout.scheduler import ContinuousScheduler
from trinity.rollout.slot_table import Group
from trinity.rollout.types import SamplingParams
from trinity.workflows.types import ChatBackend, TokenRequest, TokenResult

Ticket = int  # the batcher's number of one request


class TurnStream(Protocol):
    @property
    def live(self) -> int:
        """Requests added and not yet returned by `step` (cancelled ones until their row ends)."""
        ...

    @property
    def room(self) -> int:
        """Requests `add` takes now."""
        ...

    def add(self, items: Sequence[tuple[Ticket, TokenRequest]]) -> None: ...

    def step(self) -> list[tuple[Ticket, TokenResult]]: ...

    def cancel(self, ticket: Ticket) -> None: ...


def draw_name(episode: int, turn: int) -> int:
    """One number per (episode, turn) with no bound on either (Cantor's pairing)."""
    s = episode + turn
    return s * (s + 1) // 2 + turn


class SchedulerStream:
    """Requests as rows of an open continuous engine (module doc). `max_new`: the engine's token bound (the
    stride of the draw keys); every request's prompt plus its `max_new_tokens` fits the engine's cache."""

    def __init__(self, sched: ContinuousScheduler, max_new: int, eos: Sequence[int]) -> None:
        self.sched, self.max_new, self.eos = sched, max_new, set(eos)
        self.free = list(range(sched.rows))
        self.ticket_of: dict[int, Ticket] = {}  # row -> ticket
        self.row_of: dict[Ticket, int] = {}
        self.dropped: set[int] = set()  # rows whose request was cancelled

    @property
    def live(self) -> int:
        return len(self.ticket_of)

    @property
    def room(self) -> int:
        return len(self.free)

    def add(self, items: Sequence[tuple[Ticket, TokenRequest]]) -> None:
        rows, keys, limits = [], [], []
        by_prompt: dict[tuple[int, ...], list[int]] = {}  # identical prompts share one prefill
        for ticket, req in items:
            if len(req.prompt_ids) + req.sampling.max_new_tokens > self.max_new:
                raise ValueError(f"a turn of {len(req.prompt_ids)} prompt tokens and up to {req.sampling.max_new_tokens} "
                                 f"new ones does not fit the engine's {self.max_new} tokens a row; give the backend "
                                 "context_tokens at least the sessions' Limits.context_tokens")
            r = self.free.pop(0)
            self.ticket_of[r], self.row_of[ticket] = ticket, r
            rows.append(r)
            keys.append(draw_name(req.episode, req.turn) * self.max_new)
            limits.append(req.sampling.max_new_tokens)
            by_prompt.setdefault(req.prompt_ids, []).append(r)
        self.sched.limit[rows] = self.max_new  # a reused row: `start_rows` only lowers its limit
        self.sched.start_rows(rows, keys, limits)
        self.sched.add([Group(p, tuple(rs)) for p, rs in by_prompt.items()])

    def cancel(self, ticket: Ticket) -> None:
        r = self.row_of.pop(ticket, None)
        if r is not None:  # the row ends at its next booked token (prefill or decode), freeing its slot
            self.dropped.add(r)
            self.sched.limit[r] = 0

    def step(self) -> list[tuple[Ticket, TokenResult]]:
        ended = self.sched.step()
        out = []
        for r in ended:
            ticket = self.ticket_of.pop(r)
            self.free.append(r)
            if r in self.dropped:
                self.dropped.discard(r)
                continue
            del self.row_of[ticket]
            n = int(self.sched.out_len[r])
            ids = tuple(self.sched.out_tokens[r, :n].tolist())
            logp = tuple(float(x) for x in self.sched.pipe.from_last(self.sched.out_logp[r, :n].contiguous()).tolist())
            out.append((ticket, TokenResult(ids, logp, "stop" if ids and ids[-1] in self.eos else "length")))
        self.free.sort()
        return out


class BatchStream:
    """A `ChatBackend` as a stream: each step answers every request added since the last, in one call."""

    def __init__(self, backend: ChatBackend) -> None:
        self.backend = backend
        self.todo: list[tuple[Ticket, TokenRequest]] = []

    @property
    def live(self) -> int:
        return len(self.todo)

    @property
    def room(self) -> int:
        return 1 << 30

    def add(self, items: Sequence[tuple[Ticket, TokenRequest]]) -> None:
        self.todo += list(items)

    def cancel(self, ticket: Ticket) -> None:
        self.todo = [(t, r) for t, r in self.todo if t != ticket]

    def step(self) -> list[tuple[Ticket, TokenResult]]:
        todo, self.todo = self.todo, []
        results = self.backend.generate([r for _, r in todo])
        if len(results) != len(todo):
            raise RuntimeError(f"returned {len(results)} results for {len(todo)} requests")
        return [(t, res) for (t, _), res in zip(todo, results)]


class StreamBackend(Protocol):
    """An engine that runs a batch of turns step by step: `open(sampling, rows)` gives a `TurnStream` of at
    most `rows` live requests that all sample with `sampling`'s temperature, top-p, top-k and stop ids
    (each request's own `max_new_tokens` is its limit). Entered, stepped and left on one thread."""

    def open(self, sampling: SamplingParams, rows: int) -> AbstractContextManager[TurnStream]: ...


@dataclass
class Batched:
    """A `ChatBackend` (one result per request, in order, per call) as a `StreamBackend`."""

    backend: ChatBackend

    @contextmanager
    def open(self, sampling: SamplingParams, rows: int) -> Iterator[TurnStream]:
        yield BatchStream(self.backend)


def streaming(backend: ChatBackend | StreamBackend) -> StreamBackend:
    """`backend` itself when it streams, else `Batched(backend)`."""
    return backend if callable(getattr(backend, "open", None)) else Batched(backend)  # type: ignore[return-value]
