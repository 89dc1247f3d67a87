"""vLLM's own engine metrics on Ray's Prometheus endpoint, per pd-serve engine.

vLLM ships a stat logger that records its engine metrics (running and waiting requests, KV cache
usage, prefix cache hits, TTFT, inter-token latency, preemptions, ...) as Ray metrics
(``vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger``, what Ray Serve LLM registers). Its
``engine`` label is the engine's index inside one ``AsyncLLM``, which is 0 for every pd-serve
engine; so the logger here labels ``engine`` with the engine's name (``decode-0``) and adds
``role`` (``prefill`` / ``decode``), the labels pd-serve's own ``pd_*`` metrics use, and one
dashboard query can join both. Exported as ``ray_vllm_<name>`` (Ray replaces the ``:``).

vLLM's logger records the scheduler's gauges and counters on every engine step, a dozen Ray
metric calls each time: on a small host, unthrottled, the logger takes about a fifth of a decode
replica's CPU, most of it in that part. Ray exports metrics every few seconds, so the scheduler's
state goes to the logger at most every ``SCHEDULER_STATS_INTERVAL_S``
(``SchedulerStatsThrottle``), its prefix-cache counts (the local cache's and, on an engine with a
KV connector, the connector's) summed over the steps in between; every step's iteration stats
(tokens, TTFT, inter-token latency, finished requests) still go to it. An engine with a KV
connector (every disaggregated one) carries the connector's prefix-cache stats in every step's
scheduler stats, mostly zeros: counted as per-step news they would pass every step on, so they
are summed too.

vLLM sets its gauges on engine steps (and its config info once): on Ray's metrics path a gauge
not set for 20-30 s leaves the Prometheus endpoint, so an idle engine's running and waiting
requests and KV usage would go blank on the dashboard. The labelled gauges keep their last value
(``runtime/metrics.KeptGauges``), as vLLM's own server's gauges do, and start at an idle
scheduler's values, before the engine's first step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from serve_app.runtime.metrics import kept_gauges
from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.engine")

SCHEDULER_STATS_INTERVAL_S = 0.25

_METRIC = "vllm.v1.metrics.ray_wrappers.RayPrometheusMetric"
_LOGGER = "vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger"
# What the engine and role labels need of vLLM's Ray metric wrappers and logger.
LABEL_SYMBOLS = (
    f"{_METRIC}._get_tag_keys",
    f"{_METRIC}._build_tags",
    f"{_METRIC}._tags",
    f"{_LOGGER}._gauge_cls",
    f"{_LOGGER}._counter_cls",
    f"{_LOGGER}._histogram_cls",
)
# The logger's groups of metrics (spec decoding, KV connector, perf), each made from the
# logger's metric classes: labelled too where vLLM has them.
NESTED_METRICS = ("_spec_decoding_cls", "_kv_connector_cls", "_perf_metrics_cls")
RECORD = f"{_LOGGER}.record"


class SchedulerStatsThrottle:
    """Passes one step's ``SchedulerStats`` on at most every ``interval_s``; the prefix-cache
    stats of the steps held back (the local cache's and the KV connector's) are added to the next
    one passed on, so the counters built from them lose nothing. A step whose stats carry anything
    else that is counted per step (connector transfers, spec-decode stats, cache evictions), or
    that leaves the engine idle, is always passed on."""

    def __init__(self, interval_s: float = SCHEDULER_STATS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._next_at = 0.0
        self._held: dict[str, Any] = {}  # field name -> prefix-cache stats summed since the last pass

    def filter(self, stats: Any, now: float | None = None) -> Any:
        if stats is None:
            return None
        now = time.monotonic() if now is None else now
        # An idle engine steps no more: a step that leaves it with nothing running or waiting
        # always goes on, else its gauges would keep the last busy step's values until traffic.
        # Requests waiting for their KV are waiting too (vLLM counts them as skipped): a decode
        # engine steps for each layer that arrives meanwhile.
        idle = not any(getattr(stats, name, 0) for name in ("num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs"))
        if now < self._next_at and not idle and not _counted_per_step(stats):
            for name in CACHE_STATS_FIELDS:
                value = getattr(stats, name, None)
                if value is not None:
                    self._held[name] = _sum_cache_stats(self._held.get(name), value)
            return None
        self._next_at = now + self.interval_s
        held, self._held = self._held, {}
        merged = {name: _sum_cache_stats(value, getattr(stats, name, None)) for name, value in held.items()}
        if merged:
            stats = dataclasses.replace(stats, **merged)  # a copy: other loggers share this step's
        return stats


# The prefix-cache stats a step's SchedulerStats carries: counts of that step alone.
CACHE_STATS_FIELDS = ("prefix_cache_stats", "connector_prefix_cache_stats")


def _sum_cache_stats(total: Any, step: Any) -> Any:
    """A new ``PrefixCacheStats`` with both steps' counts (either may be None): counts add up,
    per-source counts add up per source, flags (``reset``) hold if either step had them. By
    field type, so vLLM versions with other fields (0.23 has no ``hits_by_source``) work too."""
    if total is None or step is None:
        return step if total is None else total
    merged: dict[str, Any] = {}
    for f in dataclasses.fields(step):
        mine, theirs = getattr(total, f.name), getattr(step, f.name)
        if isinstance(theirs, bool):
            merged[f.name] = bool(mine or theirs)
        elif isinstance(theirs, int):
            merged[f.name] = mine + theirs
        elif isinstance(theirs, dict):
            merged[f.name] = {k: mine.get(k, 0) + theirs.get(k, 0) for k in {**mine, **theirs}}
    return dataclasses.replace(step, **merged)


def _counted_per_step(stats: Any) -> bool:
    return any(
        getattr(stats, name, None)
        for name in (
            "spec_decoding_stats",
            "kv_connector_stats",
            "ec_connector_stats",
            "perf_stats",
            "kv_cache_eviction_events",
        )
    )


def ray_stat_logger(engine: str, role: str) -> type:
    """A ``RayPrometheusStatLogger`` class whose metrics carry ``engine=<name>`` and ``role``,
    with its scheduler stats throttled. Where vLLM's internals are not what this was written
    against, the part that needs them is left out (and logged): at worst vLLM's own logger."""
    from vllm.v1.metrics import ray_wrappers

    base = ray_wrappers.RayPrometheusStatLogger
    members: dict[str, Any] = {}
    if unchanged(LABEL_SYMBOLS, logger, "the engine and role labels on vLLM's metrics"):
        metric_classes = _labelled_metric_classes(ray_wrappers, {"engine": engine, "role": role})
        members.update(metric_classes)
        for attr in NESTED_METRICS:
            parent = getattr(base, attr, None)
            if parent is not None and unchanged([f"{_LOGGER}.{attr}"], logger, f"the engine and role labels on vLLM's {attr} metrics"):
                members[attr] = type(parent.__name__, (parent,), {k: v for k, v in metric_classes.items() if hasattr(parent, k)})
    if unchanged([RECORD], logger, "its throttle of the scheduler stats vLLM's Ray metrics record"):
        members.update(_throttled(base))
    return type("PdServeRayStatLogger", (base,), members) if members else base


