"""What the prefill and decode deployments share: one engine, its stats, health and gauges, how
it describes itself to the routers and reports its load to Serve's autoscaler, and its drain.

Each role is one Serve deployment; each of its replicas owns one engine, named ``<role>-<rank>``
after the rank Serve gives the replica. Calls that name a replica (``replica=<id>``, pinned by
router/replica_router.py) are checked to have reached it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from serve_app.config import autoscaling
from serve_app.config.backends import BACKENDS, EngineSpec, PoolSpec, prepare_engine_environment
from serve_app.engines.call_server import EngineCallServer
from serve_app.engines.kv_endpoint import settle_kv_endpoint, side_channel_host
from serve_app.engines.load_report import LatencyWindow
from serve_app.engines.pacing import StreamPacer
from serve_app.engines.runner import EngineRunner
from serve_app.runtime.cpu_placement import keep_off_engine_cores
from serve_app.runtime.gc_heap import collection_paused, freeze_startup_heap
from serve_app.runtime.logs import quiet_cancelled_requests, serve_log_file_kept, to_serve_logs
from serve_app.runtime.metrics import engine_metrics
from serve_app.runtime.slots import Slot, claim_slot
from serve_app.wire.protocol import EngineStats, KVEndpoint

logger = logging.getLogger("pd_serve.engine")

GAUGE_INTERVAL_S = 1.0
# How often a stopping replica checks whether its requests are gone.
DRAIN_POLL_S = 0.05
# A stopping replica stops once no call has come for this long and none is in progress: Serve
# tells the routers that it is stopping only when it has stopped (Ray Serve 2.60), so calls keep
# coming until each router has had one answered "moved" (decode) or they stop coming.
DRAIN_QUIET_S = 1.0
# At the drain's deadline, how long the requests still held get to end once aborted.
DRAIN_ABORT_S = 1.0


def replica_identity() -> tuple[int, str]:
    """(rank, unique id) Serve gave this replica."""
    from ray import serve

    context = serve.get_replica_context()
    rank = getattr(context, "rank", 0)
    rank = getattr(rank, "rank", rank)
    return int(rank or 0), context.replica_id.unique_id


class WrongReplica(RuntimeError):
    """A call pinned to another replica reached this one."""


def make_runner(spec: EngineSpec, engine_kwargs: dict[str, Any], endpoint: KVEndpoint | None) -> EngineRunner:
    """The engine behind a replica: vLLM's AsyncLLM, or the mock engine (``backend: mock``)."""
    pacer = StreamPacer(spec.stream_items_per_s)
    if spec.backend == "mock":
        from serve_app.engines.mock_runner import MockCosts, MockEngine

        mock = engine_kwargs["mock"]
        costs = MockCosts(**mock["costs"], recv_timeout_s=float(mock.get("recv_timeout_s", 60.0)))
        return MockEngine(spec.name, spec.role, costs, endpoint, recompute=bool(mock.get("recompute", True)), pacer=pacer)
    from serve_app.engines.vllm_runner import VLLMRunner

    return VLLMRunner(spec.name, spec.role, engine_kwargs, pacer)


