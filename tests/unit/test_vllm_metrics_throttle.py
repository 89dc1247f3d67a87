"""The scheduler-stats throttle in front of vLLM's Ray stat logger (engines/vllm_metrics.py):
fewer gauge updates, no lost counts."""

from __future__ import annotations

from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from serve_app.engines.vllm_metrics import SchedulerStatsThrottle


def step(running: int, queries: int = 0, hits: int = 0, **extra) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits), **extra)


def test_the_scheduler_state_goes_on_at_most_once_per_interval_and_prefix_counts_add_up():
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    passed = [throttle.filter(step(n, queries=10, hits=n), now=0.1 * n) for n in range(25)]
    kept = [s for s in passed if s is not None]
    assert [s.num_running_reqs for s in kept] == [0, 10, 20]  # the latest state, once a second
    assert sum(s.prefix_cache_stats.queries for s in kept) == 10 * 21  # steps 0..20: none lost
    assert sum(s.prefix_cache_stats.hits for s in kept) == sum(range(21))
    # Steps 21..24 are held back until the next one is passed on.
    later = throttle.filter(step(99, queries=1), now=3.0)
    assert later.prefix_cache_stats.queries == 1 + 4 * 10


def test_held_back_counts_are_added_to_a_copy():
    """The same SchedulerStats goes to every stat logger (pd-serve's load tracker too)."""
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    throttle.filter(step(1, queries=5), now=0.0)
    throttle.filter(step(1, queries=5), now=0.5)
    shared = step(2, queries=5)
    passed = throttle.filter(shared, now=1.5)
    assert passed.prefix_cache_stats.queries == 10
    assert shared.prefix_cache_stats.queries == 5


def test_a_step_with_per_step_connector_stats_always_goes_on():
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    throttle.filter(step(1), now=0.0)
    assert throttle.filter(step(1), now=0.1) is None
    with_transfers = step(1, kv_connector_stats={"transfers": {"t-1": {"outcome": "done"}}})
    assert throttle.filter(with_transfers, now=0.2) is not None


def test_no_scheduler_stats_is_passed_through():
    assert SchedulerStatsThrottle().filter(None) is None
