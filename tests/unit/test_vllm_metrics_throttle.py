"""The scheduler-stats throttle in front of vLLM's Ray stat logger (vllm_plugins/stat_logger.py):
fewer gauge updates, no lost counts."""

from __future__ import annotations

from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

try:  # hits by source: newer vLLM only (0.23, on the Ascend path, has none)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

from serve_app.vllm_plugins.stat_logger import SchedulerStatsThrottle


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


def connector_step(running: int, queries: int = 0, hits: int = 0) -> SchedulerStats:
    """A step of an engine with a KV connector: vLLM's scheduler then sends the connector's
    prefix-cache stats with every step, zeros when no request asked it for tokens."""
    stats = PrefixCacheStats()
    if queries:
        by_source = {"hits_by_source": {CacheHitSource.EXTERNAL_UNSPECIFIED: hits}} if CacheHitSource else {}
        stats.record(num_tokens=queries, num_hits=hits, preempted=False, **by_source)
    return step(running, connector_prefix_cache_stats=stats)


def test_an_engine_with_a_kv_connector_is_throttled_too_and_its_connector_counts_add_up():
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    passed = [throttle.filter(connector_step(n, queries=8 if n % 3 == 0 else 0, hits=n % 3 == 0 and 4), now=0.1 * n) for n in range(25)]
    kept = [s for s in passed if s is not None]
    assert [s.num_running_reqs for s in kept] == [0, 10, 20]
    asked = [n for n in range(21) if n % 3 == 0]  # steps 0..20 whose requests asked the connector
    assert sum(s.connector_prefix_cache_stats.queries for s in kept) == 8 * len(asked)
    assert sum(s.connector_prefix_cache_stats.hits for s in kept) == 4 * len(asked)
    assert sum(s.connector_prefix_cache_stats.requests for s in kept) == len(asked)
    if CacheHitSource is not None:
        by_source = [s.connector_prefix_cache_stats.hits_by_source.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) for s in kept]
        assert sum(by_source) == 4 * len(asked)


def test_held_back_connector_counts_leave_the_shared_step_alone():
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    throttle.filter(connector_step(1), now=0.0)
    throttle.filter(connector_step(1, queries=8, hits=8), now=0.5)
    shared = connector_step(2, queries=16, hits=0)
    passed = throttle.filter(shared, now=1.5)
    assert (passed.connector_prefix_cache_stats.queries, passed.connector_prefix_cache_stats.hits) == (24, 8)
    assert passed.connector_prefix_cache_stats.requests == 2
    assert (shared.connector_prefix_cache_stats.queries, shared.connector_prefix_cache_stats.hits) == (16, 0)
    assert shared.connector_prefix_cache_stats.requests == 1


def test_no_scheduler_stats_is_passed_through():
    assert SchedulerStatsThrottle().filter(None) is None


def test_the_step_that_leaves_the_engine_idle_always_goes_on():
    """An idle engine steps no more: held back, its last step would leave the gauges (running
    requests, KV usage) at the busy values until the next request."""
    throttle = SchedulerStatsThrottle(interval_s=1.0)
    assert throttle.filter(step(3, queries=5), now=0.0) is not None
    assert throttle.filter(step(2, queries=5), now=0.1) is None
    idle = throttle.filter(step(0, queries=5), now=0.2)
    assert idle is not None and idle.num_running_reqs == 0 and idle.prefix_cache_stats.queries == 10
    waiting = throttle.filter(step(0, num_waiting_reqs=1), now=0.3)
    assert waiting is None  # nothing running, one waiting: not idle
    for_kv = throttle.filter(step(0, num_skipped_waiting_reqs=2), now=0.4)
    assert for_kv is None  # nothing running, two waiting for their KV (vLLM's skipped): not idle
