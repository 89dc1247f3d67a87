"""The router's engines: their handles, its own load counters on them, and their health.

Counters are changed only through ``lease`` (a context manager), so every path out of an attempt
(success, error, retry, timeout, client disconnect) gives back exactly what it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from serve_app.protocol import EngineCallEndpoint, EngineRequest, EngineStats, KVEndpoint, Role
from serve_app.router.balancer import EngineLoad, ScoreFn, decode_score, prefill_score, select
from serve_app.router.engine_client import EngineClient
from serve_app.router.leak_audit import LeakAudit

logger = logging.getLogger("pd_serve.router")

SCORES: dict[Role, ScoreFn] = {"decode": decode_score, "prefill": prefill_score}


class EnginePool:
    def __init__(
        self,
        engines: dict[str, tuple[Role, Any]],
        stats_timeout_s: float = 2.0,
        audit: LeakAudit | None = None,
        client: EngineClient | None = None,
    ) -> None:
        self.handles: dict[str, Any] = {name: handle for name, (_, handle) in engines.items()}
        # Streaming variants, made once: every attempt opens a stream on one of them.
        self.stream_handles: dict[str, Any] = {name: handle.options(stream=True) for name, handle in self.handles.items()}
        self.loads: dict[str, EngineLoad] = {name: EngineLoad(name=name, role=role) for name, (role, _) in engines.items()}
        self.stats_timeout_s = stats_timeout_s
        self.reported: dict[str, EngineStats] = {}
        self.audit = audit
        self._turn = itertools.count()
        # router.engine_transport: http; calls then go to an engine's own endpoint once its stats
        # have named one, through its Serve handle before.
        self.client = client

    def open_stream(self, name: str, request: EngineRequest) -> Any:
        """Start a decode attempt's stream: ``__anext__`` for its events, ``cancel`` to end it."""
        endpoint = self._call_endpoint(name)
        if self.client is not None and endpoint is not None:
            return self.client.stream(endpoint, request)
        return self.stream_handles[name].generate.remote(request)

    def start_prefill(self, name: str, request: EngineRequest) -> Any:
        """Start a prefill call: await it for its ``PrefillResult``, ``cancel`` to abort it."""
        endpoint = self._call_endpoint(name)
        if self.client is not None and endpoint is not None:
            return self.client.call(endpoint, request)
        return self.handles[name].run.remote(request)

    def _call_endpoint(self, name: str) -> EngineCallEndpoint | None:
        reported = self.reported.get(name)
        return reported.call_endpoint if reported is not None else None

    def of_role(self, role: Role) -> list[EngineLoad]:
        return [load for load in self.loads.values() if load.role == role]

    def has_healthy(self, role: Role) -> bool:
        return any(load.healthy for load in self.of_role(role))

    def pick(self, role: Role, avoid: frozenset[str] = frozenset()) -> EngineLoad | None:
        return select(self.of_role(role), SCORES[role], turn=next(self._turn), avoid=avoid)

    @contextmanager
    def lease(self, name: str, tokens: int) -> Iterator[EngineLoad]:
        load = self.loads[name]
        load.reserved_tokens += tokens
        load.inflight += 1
        try:
            yield load
        finally:
            load.reserved_tokens -= tokens
            load.inflight -= 1

    def kv_endpoint(self, name: str) -> KVEndpoint | None:
        """Where the engine last said its KV side channel is."""
        reported = self.reported.get(name)
        return reported.kv_endpoint if reported is not None else None

    def mark_unhealthy(self, name: str) -> None:
        """Stop choosing an engine that just failed a call, until its stats answer again."""
        self.loads[name].healthy = False

    async def refresh(self) -> None:
        names = list(self.handles)
        results = await asyncio.gather(*(self._stats(name) for name in names), return_exceptions=True)
        for name, result in zip(names, results):
            load = self.loads[name]
            if isinstance(result, BaseException):
                if load.healthy:
                    logger.warning("engine %s unreachable: %r", name, result)
                load.healthy = False
                continue
            self.reported[name] = result
            load.healthy = result.healthy
            load.kv_used_tokens = result.kv_used_tokens
            load.kv_capacity_tokens = result.kv_capacity_tokens
            load.num_waiting = result.num_waiting
            if self.audit is not None:
                self.audit.check(name, load.inflight, result)

    async def _stats(self, name: str) -> EngineStats:
        return await asyncio.wait_for(self.handles[name].stats.remote(), self.stats_timeout_s)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let the poller die; the next round tries again
                logger.exception("engine stats poll failed")
            await asyncio.sleep(interval_s)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The router's counters and each engine's last report, for tests and operators."""
        out: dict[str, dict[str, Any]] = {}
        for name, load in self.loads.items():
            reported = self.reported.get(name)
            out[name] = {
                "role": load.role,
                "healthy": load.healthy,
                "router_inflight": load.inflight,
                "router_reserved_tokens": load.reserved_tokens,
                "engine_inflight": reported.inflight if reported else None,
                "engine_running": reported.num_running if reported else None,
                "engine_waiting": reported.num_waiting if reported else None,
                "kv_usage": reported.kv_usage if reported else None,
                "kv_capacity_tokens": reported.kv_capacity_tokens if reported else None,
                "kv_endpoint": dataclasses.asdict(reported.kv_endpoint) if reported and reported.kv_endpoint else None,
                # Its URL only: the token stays between the engine and the routers.
                "call_endpoint": reported.call_endpoint.url if reported and reported.call_endpoint else None,
                "extra": reported.extra if reported else {},
            }
        return out
