"""Elastic pools, fast: the autoscaling policies, membership (at 100 replicas x 8 routers), the
request router's pinning. The drain's moves are in test_orchestration.py (in process) and
tests/integration/test_pools.py (real Serve, vLLM engines)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.config import autoscaling
from serve_app.engines.load_report import LatencyWindow
from serve_app.router.membership import Membership, ReplicaInfo
from serve_app.router.pool import EnginePool
from serve_app.router.replica_router import EngineRequestRouter, pinned_replica
from serve_app.wire.protocol import EngineStats


# ---------------------------------------------------------------------------- policies
def ctx(metrics: dict[str, list[float]], current: int = 2, target: int = 2) -> SimpleNamespace:
    """Serve's AutoscalingContext, as much of it as the policies read."""
    return SimpleNamespace(
        aggregated_metrics={name: {f"r{i}": v for i, v in enumerate(values)} for name, values in metrics.items()},
        current_num_replicas=current,
        target_num_replicas=target,
        policy_state={},
    )


def test_decode_scales_on_requests_or_kv_whichever_needs_more():
    policy = autoscaling.DecodeLoadPolicy(target_requests=10, target_kv_usage=0.5)
    busy_kv = {autoscaling.RUNNING: [2, 2], autoscaling.WAITING: [0, 0], autoscaling.KV_USAGE: [0.9, 0.6]}
    assert policy(ctx(busy_kv))[0] == pytest.approx(3.0)  # 1.5 of KV over 0.5 each
    many = {autoscaling.RUNNING: [12, 10], autoscaling.WAITING: [8, 0], autoscaling.KV_USAGE: [0.1, 0.1]}
    assert policy(ctx(many))[0] == pytest.approx(3.0)  # 30 requests over 10 each
    idle = {autoscaling.RUNNING: [0, 0], autoscaling.WAITING: [0, 0], autoscaling.KV_USAGE: [0.0, 0.0]}
    assert policy(ctx(idle))[0] == 0.0  # Serve's min_replicas and downscale delay bound it
    assert policy(ctx({}, target=3))[0] == 3.0  # nothing reported yet (replicas starting): hold
    # One of 3 running replicas has not reported (it just started): it adds nothing, and the
    # pool is not shrunk below Serve's target until it has.
    partial = {autoscaling.RUNNING: [10, 10], autoscaling.WAITING: [0, 0], autoscaling.KV_USAGE: [0.1, 0.1]}
    assert policy(ctx(partial, current=3, target=3))[0] == pytest.approx(3.0)
    assert policy(ctx(partial, current=2, target=2))[0] == pytest.approx(2.0)  # all reported: 20 / 10
    # Right after a scale-up from 2 to 4 the two new replicas have not reported: the old ones'
    # load is not copied onto them (which asked for 7 here, then 13 after the next step).
    policy = autoscaling.DecodeLoadPolicy(target_requests=64)
    scaled = {autoscaling.RUNNING: [100, 100], autoscaling.WAITING: [0, 0], autoscaling.KV_USAGE: [0.1, 0.1]}
    assert policy(ctx(scaled, current=2, target=2))[0] == pytest.approx(200 / 64)
    assert policy(ctx(scaled, current=4, target=4))[0] == pytest.approx(4.0)


def test_prefill_scales_on_prompt_tokens_and_router_on_client_requests():
    prefill = autoscaling.PrefillLoadPolicy(target_prompt_tokens=1000)
    assert prefill(ctx({autoscaling.PROMPT_TOKENS: [2500, 1500]}))[0] == pytest.approx(4.0)
    router = autoscaling.RouterLoadPolicy(target_requests=100)
    assert router(ctx({autoscaling.CLIENT_REQUESTS: [150.0]}, current=1))[0] == pytest.approx(1.5)


