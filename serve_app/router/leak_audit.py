"""The leak audit: does any engine hold what no request needs any more?

After every stats poll the router compares, per engine, what it believes is in flight there (its
own leases) with what the engine itself reports: requests in flight, and KV in use. Two
discrepancies count:

* **requests**: the engine holds more requests than the router has leases on it. Only this
  router's leases are known here, so this is judged only when it is the app's sole router
  replica (``sole_router``); with several, each engine also serves the others.
* **KV tokens**: the engine holds KV while it has no request in flight (vLLM's usage counts
  prefix-cached blocks as free, so an idle engine reads 0). This holds whatever the number of
  routers.

Both are exported as gauges at every poll. A discrepancy is normal for a moment (an aborted
request is freed a step later, stats lag by up to a poll); it is a leak when it never returns to
zero for ``warn_after_s``: then one warning is logged, naming the engine and what it holds, and
the audit re-arms once the discrepancy is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.wire.protocol import EngineStats

logger = logging.getLogger("pd_serve.router")


@dataclass(frozen=True)
class Discrepancy:
    requests: int  # requests the engine holds beyond the router's leases (0 when not judged)
    kv_tokens: int  # KV tokens held with no request in flight

    @property
    def any(self) -> bool:
        return self.requests > 0 or self.kv_tokens > 0


def discrepancy(router_inflight: int, stats: EngineStats, sole_router: bool) -> Discrepancy:
    requests = max(0, stats.inflight - router_inflight) if sole_router else 0
    kv_tokens = stats.kv_used_tokens if stats.inflight == 0 else 0
    return Discrepancy(requests=requests, kv_tokens=kv_tokens)


class LeakAudit:
    def __init__(
        self,
        warn_after_s: float,
        sole_router: bool,
        report: Callable[[str, Discrepancy], None] = lambda name, found: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.warn_after_s = warn_after_s
        self.sole_router = sole_router
        self.report = report  # exports the gauges
        self.clock = clock
        self._since: dict[str, float] = {}  # engine -> when its discrepancy started
        self._warned: set[str] = set()

    def forget(self, name: str) -> None:
        """An engine left the pool: its gauges at zero (a departed engine's last discrepancy would
        otherwise show on the dashboard for good) and nothing kept of it."""
        self._since.pop(name, None)
        self._warned.discard(name)
        self.report(name, Discrepancy(requests=0, kv_tokens=0))

    def check(self, name: str, router_inflight: int, stats: EngineStats) -> Discrepancy:
        found = discrepancy(router_inflight, stats, self.sole_router)
        self.report(name, found)
        now = self.clock()
        if not found.any:
            self._since.pop(name, None)
            self._warned.discard(name)
            return found
        since = self._since.setdefault(name, now)
        if now - since >= self.warn_after_s and name not in self._warned:
            self._warned.add(name)
            logger.warning(
                "leak audit: engine %s has held %d request(s) no router holds and %d KV token(s) with no request in flight "
                "for %.0fs (%d in flight there, %d by this router)",
                name,
                found.requests,
                found.kv_tokens,
                now - since,
                stats.inflight,
                router_inflight,
                extra={"pd_engine": name, "pd_leak_requests": found.requests, "pd_leak_kv_tokens": found.kv_tokens},
            )
        return found
