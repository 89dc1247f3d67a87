"""pd-serve's Ray Serve metrics (exported by Ray with the ``ray_`` prefix).

Created lazily, once per process, because Ray metrics need a connected worker. Tags never use
``replica`` (Ray Serve reserves it and adds its own ``deployment``/``replica``/``application``
tags). Counters are declared without the ``_total`` suffix: Ray's Prometheus export adds it, so
``requests`` is scraped as ``ray_pd_requests_total``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pd_serve")

# Up to router.timeouts.request_s's default (600 s): a longer request would read as the last bound.
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
ATTEMPT_BUCKETS = [1, 2, 3, 4, 6, 8, 16, 32]
ROUTER_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]


# How often a kept gauge is set again: as often as Ray can export a process's metrics
# (metrics_report_interval_ms is floored at 1 s; 10 s by default), so every export carries it.
KEEP_INTERVAL_S = 1.0


class KeptGauges:
    """Sets the last value of every gauge series it was given again, every ``interval_s``, from
    a daemon thread (a few gauge calls a second).

    Ray (2.60, its OpenTelemetry metrics path) exports a gauge's series only while the process
    sets it: measured, a series set once left the Prometheus endpoint 20-30 s later, with Ray's
    default export interval (``metrics_report_interval_ms``, 10 s) and with 1 s alike. A gauge
    set only when its value changes (a pool's size, an idle engine's queue lengths, vLLM's config
    info) vanished so, and the dashboard's panels went blank: a steady pool or an idle engine
    looked like none. prometheus_client, vLLM's own server's exporter, keeps a gauge's
    last value; this gives Ray's gauges the same meaning.

    Only for series whose owner lives as long as the process: a series is never forgotten."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[int, frozenset[tuple[str, str]]], tuple[Any, float, dict[str, str]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failed = False

    def set(self, gauge: Any, value: float, tags: Mapping[str, str] | None = None) -> None:
        tags = dict(tags or {})
        with self._lock:  # held while setting, so a refresh never sets an older value after this one
            gauge.set(value, tags=tags)
            self._last[(id(gauge), frozenset(tags.items()))] = (gauge, value, tags)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pd-kept-gauges", daemon=True)
                self._thread.start()

    def refresh(self) -> None:
        """Set every kept series again, to its last value: one series at a time under the lock,
        so a caller's ``set`` waits for one gauge call at most."""
        with self._lock:
            keys = list(self._last)
        for key in keys:
            with self._lock:
                gauge, value, tags = self._last[key]
                try:
                    gauge.set(value, tags=tags)
                except Exception:  # Ray is shutting down: the process is ending
                    if not self._failed:
                        self._failed = True
                        logger.debug("could not set a kept gauge again", exc_info=True)

    def stop(self) -> None:
        """End the thread (a process's keeper never needs to: its thread ends with the process)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()


@functools.cache
def kept_gauges() -> KeptGauges:
    """The process's one keeper (and its one thread)."""
    return KeptGauges(KEEP_INTERVAL_S)