def test_the_slo_policy_scales_up_at_once_and_down_only_well_under_the_target():
    decode = autoscaling.SLOPolicy(itl_p90_s=0.05)
    assert decode.metric == autoscaling.ITL_P90
    assert decode(ctx({autoscaling.ITL_P90: [0.1, 0.02]}, current=2))[0] == pytest.approx(4.0)  # worst replica: 2x the target
    assert decode(ctx({autoscaling.ITL_P90: [0.04, 0.03]}, current=2))[0] == 2.0  # just under: hold
    assert decode(ctx({autoscaling.ITL_P90: [0.01, 0.005]}, current=4))[0] == pytest.approx(2.0)  # well under: at most halve
    assert decode(ctx({autoscaling.ITL_P90: [0.0, 0.0]}, current=4))[0] == pytest.approx(2.0)  # idle
    # Under scale_down_below but not by much: at least one replica fewer (Serve rounds 2 x 0.8 up to 2).
    assert decode(ctx({autoscaling.ITL_P90: [0.02, 0.02]}, current=2))[0] == pytest.approx(1.0)
    assert decode(ctx({autoscaling.ITL_P90: [0.0, 0.0]}, current=3))[0] == pytest.approx(1.5)
    prefill = autoscaling.SLOPolicy(ttft_p90_s=0.5)
    assert prefill.metric == autoscaling.TTFT_P90
    assert prefill(ctx({autoscaling.TTFT_P90: [1.5]}, current=1, target=1))[0] == pytest.approx(3.0)
    with pytest.raises(ValueError):
        autoscaling.SLOPolicy(ttft_p90_s=0.5, itl_p90_s=0.05)
    with pytest.raises(ValueError):
        autoscaling.SLOPolicy()


def test_the_slo_policy_reads_each_replicas_latest_p90_not_serves_average_over_its_look_back():
    """A replica idle until 6 s ago (p90 0) and now at 0.2 s: Serve's time-weighted average over
    a 30 s look-back reads 0.04, under a 0.05 target; the replica's own p90 is 4x it."""
    samples = [SimpleNamespace(timestamp=t, value=v) for t, v in ((0.0, 0.0), (12.0, 0.0), (24.0, 0.2), (30.0, 0.2))]
    context = ctx({autoscaling.ITL_P90: [0.04, 0.0]})
    context.raw_metrics = {autoscaling.ITL_P90: {"r0": list(reversed(samples)), "r1": [SimpleNamespace(timestamp=30.0, value=0.0)]}}
    assert autoscaling.latest_per_replica(context, autoscaling.ITL_P90) == [0.2, 0.0]
    assert autoscaling.SLOPolicy(itl_p90_s=0.05)(context)[0] == pytest.approx(8.0)
    context.raw_metrics = {}  # a Serve without raw series: its averages
    assert autoscaling.SLOPolicy(itl_p90_s=0.05)(context)[0] == pytest.approx(2.0)


def test_the_slo_policy_does_not_compound_a_ratio_measured_before_its_last_scale_up():
    """The p90 covers the last LATENCY_WINDOW_S (then the age of the latest report, at most
    Serve's metrics interval): while new replicas start, and for that long after they run, it
    still describes the smaller pool, and
    multiplying the grown pool by it again would double it on every decision (2, 4, 8, ...)."""
    decode = autoscaling.SLOPolicy(itl_p90_s=0.05)
    slow = {autoscaling.ITL_P90: [0.1, 0.1]}
    state: dict = {}

    def decide(current: int, target: int, now: float, metrics: dict = slow) -> float:
        nonlocal state
        c = ctx(metrics, current=current, target=target)
        c.policy_state, c.current_time, c.config = state, now, SimpleNamespace(metrics_interval_s=10.0, look_back_period_s=30.0)
        desired, state = decode(c)
        return desired

    assert decide(2, 2, 0.0) == 4.0  # first miss: up at once, measured on its 2 replicas
    assert decide(2, 4, 10.0) == 4.0  # the 2 new ones still starting: hold at what was asked
    assert decide(2, 4, 60.0) == 4.0  # however long they take
    assert decide(4, 4, 90.0) == 4.0  # running now, but the p90 still covers the old pool
    assert decide(4, 4, 90.0 + autoscaling.LATENCY_WINDOW_S + 9) == 4.0
    assert decide(4, 4, 90.0 + autoscaling.LATENCY_WINDOW_S + 11) == pytest.approx(8.0)  # its own miss
    fast = {autoscaling.ITL_P90: [0.01] * 4}
    assert decide(4, 8, 200.0, fast) < 4.0  # scaling down is never held
    # Shrunk (to 2): a p90 that still covers the larger pool understates a miss, so a miss now
    # is acted on at once, not held as after a growth.
    assert decide(2, 2, 300.0) == 4.0


