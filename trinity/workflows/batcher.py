"""Many sessions' next turns gathered into one engine call per wave.

Every live episode is an asyncio task in one event loop; `Session.chat` hands its request to the batcher and
awaits the result. A wave starts when every live episode waits on the engine (none can add a request any
more), or `window_s` after the first waiting request (an episode busy with a tool or its environment does
not hold the others back longer than that). The engine runs in a worker thread, so that timeouts, tools and
new requests keep going meanwhile; requests that arrive during a wave wait for the next one. The worker is
one thread of the batcher's own for all its waves (CUDA graphs are captured and replayed on one thread;
the backend sets its device there). An engine that raises ends every waiting turn with `EngineError`,
which the runner never scores away.

This is waves, not a running batch: a turn waits for its wave's longest response before the next wave
starts. A request joining the running batch (no turn waiting for the whole wave) comes with the rollout
scheduler, behind the same `generate(request)` coroutine.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from trinity.workflows.types import ChatBackend, TokenRequest, TokenResult


class EngineError(RuntimeError):
    """The chat backend failed: not an episode's fault, so no error policy turns it into a score."""


class WaveBatcher:
    def __init__(self, backend: ChatBackend, *, window_s: float = 0.01) -> None:
        self.backend = backend
        self.window_s = window_s
        self.wave_sizes: list[int] = []  # requests per engine call made so far
        self._pending: list[tuple[TokenRequest, asyncio.Future[TokenResult]]] = []
        self._live = 0
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="trinity-engine")

    def close(self) -> None:
        """Wait for a wave still running (a timed-out turn's), so that the engine is idle on return."""
        self._worker.shutdown(wait=True)

    def join(self) -> None:
        """An episode starts (it counts towards "every live episode waits")."""
        self._live += 1

    def leave(self) -> None:
        self._live -= 1
        asyncio.get_running_loop().call_soon(self._start_if_all_wait)

    async def generate(self, request: TokenRequest) -> TokenResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TokenResult] = loop.create_future()
        self._pending.append((request, future))
        # checked once the episodes that are ready this loop iteration (e.g. all those just started, or just
        # given their results) have run up to their next request
        loop.call_soon(self._start_if_all_wait)
        if self._timer is None and not self._busy:
            self._timer = loop.call_later(self.window_s, self._start)
        return await future

    def _start_if_all_wait(self) -> bool:
        waiting = sum(not f.done() for _, f in self._pending)
        if not self._busy and waiting and waiting >= self._live:
            self._start()
            return True
        return False

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch = [(r, f) for r, f in self._pending if not f.done()]  # a timed-out turn's future is cancelled
        self._pending = []
        if self._busy or not batch:
            self._pending = batch
            return
        self._busy = True
        asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[TokenRequest, asyncio.Future[TokenResult]]]) -> None:
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._worker, self.backend.generate, [r for r, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"returned {len(results)} results for {len(batch)} requests")
        except Exception as e:  # every waiting turn gets the engine's error
            error = EngineError(f"the chat backend {type(self.backend).__name__} failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            for _, f in batch:
                if not f.done():
                    f.set_exception(error)
        else:
            for (_, f), result in zip(batch, results):
                if not f.done():
                    f.set_result(result)
        finally:
            self.wave_sizes.append(len(batch))
            self._busy = False
        if self._pending and not self._start_if_all_wait():
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._start)