class KeptGauge:
    """A Ray gauge whose series keep their last value on the Prometheus endpoint (``KeptGauges``)."""

    def __init__(self, gauge: Any, keeper: KeptGauges | None = None) -> None:
        self.gauge = gauge
        self._keeper = keeper

    def set(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        (self._keeper or kept_gauges()).set(self.gauge, value, tags)


@dataclass(frozen=True)
class RouterMetrics:
    requests: Any  # pd_requests_total{route,status}
    errors: Any  # pd_errors_total{kind}
    ttft: Any  # pd_ttft_seconds{route}
    tpot: Any  # pd_tpot_seconds{route}
    kv_ready: Any  # pd_kv_ready_seconds
    prefill: Any  # pd_prefill_seconds
    recompute: Any  # pd_recompute_total
    attempts: Any  # pd_attempts_per_request
    wasted_tokens: Any  # pd_recompute_wasted_tokens_total
    fallback: Any  # pd_fallback_total{reason}: disaggregated attempts served colocated (no prefill engine, short prompt)
    router_inflight: Any  # pd_inflight{role="router",engine=<router>}
    request_time: Any  # pd_request_seconds{route}: arrival -> last byte handed to the client
    engine_wait: Any  # pd_engine_wait_seconds{route}: per request, time waiting on engines
    router_time: Any  # pd_router_seconds{route}: per request, the router's own time
    leak_requests: Any  # pd_leak_requests{engine}: requests an engine holds that no router does
    leak_kv_tokens: Any  # pd_leak_kv_tokens{engine}: KV an engine holds with no request in flight
    migrations: Any  # pd_migrations_total{cause,engine}: attempts a request resumed from elsewhere, by why they ended
    pool_replicas: Any  # pd_pool_replicas{role}: the engines of each pool this router replica can choose
    prefix_routed: Any  # pd_prefix_routed_tokens_total{role,engine}: prompt tokens the router expected the chosen engine to hold


@dataclass(frozen=True)
class EngineMetrics:
    inflight: Any  # pd_inflight{role,engine}
    kv_usage: Any  # pd_engine_kv_usage{role,engine}
    pushes: Any  # pd_kv_pushes_total{engine}: KV transfers a prefill engine delivered
    push_bytes: Any  # pd_kv_push_bytes_total{engine}: bytes of KV they carried
    push_time: Any  # pd_kv_push_seconds{engine}: first to last layer sent, per transfer
    push_failures: Any  # pd_kv_push_failures{engine}
    prompt_tokens: Any  # pd_engine_prompt_tokens_total{role,engine}: prompt tokens of the requests an engine was given
    prefix_hits: Any  # pd_prefix_hit_tokens_total{role,engine}: ... of those, what its prefix cache held


@functools.cache
def _inflight_gauge() -> Any:
    from ray.serve.metrics import Gauge

    return Gauge("pd_inflight", "requests in flight, per engine (and per router)", tag_keys=("role", "engine"))


@functools.cache
def router_metrics() -> RouterMetrics:
    from ray.serve.metrics import Counter, Gauge, Histogram

    return RouterMetrics(
        requests=Counter("pd_requests", "client requests by route and HTTP status", tag_keys=("route", "status")),
        errors=Counter("pd_errors", "errors by kind", tag_keys=("kind",)),
        ttft=Histogram("pd_ttft_seconds", "time to first token", boundaries=LATENCY_BUCKETS, tag_keys=("route",)),
        tpot=Histogram("pd_tpot_seconds", "time per output token after the first", boundaries=TPOT_BUCKETS, tag_keys=("route",)),
        kv_ready=Histogram("pd_kv_ready_seconds", "decode admit -> KVReady", boundaries=LATENCY_BUCKETS),
        prefill=Histogram("pd_prefill_seconds", "prefill call -> prefill done", boundaries=LATENCY_BUCKETS),
        recompute=Counter("pd_recompute", "attempts ended by a decode engine's recompute"),
        attempts=Histogram("pd_attempts_per_request", "attempts per finished request", boundaries=ATTEMPT_BUCKETS),
        wasted_tokens=Counter("pd_recompute_wasted_tokens", "tokens whose KV an ended attempt discarded"),
        fallback=Counter("pd_fallback", "disaggregated attempts served colocated", tag_keys=("reason",)),
        router_inflight=KeptGauge(_inflight_gauge()),  # set when it changes, not on a clock
        request_time=Histogram("pd_request_seconds", "whole client request", boundaries=LATENCY_BUCKETS, tag_keys=("route",)),
        engine_wait=Histogram(
            "pd_engine_wait_seconds", "per request: time the router waited on engines", boundaries=LATENCY_BUCKETS, tag_keys=("route",)
        ),
        router_time=Histogram(
            "pd_router_seconds",
            "per request: the router's own time (the request's time minus engine and client waits)",
            boundaries=ROUTER_BUCKETS,
            tag_keys=("route",),
        ),
        leak_requests=Gauge("pd_leak_requests", "requests an engine holds that no router holds (leak audit)", tag_keys=("engine",)),
        leak_kv_tokens=Gauge("pd_leak_kv_tokens", "KV tokens an engine holds with no request in flight (leak audit)", tag_keys=("engine",)),
        migrations=Counter(
            "pd_migrations",
            "attempts that ended with the request resuming on another attempt, by cause: kv_full (the decode engine recomputed), "
            "drain (Serve was stopping the engine, decode or prefill), failure (the attempt failed and is retried)",
            tag_keys=("cause", "engine"),
        ),
        pool_replicas=KeptGauge(  # set when the pool changes
            Gauge("pd_pool_replicas", "engines of a pool that the router can choose (running, not leaving)", tag_keys=("role",))
        ),
        prefix_routed=Counter(
            "pd_prefix_routed_tokens",
            "prompt tokens the router expected the engine it chose to hold in its prefix cache (router.balancer: prefix)",
            tag_keys=("role", "engine"),
        ),
    )


@functools.cache
def engine_metrics() -> EngineMetrics:
    from ray.serve.metrics import Counter, Gauge, Histogram

    return EngineMetrics(
        inflight=_inflight_gauge(),
        kv_usage=Gauge("pd_engine_kv_usage", "KV cache usage, 0..1", tag_keys=("role", "engine")),
        # Counters, not a histogram: Ray exports a histogram's _sum from bucket midpoints.
        pushes=Counter("pd_kv_pushes", "KV transfers delivered", tag_keys=("engine",)),
        push_bytes=Counter("pd_kv_push_bytes", "bytes of KV delivered", tag_keys=("engine",)),
        push_time=Histogram(
            "pd_kv_push_seconds", "first to last layer of KV sent, per transfer", boundaries=LATENCY_BUCKETS, tag_keys=("engine",)
        ),
        push_failures=Counter("pd_kv_push_failures", "KV pushes that did not deliver", tag_keys=("engine",)),
        prompt_tokens=Counter("pd_engine_prompt_tokens", "prompt tokens of the requests an engine was given", tag_keys=("role", "engine")),
        prefix_hits=Counter(
            "pd_prefix_hit_tokens",
            "prompt tokens an engine's prefix cache held (decode, disaggregated: before any KV was pushed)",
            tag_keys=("role", "engine"),
        ),
    )