def test_the_slo_policy_reads_a_pool_holding_requests_with_no_latency_yet_as_busy_not_idle():
    """A replica records a latency when a call ends (prefill) or between two outputs (decode): a
    prefill longer than the window, or a stalled engine, has none yet. Four such replicas,
    each holding calls, are not an idle pool to halve; four holding nothing are."""
    prefill = autoscaling.SLOPolicy(ttft_p90_s=0.5)
    stalled = {autoscaling.TTFT_P90: [0.0] * 4, autoscaling.RUNNING: [1, 1, 0, 1], autoscaling.WAITING: [3, 0, 0, 0]}
    assert prefill(ctx(stalled, current=4, target=4))[0] == 4.0
    idle = {autoscaling.TTFT_P90: [0.0] * 4, autoscaling.RUNNING: [0] * 4, autoscaling.WAITING: [0] * 4}
    assert prefill(ctx(idle, current=4, target=4))[0] == 2.0
    assert autoscaling.RUNNING in prefill.reads and autoscaling.WAITING in prefill.reads


def test_a_policy_is_what_serve_runs_from_the_config():
    """Serve's own AutoscalingConfig imports the policy and instantiates it with policy_kwargs."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    from serve_app.config.settings import load_config

    policy = {"policy_function": "serve_app.config.autoscaling:SLOPolicy", "policy_kwargs": {"itl_p90_s": 0.05}}
    config = load_config({"decode": {"autoscaling_config": {"max_replicas": 4, "policy": policy}}})
    serve_config = AutoscalingConfig(**config.decode.serve_options(None)["autoscaling_config"])
    resolved = _resolve_policy_callable(serve_config.policy)
    assert isinstance(resolved, autoscaling.SLOPolicy) and resolved.target == 0.05


def test_latency_window_p90_forgets_old_samples():
    window = LatencyWindow(window_s=10)
    for i in range(100):
        window.add(100.0, i / 100)
    assert window.p90(105.0) == pytest.approx(0.89)  # nearest rank: the 90th of 100
    assert window.p90(111.0) == 0.0
    # Of ten values the ninth, not the largest: one outlier at low traffic is not the p90.
    few = LatencyWindow(window_s=10)
    for value in [1.0] * 9 + [50.0]:
        few.add(0.0, value)
    assert few.p90(1.0) == 1.0


# ---------------------------------------------------------------------------- membership
def infos(role: str, ids: range) -> list[ReplicaInfo]:
    return [ReplicaInfo(replica_id=f"{role}-r{i}", role=role, name=f"{role}-{i}") for i in ids]  # type: ignore[arg-type]


def test_membership_diffs_at_100_replicas_and_8_routers():
    """One replica starting in a pool of 100 reaches 8 router replicas: each sees exactly one
    join; one stopping: exactly one leave. The costs are set differences of 100 ids."""
    registry = Membership()
    pools = [EnginePool({}) for _ in range(8)]
    for pool in pools:
        pool.attach("decode", FakePoolHandle())
        registry.subscribe("app", "decode", lambda replicas, publisher, pool=pool: pool.update("decode", replicas, publisher))
    registry.publish("app", "decode", infos("decode", range(100)))
    assert all(len(pool.members) == 100 for pool in pools)
    started = time.perf_counter()
    registry.publish("app", "decode", infos("decode", range(101)))
    registry.publish("app", "decode", infos("decode", range(1, 101)))
    elapsed = time.perf_counter() - started
    for pool in pools:
        assert "decode-100" in pool.members and "decode-0" not in pool.members and len(pool.members) == 100
    print(f"two changes of a 100-replica pool at 8 routers: {elapsed * 1e3:.2f} ms")  # the cost, not a threshold
    registry.publish("app", "decode", infos("decode", range(50, 150)))
    for pool in pools:
        assert sorted(pool.members) == sorted(f"decode-{i}" for i in range(50, 150))


def test_a_listener_is_called_on_its_own_loop_whatever_thread_publishes():
    registry = Membership()
    seen: list[tuple[int, list[str]]] = []

    async def main() -> None:
        registry.subscribe("app", "prefill", lambda replicas, _: seen.append((threading.get_ident(), [r.name for r in replicas])))
        other = threading.Thread(target=registry.publish, args=("app", "prefill", infos("prefill", range(2))))
        other.start()
        other.join()
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert seen == [(threading.get_ident(), ["prefill-0", "prefill-1"])]
    # A late subscriber gets each publisher's latest list at once.
    registry.publish("app", "prefill", infos("prefill", range(3)), publisher="other")
    late: list[tuple[int, str]] = []
    registry.subscribe("app", "prefill", lambda replicas, publisher: late.append((len(replicas), publisher)))
    assert late == [(2, ""), (3, "other")]


def test_replica_metadata_becomes_a_member_that_is_callable_at_once():
    info = ReplicaInfo.from_metadata(
        "abc123",
        {
            "role": "decode",
            "name": "decode-3",
            "call_endpoint": {"url": "http://127.0.0.1:1234", "token": "t"},
            "kv_endpoint": {"engine_id": "decode-3-abc123", "host": "127.0.0.1", "port": 36000},
        },
    )
    assert info is not None and info.call_endpoint is not None and info.call_endpoint.url == "http://127.0.0.1:1234"
    assert ReplicaInfo.from_metadata("x", {}) is None  # not one of ours
    pool = EnginePool({})
    pool.attach("decode", FakePoolHandle())
    pool.update("decode", [info])
    assert pool.members["decode-3"].replica_id == "abc123"
    assert pool.kv_endpoint("decode-3") == info.kv_endpoint
    assert pool.loads["decode-3"].healthy  # Serve lists it once started: it takes work at once
    # A replacement with the same rank while the old one still drains gets a name of its own.
    with pool.lease("decode-3", 10):
        pool.update("decode", [])
        assert pool.loads["decode-3"].draining
        again = ReplicaInfo("def456", "decode", "decode-3")
        pool.update("decode", [again])
        assert "decode-3.def456" in pool.members
    assert "decode-3" not in pool.members  # forgotten with its last lease


def test_a_pool_counts_as_choosable_the_engines_serve_lists_and_not_those_leaving():
    """What pd_pool_replicas{role} reports (service.on_replicas sets it from Serve's lists)."""
    pool = EnginePool({})
    pool.attach("decode", FakePoolHandle())
    pool.attach("prefill", FakePoolHandle())
    pool.update("decode", infos("decode", range(3)))
    pool.update("prefill", infos("prefill", range(1)))
    assert (pool.choosable("decode"), pool.choosable("prefill")) == (3, 1)
    with pool.lease("decode-0", 10):
        pool.update("decode", infos("decode", range(1, 3)))
        assert "decode-0" in pool.members and pool.choosable("decode") == 2  # still held, but leaving
    pool.update("decode", [])
    assert pool.choosable("decode") == 0 and pool.choosable("prefill") == 1


def test_an_engine_forgotten_after_saying_moved_keeps_serves_later_lists_working():
    """A stopping decode engine says "moved" before Serve's list drops it (Ray Serve 2.60: about
    5 s later); the router forgets it with its last lease. Serve's lists after that still apply:
    the replica listed meanwhile does not join again, the replacements a redeploy starts join
    (one of them under the same name), and the old replica leaving later drains nothing else."""
    pool = EnginePool({})
    pool.attach("decode", FakePoolHandle())
    pool.update("decode", infos("decode", range(2)))
    with pool.lease("decode-0", 10):
        pool.drain("decode-0")  # its stream ended "moved"
    assert "decode-0" not in pool.members
    pool.update("decode", infos("decode", range(2)))  # Serve still lists it
    assert "decode-0" not in pool.members
    replacement = ReplicaInfo("decode-new0", "decode", "decode-0")  # Serve gives the new replica rank 0 again
    pool.update("decode", [*infos("decode", range(2)), replacement])
    assert pool.members["decode-0"].replica_id == "decode-new0" and pool.loads["decode-0"].healthy
    pool.update("decode", [*infos("decode", range(1, 2)), replacement])  # the old one leaves Serve's list
    assert not pool.loads["decode-0"].draining and pool.choosable("decode") == 2
    pool.update("decode", [replacement, ReplicaInfo("decode-new1", "decode", "decode-1")])  # and the other
    assert pool.choosable("decode") == 2
    assert {m.replica_id for m in pool.members.values()} == {"decode-new0", "decode-new1"}


class FakePoolHandle:
    """A deployment handle whose calls record the replica they are pinned to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def options(self, **_: Any) -> FakePoolHandle:
        return self

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                handle.calls.append((method, kwargs))
                return asyncio.sleep(0, result=EngineStats(name="?", role="prefill") if method == "stats" else None)

        return Method()


def test_every_handle_call_to_a_pool_member_names_its_replica():
    handle = FakePoolHandle()
    pool = EnginePool({})
    pool.attach("prefill", handle)
    pool.update("prefill", [ReplicaInfo("p1", "prefill", "prefill-0")])

    async def main() -> None:
        await pool.start_prefill("prefill-0", SimpleNamespace())
        await pool.open_stream("prefill-0", SimpleNamespace())
        await pool.refresh(["prefill-0"])

    asyncio.run(main())
    assert [kwargs for _, kwargs in handle.calls] == [{"replica": "p1"}] * 3
    assert pool.loads["prefill-0"].healthy  # its stats answered


def test_the_request_router_sends_a_pinned_call_to_its_replica_only():
    def replica(uid: str) -> Any:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid))

    candidates = [replica(f"r{i}") for i in range(5)]
    router = EngineRequestRouter.__new__(EngineRequestRouter)  # choose_replicas needs no state

    def pending(**kwargs: Any) -> Any:
        return SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))

    chosen = asyncio.run(router.choose_replicas(candidates, pending(replica="r3")))
    assert [[r.replica_id.unique_id for r in rank] for rank in chosen] == [["r3"]]
    gone = pending(replica="gone")
    # It waits for the replica (or the caller's deadline), backing off: Serve's routing loop asks
    # again at once, without yielding the event loop, unless told to back off.
    assert asyncio.run(router.choose_replicas(candidates, gone)) == [[]] and gone.routing_context.should_backoff
    assert len(asyncio.run(router.choose_replicas(candidates, pending()))[0]) == 2  # unpinned: two to compare
    assert pinned_replica(pending(replica=7)) is None and pinned_replica(None) is None


class SlowStatsHandle(FakePoolHandle):
    """Stats answered after ``delay_s``, with each replica's own answer where ``answers`` has one."""

    def __init__(self, delay_s: float = 0.0, answers: dict[str, EngineStats] | None = None, healthy: bool = True) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.answers = answers or {}
        self.healthy = healthy

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, replica: str | None = None, **kwargs: Any) -> Any:
                handle.calls.append((method, {"replica": replica}))
                stats = handle.answers.get(replica or "") or EngineStats(name="?", role="decode", healthy=handle.healthy)
                return asyncio.sleep(handle.delay_s, result=stats)

        return Method()


