"""Autoscaling policies for the engine pools and the router, in Ray Serve's own terms.

The router calls engines over its own transport (HTTP by default), so Serve's default signal, the
requests in progress through its handles, does not see an engine's load; nor does it see the
client requests a router replica serves over its own HTTP server. Each replica therefore reports
its true load as Serve custom autoscaling metrics (``record_autoscaling_stats``, names below), and
these policies, run by Serve's controller every control-loop tick, turn them into a replica count.
Serve then applies the deployment's ``min_replicas``/``max_replicas``, its up/downscale delays and
factors to what a policy asks for (a custom policy is wrapped by Serve's own bounds and delays).

This module runs inside Serve's controller: standard library only, nothing from the rest of
pd-serve, no Ray import at module level.

* ``DecodeLoadPolicy``: enough decode replicas that, on average, each holds at most
  ``target_requests`` requests (running + waiting) and uses at most ``target_kv_usage`` of its KV
  cache; the larger of the two counts wins.
* ``PrefillLoadPolicy``: enough prefill replicas that each has at most ``target_prompt_tokens``
  prompt tokens queued or being computed.
* ``RouterLoadPolicy``: enough router replicas for ``target_requests`` client requests each.
* ``SLOPolicy``: latency targets instead of load targets, as NVIDIA Dynamo's planner does: the
  prefill pool scales on time to first token (``ttft_p90_s``: the p90 of the time a prompt waits
  and is computed on a prefill engine), the decode pool on inter-token latency (``itl_p90_s``: the
  p90 of the time per token between a decode engine's successive outputs). Each replica measures its own
  p90 over the last ``LATENCY_WINDOW_S`` (0 when it served nothing); the policy reads each
  replica's latest p90 and scales the pool by worst observed / target (above the target: more
  replicas at once; below ``scale_down_below`` of it, or idle: fewer, at least one and at most
  half at a time), and holds the count while no replica reports.

The load policies sum what the replicas reported (Serve's average over its look-back); a running
replica that has not reported yet (it just started) adds nothing, and while one has not, a policy
never asks for fewer replicas than Serve's current target (a missing report is not an idle replica).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

# The custom metrics each replica reports (record_autoscaling_stats), by name.
RUNNING = "pd_running"  # requests an engine is running (decode) or computing (prefill)
WAITING = "pd_waiting"  # requests an engine has queued
KV_USAGE = "pd_kv_usage"  # fraction of the engine's KV cache in use
PROMPT_TOKENS = "pd_prompt_tokens"  # prompt tokens a prefill engine holds: queued or computing
TTFT_P90 = "pd_ttft_p90_s"  # prefill: p90 of wait + compute per prompt, recent window (0: none)
ITL_P90 = "pd_itl_p90_s"  # decode: p90 of the time per token between a stream's outputs, recent window (0: none)
CLIENT_REQUESTS = "pd_client_requests"  # router: client requests in progress

# How far back a replica's latency p90 looks.
LATENCY_WINDOW_S = 30.0

# What each role's replicas report: a policy reading anything else never sees a value, and holds.
REPORTED_METRICS = {
    "prefill": frozenset({RUNNING, WAITING, KV_USAGE, PROMPT_TOKENS, TTFT_P90}),
    "decode": frozenset({RUNNING, WAITING, KV_USAGE, ITL_P90}),
    "router": frozenset({CLIENT_REQUESTS}),
}

DEFAULT_POLICY = {
    "decode": "serve_app.config.autoscaling:DecodeLoadPolicy",
    "prefill": "serve_app.config.autoscaling:PrefillLoadPolicy",
    "router": "serve_app.config.autoscaling:RouterLoadPolicy",
}


def per_replica(ctx: Any, name: str) -> list[float]:
    """The metric ``name`` of every running replica that reported it (averaged by Serve over the
    look-back window)."""
    metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
    return [float(v) for v in (metrics.get(name) or {}).values() if v is not None and math.isfinite(float(v))]


def latest_per_replica(ctx: Any, name: str) -> list[float]:
    """The metric ``name``'s latest sample of every running replica that reported it. For a p90
    the replica already takes over its own window: Serve's average over its look-back would mix
    in the zeros of an idle spell, and read a burst that follows one as a fraction of itself."""
    series: Mapping[Any, Any] = (getattr(ctx, "raw_metrics", None) or {}).get(name) or {}
    if not series:
        return per_replica(ctx, name)
    latest = (max(samples, key=lambda sample: sample.timestamp).value for samples in series.values() if samples)
    return [float(v) for v in latest if v is not None and math.isfinite(float(v))]


def load_replicas(total: float, target_per_replica: float) -> float:
    """Replicas for ``total`` load at ``target_per_replica`` each."""
    return total / target_per_replica


def unless_unreported(ctx: Any, desired: float, reported: int) -> float:
    """``desired``, but not below Serve's current target while a running replica has not
    reported (its load, counted as 0, is unknown, not idle)."""
    if reported < int(ctx.current_num_replicas or 0):
        return max(desired, float(ctx.target_num_replicas or 0))
    return desired


def positive_finite(**targets: float) -> None:
    """A policy's targets must be numbers above 0: a NaN (JSON allows one) would have every
    decision fail in Serve's controller, an infinity would keep the pool at its minimum."""
    for name, value in targets.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number above 0, not {value!r}")


def _hold(ctx: Any) -> tuple[float, dict[str, Any]]:
    return float(ctx.target_num_replicas), dict(ctx.policy_state or {})


