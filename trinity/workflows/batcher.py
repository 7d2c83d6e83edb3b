"""Many sessions' turns in one running batch: each new turn joins the batch at the engine's next step, and
each turn's answer goes back the moment its own row ends.

Every episode is an asyncio task in one event loop; `Session.chat` hands its request to
`RunningBatcher.generate` and awaits the result. The engine runs on one worker thread of the batcher's own
(CUDA graphs are captured and replayed on one thread; the backend sets its device there), which loops:
take the requests that arrived (a thread-safe inbox), add them to the open `TurnStream`
(`trinity.workflows.stream`: rows of the continuous engine's scheduler, or one call per step of a backend
that cannot stream), run one step, hand each ended row's `TokenResult` to its future
(`loop.call_soon_threadsafe`), and block (no spin) while nothing is live.

Deterministic steps. Before a step the engine waits for the episodes it has just answered (and, at the
start, for every episode) to send their next turn or end, each for at most `window_s` after its answer:
a step then holds the same turns whatever the timing of the episodes' own Python, tools or environment
within that window, and the turns added in one step go in a canonical order (by episode, then turn).
With each turn's draws keyed by (episode, turn, token index), the conversations do not depend on which
episode came back first. An episode that takes longer is not waited for: the batch goes on and its turn
joins when it comes.

Sampling settings. An open engine samples with one temperature, top-p, top-k and stop ids (each turn's
own `max_new_tokens` is its row's limit). While a turn with another setting waits, no new turn joins; once
the running batch has drained, the engine reopens with the setting of the oldest waiting turn and takes
every waiting turn of that setting.

A turn whose `asyncio.wait_for` runs out is cancelled: its row ends at the next step (its KV slot freed)
and its result is dropped. An engine that raises ends every waiting turn with `EngineError`, which the
runner never scores away. `close()` returns once the worker has left the engine (idle, its pool freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from trinity.rollout.types import SamplingParams
from trinity.workflows.stream import Batched, StreamBackend, Ticket, TurnStream
from trinity.workflows.types import TokenRequest, TokenResult


class EngineError(RuntimeError):
    """The chat backend failed: not an episode's fault, so no error policy turns it into a score."""


@dataclass(frozen=True)
class _Pending:
    ticket: Ticket
    request: TokenRequest
    future: asyncio.Future[TokenResult]
    loop: asyncio.AbstractEventLoop


def _setting(params: SamplingParams) -> SamplingParams:
    """What one open engine shares: everything but the token limit."""
    return dataclasses.replace(params, max_new_tokens=1)


def _settle(future: asyncio.Future[TokenResult], result: TokenResult | BaseException) -> None:
    if future.done():  # cancelled: a timed-out turn
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass
class BatchStats:
    """What the running batch did: `turns`, the turns added; `joined`, those added while other turns were
    decoding; `steps`, the engine steps; `live_row_steps`, the sum over steps of the turns in them;
    `engines`, the engines opened (one per sampling setting in a row)."""

    turns: int = 0
    joined: int = 0
    steps: int = 0
    live_row_steps: int = 0
    engines: int = 0

    @property
    def live_rows_mean(self) -> float:
        return self.live_row_steps / max(self.steps, 1)