def test_attempts_waiting_for_an_engine_share_one_poll_of_the_engines():
    """No decode engine is healthy for a moment: 100 attempts wait for one, each looking again
    every 0.2 s. They share the router's poll of every engine instead of each polling all five."""
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.cdcp import AttemptExecutor

    handle = SlowStatsHandle(delay_s=0.05, healthy=False)
    pool = EnginePool({})
    pool.attach("decode", handle)
    pool.attach("prefill", handle)
    pool.update("decode", [ReplicaInfo("d0", "decode", "decode-0")])
    pool.update("prefill", infos("prefill", range(4)))
    pool.mark_unhealthy("decode-0")
    executor = AttemptExecutor(pool, TimeoutsConfig(), metrics=None)

    async def main() -> list[Any]:
        return await asyncio.gather(*(executor.pick("decode", frozenset(), wait_s=1.0) for _ in range(100)))

    assert asyncio.run(main()) == [None] * 100
    polls = len(handle.calls) / 5
    # One poll per 0.2 s look, shared; and some: the waiting attempts look again, or an engine
    # that came back would never be seen.
    assert 2 <= polls <= 8, f"{len(handle.calls)} stats calls to 5 engines in 1 s"


def test_a_stats_answer_for_an_engine_that_left_is_not_taken_for_its_successor_of_that_name():
    from serve_app.wire.protocol import KVEndpoint

    old = KVEndpoint(engine_id="decode-0-OLD", host="127.0.0.1", port=1000)
    new = KVEndpoint(engine_id="decode-0-NEW", host="127.0.0.1", port=2000)
    answers = {rid: EngineStats(name="decode-0", role="decode", kv_endpoint=kv) for rid, kv in (("OLD", old), ("NEW", new))}
    pool = EnginePool({})
    pool.attach("decode", SlowStatsHandle(delay_s=0.2, answers=answers))
    pool.update("decode", [ReplicaInfo("OLD", "decode", "decode-0", kv_endpoint=old)])

    async def main() -> None:
        poll = asyncio.ensure_future(pool.refresh())
        await asyncio.sleep(0.05)  # the old engine's stats are on their way
        pool.update("decode", [])  # it leaves (nothing held: forgotten) and its successor joins
        pool.update("decode", [ReplicaInfo("NEW", "decode", "decode-0", kv_endpoint=new)])
        await poll

    asyncio.run(main())
    assert pool.members["decode-0"].replica_id == "NEW" and pool.kv_endpoint("decode-0") == new