def _labelled_metric_classes(ray_wrappers: Any, fixed: dict[str, str]) -> dict[str, type]:
    """The logger's ``_gauge_cls`` / ``_counter_cls`` / ``_histogram_cls``: vLLM's Ray metric
    wrappers with the ``fixed`` labels."""

    class Labelled:
        """Mixed into vLLM's Ray metric wrappers: the fixed labels are tag keys of every metric
        and win over the values vLLM passes for them."""

        _pd_labelnames: list[str]
        _tags: dict[str, str]
        metric: Any

        def _get_tag_keys(self, labelnames: list[str] | None) -> tuple[str, ...]:
            self._pd_labelnames = list(labelnames or [])
            self._tags = {**self._tags, **fixed}
            keys = self._pd_labelnames + [k for k in fixed if k not in self._pd_labelnames]
            return (*keys, "ReplicaId")

        def _build_tags(self, *labels: Any, **labelskwargs: Any) -> dict[str, str]:
            if labels:
                if len(labels) != len(self._pd_labelnames):
                    raise ValueError(f"expected {len(self._pd_labelnames)} label values, got {len(labels)}")
                labelskwargs.update(zip(self._pd_labelnames, labels))
            labelskwargs.update(fixed)
            labelskwargs["ReplicaId"] = self._tags.get("ReplicaId", "")
            return {k: v if isinstance(v, str) else str(v) for k, v in labelskwargs.items()}

    class KeptLabelled(Labelled):
        """A gauge whose series keep their last value while vLLM sets them no more (module docstring)."""

        def set(self, value: float) -> None:
            kept_gauges().set(self.metric, value, self._tags)

        def set_to_current_time(self) -> None:
            """Not kept: vLLM's LoRA info gauge, labelled with the adapters running and waiting at
            each step, would keep a series for every set of adapters the engine ever ran."""
            self.metric.set(time.time(), tags=self._tags)

    return {
        "_gauge_cls": type("Gauge", (KeptLabelled, ray_wrappers.RayGaugeWrapper), {}),
        "_counter_cls": type("Counter", (Labelled, ray_wrappers.RayCounterWrapper), {}),
        "_histogram_cls": type("Histogram", (Labelled, ray_wrappers.RayHistogramWrapper), {}),
    }


def _throttled(base: type) -> dict[str, Any]:
    """``__init__`` and ``record`` of a logger that passes the scheduler stats on through a
    ``SchedulerStatsThrottle``."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        self._pd_throttle = SchedulerStatsThrottle()  # once per logger, not per step
        base.__init__(self, *args, **kwargs)
        _record_idle(base, self)

    def record(self: Any, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        scheduler_stats = self._pd_throttle.filter(scheduler_stats)
        if scheduler_stats is not None or iteration_stats is not None or mm_cache_stats is not None:
            base.record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

    return {"__init__": __init__, "record": record}


def _record_idle(base: type, stat_logger: Any) -> None:
    """Record an idle scheduler once, at the engine's start. vLLM's own server exports its
    gauges at 0 from the start (prometheus_client exports a labelled gauge as soon as it is
    made); Ray exports a gauge once it is set, so an engine that had not stepped yet (a prefill
    engine before its first prompt) was missing from the dashboard's running, waiting and KV
    panels. Counters are not touched: vLLM's Ray wrappers skip an increment of 0."""
    try:
        from vllm.v1.metrics.stats import SchedulerStats

        for index in getattr(stat_logger, "engine_indexes", None) or [0]:
            base.record(stat_logger, SchedulerStats(), None, None, index)  # type: ignore[attr-defined]
    except Exception:  # a vLLM whose stats differ: the gauges appear with the first step, as before
        logger.warning("vLLM's gauges are not exported until the engine's first step", exc_info=True)