class RunningBatcher:
    """The running batch of `episodes` episodes (numbered 0 .. episodes - 1, `TokenRequest.episode`) over
    `backend` (module doc)."""

    def __init__(self, backend: StreamBackend, *, episodes: int, window_s: float = 0.01) -> None:
        self.backend, self.window_s, self.rows = backend, window_s, max(1, episodes)
        self.stats = BatchStats()
        self._cond = threading.Condition()
        start = time.monotonic() + window_s
        self._out: dict[int, float] = {e: start for e in range(episodes)}  # episode -> waited for until
        self._inbox: list[_Pending] = []
        self._cancels: list[Ticket] = []
        self._flight: dict[Ticket, _Pending] = {}  # added to the stream (the worker's)
        self._held: list[_Pending] = []  # taken from the inbox, not yet added (the worker's)
        self._closed = False
        self._error: EngineError | None = None
        self._next = 0
        self._thread = threading.Thread(target=self._work, name="trinity-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side -------------------------------------------------------------------
    async def generate(self, request: TokenRequest) -> TokenResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TokenResult] = loop.create_future()
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise RuntimeError("the batcher is closed")
            ticket = self._next
            self._next += 1
            self._out.pop(request.episode, None)
            self._inbox.append(_Pending(ticket, request, future, loop))
            self._cond.notify()
        try:
            return await future
        except asyncio.CancelledError:  # a turn timeout: its row ends and frees its slot
            with self._cond:
                self._cancels.append(ticket)
                self._cond.notify()
            raise

    def leave(self, episode: int) -> None:
        """The episode ended: not waited for any more."""
        with self._cond:
            self._out.pop(episode, None)
            self._cond.notify()

    def close(self) -> None:
        """Stop the worker after its current step; on return the engine is idle and no thread is left."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    # ---- the worker ------------------------------------------------------------------------------
    def _barrier(self) -> float:
        """Seconds until no answered episode is waited for any more (0: step now)."""
        now = time.monotonic()
        return max([t - now for t in self._out.values()] + [0.0])

    def _work(self) -> None:
        try:
            with torch.no_grad(), ExitStack() as engine:  # grad mode is per thread
                self._run(engine)
        except BaseException as e:  # every waiting turn gets the engine's error
            name = type(self.backend.backend if isinstance(self.backend, Batched) else self.backend).__name__
            error = EngineError(f"the chat backend {name} failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            with self._cond:
                self._error = error
                waiting = list(self._flight.values()) + self._held + self._inbox
                self._inbox = []
            for p in waiting:
                self._deliver(p, error)

    def _deliver(self, p: _Pending, result: TokenResult | BaseException) -> None:
        try:
            p.loop.call_soon_threadsafe(_settle, p.future, result)
        except RuntimeError:  # the loop has closed: nobody waits
            pass

    def _run(self, engine: ExitStack) -> None:
        stream: TurnStream | None = None
        setting: SamplingParams | None = None
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    busy = stream is not None and stream.live > 0
                    if not (self._inbox or self._held or busy):
                        self._cond.wait()
                        continue
                    wait = self._barrier()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                new, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            self._held += sorted(new, key=lambda p: (p.request.episode, p.request.turn))
            for ticket in cancels:
                if self._flight.pop(ticket, None) is not None and stream is not None:
                    stream.cancel(ticket)
                self._held = [p for p in self._held if p.ticket != ticket]
            drained = stream is None or stream.live == 0
            if self._held and drained and _setting(self._held[0].request.sampling) != setting:
                engine.close()  # the previous setting's engine
                setting = _setting(self._held[0].request.sampling)  # the oldest waiting turn's
                stream = engine.enter_context(self.backend.open(setting, self.rows))
                self.stats.engines += 1
            assert stream is not None
            # new turns join while no turn of another setting waits (that one runs once the batch drains)
            batch: list[_Pending] = []
            if drained or all(_setting(p.request.sampling) == setting for p in self._held):
                for p in list(self._held):
                    if _setting(p.request.sampling) == setting and len(batch) < stream.room:
                        batch.append(p)
                        self._held.remove(p)
            if batch:
                self.stats.turns += len(batch)
                self.stats.joined += len(batch) if stream.live else 0
                stream.add([(p.ticket, p.request) for p in batch])
                self._flight.update((p.ticket, p) for p in batch)
            if not stream.live:
                continue
            self.stats.steps += 1
            self.stats.live_row_steps += stream.live
            ended = [(self._flight.pop(t, None), result) for t, result in stream.step()]
            answered = [(p, result) for p, result in ended if p is not None]
            if answered:
                with self._cond:  # waited for until they send their next turn (or the window ends)
                    until = time.monotonic() + self.window_s
                    for p, _ in answered:
                        self._out[p.request.episode] = until
                for p, result in answered:
                    self._deliver(p, result)