def test_a_replica_that_left_is_not_brought_back_by_a_list_published_late():
    pool = EnginePool({})
    pool.attach("decode", FakePoolHandle())
    three = infos("decode", range(3))
    pool.update("decode", three)
    pool.update("decode", three[:2])  # Serve stops the third
    pool.update("decode", three)  # a list another of the handle's request routers published before that
    assert sorted(pool.members) == ["decode-0", "decode-1"]


def test_a_replica_that_joined_is_not_dropped_by_a_list_published_late():
    """The mirror case: one request router has the new replica, another's older list (published
    after it) does not. The replica stays; it leaves when a router that listed it drops it."""
    pool = EnginePool({})
    pool.attach("decode", FakePoolHandle())
    three = infos("decode", range(3))
    pool.update("decode", three[:2], "a")
    pool.update("decode", three[:2], "b")
    pool.update("decode", three, "a")  # a scale-up
    pool.update("decode", three[:2], "b")  # b, behind, publishes its older list again
    assert sorted(pool.members) == ["decode-0", "decode-1", "decode-2"] and pool.choosable("decode") == 3
    pool.update("decode", three, "b")  # b catches up
    pool.update("decode", three[1:], "a")  # Serve stops the first: a's list says so first
    assert sorted(pool.members) == ["decode-1", "decode-2"]
    pool.update("decode", three, "b")  # and b's late list does not bring it back
    assert sorted(pool.members) == ["decode-1", "decode-2"]


