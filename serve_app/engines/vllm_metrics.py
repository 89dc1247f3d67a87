"""vLLM's own engine metrics on Ray's Prometheus endpoint, per pd-serve engine.

vLLM ships a stat logger that records its engine metrics (running and waiting requests, KV cache
usage, prefix cache hits, TTFT, inter-token latency, preemptions, ...) as Ray metrics
(``vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger``, what Ray Serve LLM registers). Its
``engine`` label is the engine's index inside one ``AsyncLLM``, which is 0 for every pd-serve
engine; so the logger here labels ``engine`` with the engine's name (``decode-0``) and adds
``role`` (``prefill`` / ``decode``), the labels pd-serve's own ``pd_*`` metrics use, and one
dashboard query can join both. Exported as ``ray_vllm_<name>`` (Ray replaces the ``:``).
"""

from __future__ import annotations

from typing import Any


def ray_stat_logger(engine: str, role: str) -> type:
    """A ``RayPrometheusStatLogger`` class whose metrics carry ``engine=<name>`` and ``role``."""
    from vllm.v1.metrics import ray_wrappers

    fixed = {"engine": engine, "role": role}

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

    gauge = type("Gauge", (Labelled, ray_wrappers.RayGaugeWrapper), {})
    counter = type("Counter", (Labelled, ray_wrappers.RayCounterWrapper), {})
    histogram = type("Histogram", (Labelled, ray_wrappers.RayHistogramWrapper), {})
    metric_classes = {"_gauge_cls": gauge, "_counter_cls": counter, "_histogram_cls": histogram}
    base = ray_wrappers.RayPrometheusStatLogger
    members: dict[str, Any] = dict(metric_classes)
    for attr in ("_spec_decoding_cls", "_kv_connector_cls", "_perf_metrics_cls"):
        parent = getattr(base, attr, None)
        if parent is not None:
            members[attr] = type(parent.__name__, (parent,), {k: v for k, v in metric_classes.items() if hasattr(parent, k)})
    return type("PdServeRayStatLogger", (base,), members)
