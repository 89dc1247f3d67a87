"""What the prefill and decode deployments share: one engine, its stats, health and gauges."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from serve_app.cpu_placement import keep_off_engine_cores
from serve_app.engines.backends import BACKENDS, EngineSpec, prepare_engine_environment
from serve_app.engines.call_server import EngineCallServer
from serve_app.engines.kv_endpoint import settle_kv_endpoint, side_channel_host
from serve_app.engines.pacing import StreamPacer
from serve_app.gc_heap import freeze_startup_heap
from serve_app.logs import quiet_cancelled_requests, serve_log_file_kept, to_serve_logs
from serve_app.metrics import engine_metrics
from serve_app.protocol import EngineStats, KVEndpoint

logger = logging.getLogger("pd_serve.engine")

GAUGE_INTERVAL_S = 1.0


def make_runner(spec: EngineSpec, engine_kwargs: dict[str, Any], endpoint: KVEndpoint | None) -> Any:
    """The engine behind a replica: vLLM's AsyncLLM, or the mock engine (``backend: mock``)."""
    pacer = StreamPacer(spec.stream_items_per_s)
    if spec.backend == "mock":
        from serve_app.engines.mock import MockCosts, MockEngine

        mock = engine_kwargs["mock"]
        costs = MockCosts(**mock["costs"], recv_timeout_s=float(mock.get("recv_timeout_s", 60.0)))
        return MockEngine(spec.name, spec.role, costs, endpoint, recompute=bool(mock.get("recompute", True)), pacer=pacer)
    from serve_app.engines.engine import EngineRunner

    return EngineRunner(spec.name, spec.role, engine_kwargs, pacer)


class EngineServer:
    """Base of ``Prefill`` and ``Decode``: a Serve replica that owns exactly one engine."""

    async def __init__(self, spec: EngineSpec) -> None:
        to_serve_logs()
        quiet_cancelled_requests()
        self.spec = spec
        backend = BACKENDS[spec.backend]
        prepare_engine_environment(backend, os.environ, spec.notes)
        listens = spec.role == "decode" or backend.prefill_listens
        engine_kwargs, self.kv_endpoint = settle_kv_endpoint(
            spec.engine_kwargs, listens=listens, fallback=backend.kv_port_fallback, pass_host=backend.connector_reads_kv_host
        )
        self.runner = make_runner(spec, engine_kwargs, self.kv_endpoint)
        # AsyncLLM binds its sockets to this event loop, so it is built here, not in a thread.
        with serve_log_file_kept():
            await self.runner.start()
        # Only after the engine's processes have started: they would inherit this placement.
        keep_off_engine_cores(set(spec.engines_cores), f"engine replica {spec.name}")
        self._tags = {"role": spec.role, "engine": spec.name}
        self._metrics = engine_metrics()
        self._gauge_task = asyncio.get_running_loop().create_task(self._report_gauges())
        # Last: the router learns of it from the stats, and then its calls may come at once.
        self.call_server = EngineCallServer(side_channel_host(), self) if spec.call_server else None
        freeze_startup_heap(f"engine replica {spec.name}")

    async def _report_gauges(self) -> None:
        while True:
            stats = self.runner.stats()
            self._metrics.inflight.set(stats.inflight, tags=self._tags)
            self._metrics.kv_usage.set(stats.kv_usage, tags=self._tags)
            await asyncio.sleep(GAUGE_INTERVAL_S)

    async def stats(self) -> EngineStats:
        stats = self.runner.stats()
        stats.kv_endpoint = self.kv_endpoint
        stats.call_endpoint = self.call_server.endpoint if self.call_server is not None else None
        return stats

    async def abort(self, request_id: str) -> None:
        await self.runner.abort(request_id)

    async def inspect(self, request_ids: list[str] | None = None) -> dict[str, Any]:
        """What this engine did with recent requests (by attempt id): its own record (prompt
        tokens it did not compute, outcome) and its KV connector's transfer record."""
        requests = self.runner.requests
        transfers = self.runner.transfers()
        ids = request_ids if request_ids is not None else list(requests)
        return {
            "engine": self.spec.name,
            "pid": os.getpid(),
            "requests": {i: requests.get(i) for i in ids},
            "transfers": {i: transfers.get(i) for i in ids},
        }

    async def check_health(self) -> None:
        """Serve's health check: a dead engine core restarts the replica."""
        await self.runner.check_health()

    def __del__(self) -> None:
        task = getattr(self, "_gauge_task", None)
        if task is not None:
            task.cancel()
        call_server = getattr(self, "call_server", None)
        if call_server is not None:
            call_server.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