def test_an_engines_call_failures_back_it_off_longer_only_while_none_goes_through(monkeypatch):
    """An engine whose calls fail is left alone 1 s, then 2, 4, ... while they keep failing; a
    call that went through in between makes the next failure a first one again (else a healthy
    engine with a rare transient failure was left out for up to 30 s at a time)."""
    from serve_app.router import pool as pool_module

    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    pool = EnginePool({})
    pool.attach("decode", SlowStatsHandle(delay_s=0.0))
    pool.update("decode", [ReplicaInfo("d0", "decode", "decode-0")])
    load = pool.loads["decode-0"]

    def backoff_after_failure() -> float:
        pool.mark_unhealthy("decode-0")
        return load.call_backoff_until - now[0]

    assert backoff_after_failure() == 1.0
    for _ in range(5):  # the other streams it had, broken by the same event: not more in a row
        pool.mark_unhealthy("decode-0")
    assert load.call_backoff_until - now[0] == 1.0
    now[0] += 5
    assert backoff_after_failure() == 2.0  # in a row: nothing went through since
    now[0] += 5
    assert backoff_after_failure() == 4.0
    pool.call_succeeded("decode-0")
    now[0] += 5
    assert backoff_after_failure() == 1.0  # a call went through in between
    for _ in range(10):  # each failing again once its backoff is over: 2, 4, ... 30 s
        now[0] = load.call_backoff_until + 0.5
        backoff = backoff_after_failure()
    assert backoff == pool_module.CALL_BACKOFF_MAX_S


