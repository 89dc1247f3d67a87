"""How often an engine replica sends a stream's next item.

Every item a replica streams through a Serve handle costs a fixed amount of CPU on both ends
(Ray's object and actor-call machinery), whatever it carries, and on a small host that cost, not
pd-serve's or vLLM's own work, decides throughput. So a replica spaces out its streams' items to
keep their sum under a budget (``items_per_s``): a lone stream sends each delta the moment it is
ready (no added latency at low load), and n concurrent streams each send at most every
``(n - 1) / items_per_s`` seconds, while the engine merges the steps in between into the next
delta. The first delta of a stream (its first token) is never held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_ITEMS_PER_S = 400.0


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
