"""A running batch of turns, stepped by `trinity.workflows.batcher.RunningBatcher` on its worker thread.

A `TurnStream` takes requests between steps (`add`), runs one engine iteration per `step` and returns the
requests that ended in it, and drops a request on `cancel` (its row ends at the next step and frees its
KV slot). Two kinds:
- `SchedulerStream`: the continuous engine's `ContinuousScheduler` (`trinity.rollout.continuous.open_engine`),
  the way partial rollouts drive it: a request is a row added between decode steps; its draws are keyed by
  (episode, turn, token index) (`Sampler(keyed=True)` on CPU, the fused sampler on CUDA), so a row's tokens
  do not depend on which other rows share its steps; output rows are reused once their result is read.
  A turn's KV slot stays parked when it ends (`trinity.rollout.slot_table`), and the episode's next turn,
  whose prompt is the conversation so far, takes it again and prefills only the tokens past the longest
  prefix the two share (the new user, tool or environment message and the assistant header); the slot
  holds the last turn's prompt and its answer but the answer's last token (never fed back). Parked slots
  go back to the free ones, the longest parked first, when new rows need room;
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

    def __init__(self, sched: ContinuousScheduler, max_new: int, eos: Sequence[int], *, reuse: bool = True) -> None:
        self.sched, self.max_new, self.eos, self.reuse = sched, max_new, set(eos), reuse
        self.free = list(range(sched.rows))
        self.ticket_of: dict[int, Ticket] = {}  # row -> ticket
        self.row_of: dict[Ticket, int] = {}
        self.request_of: dict[int, TokenRequest] = {}  # row -> its request
        self.dropped: set[int] = set()  # rows whose request was cancelled
        # episode -> (the ticket its last turn's slot is parked under, the tokens that slot holds)
        self.parked: dict[int, tuple[Ticket, tuple[int, ...]]] = {}

    @property
    def live(self) -> int:
        return len(self.ticket_of)

    @property
    def room(self) -> int:
        return len(self.free)

    def add(self, items: Sequence[tuple[Ticket, TokenRequest]]) -> None:
        rows, keys, limits = [], [], []
        by_prompt: dict[tuple[int, ...], list[tuple[int, Ticket]]] = {}  # identical prompts share one prefill
        reused: list[Group] = []
        for ticket, req in items:
            if len(req.prompt_ids) + req.sampling.max_new_tokens > self.max_new:
                raise ValueError(f"a turn of {len(req.prompt_ids)} prompt tokens and up to {req.sampling.max_new_tokens} "
                                 f"new ones does not fit the engine's {self.max_new} tokens a row; give the backend "
                                 "context_tokens at least the sessions' Limits.context_tokens")
            r = self.free.pop(0)
            self.ticket_of[r], self.row_of[ticket], self.request_of[r] = ticket, r, req
            rows.append(r)
            keys.append(draw_name(req.episode, req.turn) * self.max_new)
            limits.append(req.sampling.max_new_tokens)
            # the episode's parked slot: its tokens up to where this prompt departs from them (one token
            # at least is computed, for the logits of the first draw)
            last = self.parked.pop(req.episode, None) if self.reuse else None
            cached = 0 if last is None else min(_common_prefix(last[1], req.prompt_ids), len(req.prompt_ids) - 1)
            if last is not None and cached > 0:
                reused.append(Group(req.prompt_ids, (r,), (ticket,), (last[0], cached)))
            else:
                if last is not None:
                    self.sched.table.release(last[0])
                by_prompt.setdefault(req.prompt_ids, []).append((r, ticket))
        self.sched.limit[rows] = self.max_new  # a reused row: `start_rows` only lowers its limit
        self.sched.start_rows(rows, keys, limits)
        self.sched.add(reused + [Group(p, tuple(r for r, _ in rt), tuple(t for _, t in rt) if self.reuse else ())
                                 for p, rt in by_prompt.items()])

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
            req = self.request_of.pop(r)
            self.free.append(r)
            if r in self.dropped:
                self.dropped.discard(r)
                self.sched.table.release(ticket)
                continue
            del self.row_of[ticket]
            n = int(self.sched.out_len[r])
            ids = tuple(self.sched.out_tokens[r, :n].tolist())
            logp = tuple(float(x) for x in self.sched.pipe.from_last(self.sched.out_logp[r, :n].contiguous()).tolist())
            out.append((ticket, TokenResult(ids, logp, "stop" if ids and ids[-1] in self.eos else "length")))
            before = self.parked.pop(req.episode, None)
            if before is not None:  # an older turn's slot of the episode: this one's is newer
                self.sched.table.release(before[0])
            if ids and self.reuse:  # the slot holds the prompt and the answer but its last token (never fed back)
                self.parked[req.episode] = (ticket, req.prompt_ids + ids[:-1])
            else:
                self.sched.table.release(ticket)
        self.free.sort()
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