def test_a_prefill_engine_whose_line_other_routers_filled_is_not_chosen_for_this_routers_shorter_one():
    """Each router replica counts only its own calls; a prefill engine reports the prompt tokens
    of every call it holds (its line, whoever sent them), and that is what the prefill score
    weighs where it is more: 20 long prompts from other routers outweigh one of this router's."""
    busy = EngineStats(name="prefill-0", role="prefill", num_waiting=20, queued_prompt_tokens=20 * 4096)
    handle = SlowStatsHandle(answers={"prefill-r0": busy, "prefill-r1": EngineStats(name="prefill-1", role="prefill")})
    pool = EnginePool({})
    pool.attach("prefill", handle)
    pool.update("prefill", infos("prefill", range(2)))
    asyncio.run(pool.refresh())
    pool.loads["prefill-1"].reserved_tokens = 4096  # this router's one long prompt, on the other engine
    assert pool.loads["prefill-0"].queued_prompt_tokens == 20 * 4096
    assert pool.pick("prefill").name == "prefill-1"


def test_a_prefill_engine_reports_the_prompt_tokens_of_the_calls_it_holds(tiny_tokenizer):
    """A prefill replica's line, in its stats (the prefill score's) and its autoscaling metric,
    while a call is computing; nothing once it is done."""
    from tests.support.inprocess import App, args, completion, run

    prompt = list(range(20, 420))  # 400 tokens at 2.5 ms each: a second of prefill

    async def body(app: App) -> None:
        engine = app.engines["prefill-0"]
        call = asyncio.create_task(completion(app, prompt, max_tokens=2))
        deadline = time.monotonic() + 5
        while (await engine.stats()).queued_prompt_tokens != len(prompt):
            assert time.monotonic() < deadline and not call.done(), "the prefill engine never reported its call's prompt"
            await asyncio.sleep(0.01)
        assert (await engine.record_autoscaling_stats())[autoscaling.PROMPT_TOKENS] == len(prompt)
        status, _ = await call
        assert status == 200 and (await engine.stats()).queued_prompt_tokens == 0

    run(body, args(mock={"decode_step_s": 0.001, "prefill_s_per_token": 0.0025}), tiny_tokenizer)


def test_an_engine_leaving_the_pool_leaves_the_leak_audit_too():
    from serve_app.router.leak_audit import LeakAudit

    forgotten: list[str] = []
    audit = LeakAudit(warn_after_s=10, sole_router=True)
    audit.forget = forgotten.append  # type: ignore[method-assign]
    pool = EnginePool({}, audit=audit)
    pool.attach("decode", FakePoolHandle())
    pool.update("decode", infos("decode", range(1)))
    pool.update("decode", [])
    assert forgotten == ["decode-0"]
