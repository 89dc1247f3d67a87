"""How often an engine replica sends a stream's next item.

Every item a replica streams costs a fixed amount of CPU on both ends, whatever it carries (a
frame written and read over the engine's HTTP endpoint, or Ray's object and actor-call machinery
through a Serve handle), and on a small host that cost, not pd-serve's or vLLM's own work,
decides throughput. So a replica spaces out its streams' items to keep their sum under a budget
(``items_per_s``): a lone stream sends each delta the moment it is ready (no added latency at low
load), and n streams under way (counted from their first output: a request still queued or
waiting for its KV sends nothing) each send at most every ``(n - 1) / items_per_s`` seconds, while
the engine merges the steps in between into the next delta. The first delta of a stream (its
first token) is never held, nor is its last: a stream waits through ``FinishSignal.hold``, which
ends the moment its request finishes in the engine, since holding the last delta would keep the
client's request open for nothing (and, at a fixed number of clients, the next one from
starting) for half an interval on average.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from serve_app.config.settings import DEFAULT_ITEMS_PER_S


class StreamPacer:
    def __init__(self, items_per_s: float = DEFAULT_ITEMS_PER_S) -> None:
        self.items_per_s = items_per_s
        self.active = 0

    @contextmanager
    def stream(self) -> Iterator[Pace]:
        self.active += 1
        try:
            yield Pace(self)
        finally:
            self.active -= 1

    def interval(self) -> float:
        """The least time between two items of one stream, with this many streams active."""
        return max(0, self.active - 1) / self.items_per_s if self.items_per_s > 0 else 0.0  # 0: no pacing


class Pace:
    """One stream's clock."""

    def __init__(self, pacer: StreamPacer) -> None:
        self._pacer = pacer
        self._last = 0.0

    def sent(self) -> None:
        self._last = time.monotonic()

    def wait_s(self) -> float:
        """How long to let the engine accumulate before taking the next delta."""
        return max(0.0, self._last + self._pacer.interval() - time.monotonic())


class FinishSignal:
    """Set by the engine's output path when the stream's request finishes, so the stream's
    pacing wait ends then and the last delta goes out at once."""

    __slots__ = ("finished", "_waiter")

    def __init__(self) -> None:
        self.finished = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self.finished = True
        if self._waiter is not None:
            _resolve(self._waiter)

    async def hold(self, seconds: float) -> None:
        """Wait up to ``seconds`` (the engine merges its steps meanwhile), less if the request
        finishes. One future and one timer, as ``asyncio.sleep`` takes."""
        if seconds <= 0 or self.finished:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