class EngineServer:
    """Base of ``Prefill`` and ``Decode``: a Serve replica that owns exactly one engine."""

    async def __init__(self, spec: EngineSpec | PoolSpec, drain_s: float = 0.0) -> None:
        # Start-up builds the heap the replica keeps (vLLM, torch, the engine's configuration):
        # no collection walks it while it grows, and it is frozen once built (runtime/gc_heap.py).
        with collection_paused():
            to_serve_logs()
            quiet_cancelled_requests()
            self.replica_id: str | None = None
            self.slot: Slot | None = None
            if isinstance(spec, PoolSpec):
                rank, self.replica_id = replica_identity()
                # Its KV port block: the first from its rank's that no live engine of its pool on
                # this node holds (runtime/slots.py: Serve renumbers live replicas' ranks).
                self.slot = claim_slot(spec.slot_group, rank)
                if self.slot.number != rank:
                    logger.info(
                        "%s-%d: a live engine on this node holds that rank's KV port block: this one takes block %d",
                        spec.role,
                        rank,
                        self.slot.number,
                    )
                beyond = spec.beyond_args(self.slot.number)
                if beyond:
                    logger.warning("pd-serve config: %s", beyond)
                spec = spec.for_rank(rank, self.replica_id, port_slot=self.slot.number)
                # This rank's own thread binding: the deployment's runtime_env holds rank 0's.
                os.environ.update(spec.env)
            self.spec = spec
            self.drain_s = drain_s
            self.draining = False
            self.calls_started = 0.0  # when the last engine call arrived
            self._stopped = False
            self._prompt_tokens = 0  # prefill: prompt tokens of the calls in progress
            self.epoch = uuid.uuid4().hex  # this engine's start: its prefix cache begins empty
            self.prompt_tokens_total = 0
            self.prefix_hit_tokens_total = 0
            self.kv_bytes_pushed_total = 0
            self.latency = LatencyWindow(autoscaling.LATENCY_WINDOW_S)  # prefill: TTFT share; decode: ITL
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
            # Last: the router learns of it from the replica's metadata or its stats, and then its
            # calls may come at once.
            self.call_server = EngineCallServer(side_channel_host(), self) if spec.call_server else None
        freeze_startup_heap(f"engine replica {self.spec.name}")

    async def _report_gauges(self) -> None:
        while True:
            stats = self.runner.stats()
            self._metrics.inflight.set(stats.inflight, tags=self._tags)
            self._metrics.kv_usage.set(stats.kv_usage, tags=self._tags)
            await asyncio.sleep(GAUGE_INTERVAL_S)

    def pinned(self, replica: str | None) -> None:
        """Refuse a call pinned to another replica: a routing bug must not go unnoticed."""
        if replica is not None and self.replica_id is not None and replica != self.replica_id:
            raise WrongReplica(f"a call for replica {replica} reached {self.replica_id}")

    def record_replica_metadata(self) -> dict[str, Any]:
        """What every router learns of this replica with Serve's list of running replicas
        (router/membership.py): enough to call it at once, without a poll."""
        call = self.call_server.endpoint if self.call_server is not None else None
        kv = self.kv_endpoint
        return {
            "role": self.spec.role,
            "name": self.spec.name,
            "call_endpoint": {"url": call.url, "token": call.token} if call else None,
            "kv_endpoint": {"engine_id": kv.engine_id, "host": kv.host, "port": kv.port} if kv else None,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This engine's load, as Serve custom autoscaling metrics (serve_app/config/autoscaling.py).
        On the replica's event loop, where the latencies are recorded (Serve would run a plain
        method in a thread)."""
        stats = self.runner.stats()
        metrics = {
            autoscaling.RUNNING: float(stats.num_running),
            autoscaling.WAITING: float(stats.num_waiting),
            autoscaling.KV_USAGE: float(stats.kv_usage),
        }
        if self.spec.role == "prefill":
            metrics[autoscaling.PROMPT_TOKENS] = float(self._prompt_tokens)
        p90 = self.latency.p90(time.monotonic())
        metrics[autoscaling.TTFT_P90 if self.spec.role == "prefill" else autoscaling.ITL_P90] = p90
        return metrics

    async def stats(self, replica: str | None = None) -> EngineStats:
        self.pinned(replica)
        stats = self.runner.stats()
        stats.kv_endpoint = self.kv_endpoint
        stats.call_endpoint = self.call_server.endpoint if self.call_server is not None else None
        stats.epoch = self.epoch
        stats.prompt_tokens_total = self.prompt_tokens_total
        stats.prefix_hit_tokens_total = self.prefix_hit_tokens_total
        stats.kv_bytes_pushed_total = self.kv_bytes_pushed_total
        stats.queued_prompt_tokens = self._prompt_tokens
        return stats

    def count_prompt(self, prompt_tokens: int, hit_tokens: int | None) -> None:
        """A request's prompt, and how much of it this engine's prefix cache held."""
        hits = max(0, min(prompt_tokens, hit_tokens or 0))
        self.prompt_tokens_total += prompt_tokens
        self.prefix_hit_tokens_total += hits
        if prompt_tokens > 0:  # a Ray counter takes positive increments only
            self._metrics.prompt_tokens.inc(prompt_tokens, tags=self._tags)
        if hits > 0:
            self._metrics.prefix_hits.inc(hits, tags=self._tags)

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        self.pinned(replica)
        await self.runner.abort(request_id)

    async def inspect(self, request_ids: list[str] | None = None, replica: str | None = None) -> dict[str, Any]:
        """What this engine did with recent requests (by attempt id): its own record (prompt
        tokens it did not compute, outcome) and its KV connector's transfer record."""
        requests = self.runner.requests
        transfers = self.runner.transfers()
        ids = request_ids if request_ids is not None else list(requests)
        self.pinned(replica)
        return {
            "engine": self.spec.name,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "requests": {i: requests.get(i) for i in ids},
            "transfers": {i: transfers.get(i) for i in ids},
        }

    async def check_health(self) -> None:
        """Serve's health check: a dead engine core restarts the replica, and so does a dead
        call endpoint or metaserver relay (every call, or every disaggregated attempt's KV
        parameters, would fail while the engine itself looked healthy)."""
        await self.runner.check_health()
        if self.draining:
            return  # they close as the replica stops
        for what, server in (("call endpoint", self.call_server), ("metaserver relay", getattr(self, "relay", None))):
            if server is not None and not server.serving:
                raise RuntimeError(f"{self.spec.name}: its {what} stopped serving")

    def __del__(self) -> Any:
        """Serve calls this when it stops the replica, and awaits what this returns: the drain.
        From here a decode replica ends each stream at its next output with stop_reason
        ``moved`` (and answers new calls so at once), and the router resumes those requests on
        another decode engine, token for token, and stops choosing this one; a prefill replica
        finishes the pushes in progress. The engine stops once it holds no request and no call
        has come for ``DRAIN_QUIET_S``, or after ``drain_s``. (The routers also move streams off
        a replica as soon as Serve's list of running replicas drops it: router/pool.py.) Outside
        a running loop (the process ending) it stops at once."""
        if getattr(self, "_stopped", True) or getattr(self, "runner", None) is None:
            self._stop_now()  # never fully started (or stopped already): nothing to wait for
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._stop_now()
            return None
        return self._drain_then_stop()

    async def _drain_then_stop(self) -> None:
        self.draining = True
        started = time.monotonic()
        deadline = started + self.drain_s
        runner = self.runner
        while time.monotonic() < deadline:
            quiet = time.monotonic() - max(self.calls_started, started) >= DRAIN_QUIET_S
            if quiet and runner.stats().inflight == 0:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        held = runner.held()
        logger.info(
            "engine %s drained in %.1fs%s",
            self.spec.name,
            time.monotonic() - started,
            f"; {len(held)} requests still held are aborted" if held else "",
        )
        if held:
            # Aborted while the engine runs, so each stream ends with its last output ("moved"
            # on decode, which the router resumes elsewhere): stopping the engine under them
            # would leave them waiting for output until the process is killed.
            for request_id in held:
                await runner.abort(request_id)
            end = time.monotonic() + DRAIN_ABORT_S
            while runner.stats().inflight and time.monotonic() < end:
                await asyncio.sleep(DRAIN_POLL_S)
        self._stop_now()

    def _stop_now(self) -> None:
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        task = getattr(self, "_gauge_task", None)
        if task is not None:
            task.cancel()
        call_server = getattr(self, "call_server", None)
        if call_server is not None:
            call_server.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