class DecodeLoadPolicy:
    reads = frozenset({KV_USAGE, RUNNING, WAITING})

    def __init__(self, target_requests: float = 64.0, target_kv_usage: float = 0.7) -> None:
        positive_finite(target_requests=target_requests, target_kv_usage=target_kv_usage)
        if not target_kv_usage <= 1:
            raise ValueError("DecodeLoadPolicy: target_requests > 0 and 0 < target_kv_usage <= 1")
        self.target_requests = target_requests
        self.target_kv_usage = target_kv_usage

    def desired(self, requests: float, kv_usage: float) -> float:
        """Replicas for a pool's total ``requests`` (running + waiting) and KV usage (summed)."""
        return max(load_replicas(requests, self.target_requests), load_replicas(kv_usage, self.target_kv_usage))

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        kv = per_replica(ctx, KV_USAGE)
        if not kv:  # no replica has reported yet (starting): keep the count
            return _hold(ctx)
        requests = sum(per_replica(ctx, RUNNING)) + sum(per_replica(ctx, WAITING))
        return unless_unreported(ctx, self.desired(requests, sum(kv)), len(kv)), dict(ctx.policy_state or {})


class PrefillLoadPolicy:
    reads = frozenset({PROMPT_TOKENS})

    def __init__(self, target_prompt_tokens: float = 8192.0) -> None:
        positive_finite(target_prompt_tokens=target_prompt_tokens)
        self.target_prompt_tokens = target_prompt_tokens

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        tokens = per_replica(ctx, PROMPT_TOKENS)
        if not tokens:
            return _hold(ctx)
        desired = load_replicas(sum(tokens), self.target_prompt_tokens)
        return unless_unreported(ctx, desired, len(tokens)), dict(ctx.policy_state or {})


class RouterLoadPolicy:
    reads = frozenset({CLIENT_REQUESTS})

    def __init__(self, target_requests: float = 256.0) -> None:
        positive_finite(target_requests=target_requests)
        self.target_requests = target_requests

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        requests = per_replica(ctx, CLIENT_REQUESTS)
        if not requests:
            return _hold(ctx)
        desired = load_replicas(sum(requests), self.target_requests)
        return unless_unreported(ctx, desired, len(requests)), dict(ctx.policy_state or {})


class SLOPolicy:
    """``ttft_p90_s`` for a prefill pool, ``itl_p90_s`` for a decode pool (the one set decides
    which metric the policy reads)."""

    def __init__(self, ttft_p90_s: float | None = None, itl_p90_s: float | None = None, scale_down_below: float = 0.5) -> None:
        if (ttft_p90_s is None) == (itl_p90_s is None):
            raise ValueError("SLOPolicy: set exactly one of ttft_p90_s (prefill pool) and itl_p90_s (decode pool)")
        target = ttft_p90_s if ttft_p90_s is not None else itl_p90_s
        assert target is not None
        positive_finite(**{"ttft_p90_s" if ttft_p90_s is not None else "itl_p90_s": target, "scale_down_below": scale_down_below})
        if not scale_down_below < 1:
            raise ValueError("SLOPolicy: targets > 0 and 0 < scale_down_below < 1")
        self.metric = TTFT_P90 if ttft_p90_s is not None else ITL_P90
        self.reads = frozenset({self.metric, RUNNING, WAITING})
        self.target = target
        self.scale_down_below = scale_down_below

    def desired(self, current: int, observed: Iterable[float], busy: bool = False) -> float:
        """``current`` scaled by the worst replica's p90 over the target: up at once when the
        target is missed, down only when every replica is well under it (latency does not fall in
        proportion to replicas removed, so a pool just under its target stays as it is), by at
        least one replica (Serve rounds a count up: 2 x 0.8 would stay 2) and at most half.
        ``busy``: a replica holds requests. With no latency in the window that is not idle: a
        prefill call longer than the window, or an engine that stalled, has none yet."""
        measured = [v for v in observed if v > 0]
        if current == 0:
            return 0.0
        if not measured:  # nothing finished in the window: idle (shrink towards min_replicas) unless busy
            return float(current) if busy else min(current * 0.5, current - 1.0)
        ratio = max(measured) / self.target
        if ratio > 1.0:
            return current * ratio
        if ratio < self.scale_down_below:
            return min(current * max(ratio / self.scale_down_below, 0.5), current - 1.0)
        return float(current)

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        observed = latest_per_replica(ctx, self.metric)
        if not observed:
            return _hold(ctx)
        current = int(ctx.current_num_replicas)
        state = dict(ctx.policy_state or {})
        now = getattr(ctx, "current_time", None)
        if now is None:
            now = time.time()
        before = state.get("slo_replicas")
        if before is None:  # the first decision has nothing to wait for
            state["slo_replicas"], state["slo_since"] = current, now - _settle_s(ctx)
        elif current != before:
            state["slo_replicas"] = current
            if current > before:
                # Grown: its own p90 starts now. (Shrunk: the p90 still covering the larger pool
                # understates a miss, so nothing to wait for.)
                state["slo_since"] = now
        busy = any(v > 0 for name in (RUNNING, WAITING) for v in per_replica(ctx, name))
        desired = self.desired(current, observed, busy)
        target = int(getattr(ctx, "target_num_replicas", current) or current)
        if desired > current and (current < target or now - state["slo_since"] < _settle_s(ctx)):
            # Replicas still starting, or a p90 that still covers the time before the pool grew
            # (its window, then the age of the latest report): the same ratio again would
            # multiply the pool it already grew. Hold at what was asked until the pool's own p90 is in.
            desired = float(max(current, target))
        return desired, state


def _settle_s(ctx: Any) -> float:
    """How long after the pool changed a replica's latest p90 may still cover the pool before:
    its window, and how old that report can be (Serve's metrics interval)."""
    interval = getattr(getattr(ctx, "config", None), "metrics_interval_s", None)
    return LATENCY_WINDOW_S + float(interval or 0.0)
