"""What an operator sees of the router: where a request's time went, the leak audit, and one
request's story in the logs (fast: the in-process app on mock engines, no Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator

import pytest

from serve_app.engines.mock_runner import _Sequence
from serve_app.router.leak_audit import Discrepancy, LeakAudit, discrepancy
from serve_app.wire.protocol import EngineStats
from tests.support.inprocess import App, args, completion, recording_router_metrics
from tests.support.log_capture import RecordList


@contextlib.contextmanager
def captured(level: int) -> Iterator[RecordList]:
    """pd-serve's log records at ``level``, taken at its own logger (whatever else the suite did
    to Serve's logging, where pd-serve's records are forwarded). The router's logger gets the
    level too: an engine replica starting sets pd-serve's to INFO (``to_serve_logs``)."""
    handler = RecordList(level)
    ours, router = logging.getLogger("pd_serve"), logging.getLogger("pd_serve.router")
    saved = ours.level, router.level
    ours.addHandler(handler)
    ours.setLevel(level)
    router.setLevel(level)
    try:
        yield handler
    finally:
        ours.removeHandler(handler)
        ours.setLevel(saved[0])
        router.setLevel(saved[1])


@pytest.fixture
def pd_log():
    """What an operator's log holds at the default level (INFO)."""
    with captured(logging.INFO) as handler:
        yield handler


@pytest.fixture
def pd_debug_log():
    """Everything pd-serve logs, DEBUG included."""
    with captured(logging.DEBUG) as handler:
        yield handler


def stats(inflight: int, kv_usage: float = 0.0, capacity: int = 1000) -> EngineStats:
    return EngineStats(
        name="decode-0",
        role="decode",
        num_running=inflight,
        num_waiting=0,
        kv_usage=kv_usage,
        kv_capacity_tokens=capacity,
        inflight=inflight,
    )


# ---------------------------------------------------------------------------- the audit, pure
def test_a_discrepancy_is_what_an_engine_holds_beyond_the_routers_leases_or_kv_with_nothing_in_flight():
    assert discrepancy(2, stats(2, 0.3), sole_router=True) == Discrepancy(0, 0)
    assert discrepancy(1, stats(3, 0.3), sole_router=True) == Discrepancy(2, 0)
    assert discrepancy(0, stats(0, 0.25), sole_router=True) == Discrepancy(0, 250)
    # With other routers, this one's leases say nothing about the engine's count.
    assert discrepancy(0, stats(3, 0.3), sole_router=False) == Discrepancy(0, 0)
    assert discrepancy(0, stats(0, 0.25), sole_router=False) == Discrepancy(0, 250)


def test_the_audit_warns_once_when_a_discrepancy_persists_and_rearms_when_it_clears(pd_log):
    now = [0.0]
    reported: list[tuple[str, Discrepancy]] = []
    audit = LeakAudit(warn_after_s=10, sole_router=True, report=lambda n, d: reported.append((n, d)), clock=lambda: now[0])

    def warnings() -> int:
        return sum("leak audit" in r.getMessage() for r in pd_log.records)

    audit.check("decode-0", 0, stats(1))
    now[0] = 9.0
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 0  # a moment's discrepancy is normal
    now[0] = 10.5
    audit.check("decode-0", 0, stats(1))
    now[0] = 30.0
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 1
    audit.check("decode-0", 1, stats(1))  # gone: re-armed
    now[0] = 31.0
    audit.check("decode-0", 0, stats(1))
    now[0] = 35.0
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 1  # a new episode starts its own clock
    now[0] = 41.5
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 2
    assert reported[0] == ("decode-0", Discrepancy(1, 0)) and reported[4] == ("decode-0", Discrepancy(0, 0))
    # The engine leaves mid-discrepancy: its gauges go to zero (not its last discrepancy, shown
    # for good) and its clock is dropped, so an engine of that name later starts afresh.
    audit.forget("decode-0")
    assert reported[-1] == ("decode-0", Discrepancy(0, 0))
    now[0] = 100.0
    audit.check("decode-0", 0, stats(1))
    now[0] = 105.0
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 2
    now[0] = 110.5  # its own clock, from 100: a new warning (the old episode's was dropped too)
    audit.check("decode-0", 0, stats(1))
    assert warnings() == 3



# ---------------------------------------------------------------------------- in the running app
def run_with_metrics(body, app_args, tokenizer):
    metrics = recording_router_metrics()

    async def main():
        app = await App.start(app_args, tokenizer, metrics=metrics)
        try:
            await asyncio.wait_for(body(app, metrics), 30)
            await app.idle()
        finally:
            await app.stop()

    asyncio.run(main())


def test_an_injected_leak_raises_the_gauges_and_is_logged(tiny_tokenizer, pd_log):
    """The test-only seam: a request the engine holds that no router sent (as a lost abort would
    leave), and KV held by an engine with nothing in flight."""

    async def body(app, metrics):
        status, _ = await completion(app, [11, 12, 13], max_tokens=4)
        assert status == 200
        pool = app.service.pool
        await pool.refresh()
        assert metrics.leak_requests.value(engine="decode-0") == 0 and metrics.leak_kv_tokens.value(engine="decode-1") == 0

        ghost = _Sequence("ghost", [1, 2, 3], 10**6, 0, frozenset(), None, False)
        app.engines["decode-0"].runner._by_id["ghost"] = ghost  # held by the engine, by no router
        stranded = _Sequence("stranded", [7] * 40, 10**6, 0, frozenset(), None, False)
        app.engines["decode-1"].runner._running.append(stranded)  # KV in use, no request in flight
        for _ in range(8):
            await pool.refresh()
            await asyncio.sleep(0.1)
        assert metrics.leak_requests.value(engine="decode-0") == 1
        assert metrics.leak_kv_tokens.value(engine="decode-1") >= 40
        warned = [r for r in pd_log.records if "leak audit" in r.getMessage()]
        assert {r.pd_engine for r in warned} == {"decode-0", "decode-1"}, [r.getMessage() for r in warned]

        del app.engines["decode-0"].runner._by_id["ghost"]
        app.engines["decode-1"].runner._running.remove(stranded)
        await pool.refresh()
        assert metrics.leak_requests.value(engine="decode-0") == 0 and metrics.leak_kv_tokens.value(engine="decode-1") == 0

    run_with_metrics(body, args(router={"leak_warn_after_s": 0.3}), tiny_tokenizer)


def test_a_requests_time_is_split_into_engine_wait_and_the_routers_own(tiny_tokenizer):
    async def body(app, metrics):
        for stream in (False, True):
            status, _ = await completion(app, [11, 12, 13], max_tokens=20, stream=stream)
            assert status == 200
        (total_plain, total_stream) = metrics.request_time.observations(route="completions")
        waits = metrics.engine_wait.observations(route="completions")
        own = metrics.router_time.observations(route="completions")
        assert len(waits) == len(own) == 2
        for total, wait, mine in zip((total_plain, total_stream), waits, own):
            assert 0 < wait < total and 0 < mine < total
            assert wait + mine <= total + 1e-9
        # 20 decode steps of 1 ms at least: most of the time is the engines'.
        assert min(waits) >= 0.015

    run_with_metrics(body, args(mock={"decode_step_s": 0.001}), tiny_tokenizer)


def test_one_request_is_traced_across_its_attempts(tiny_tokenizer, pd_debug_log):
    """Filtering the (DEBUG) log on the client's request id tells the whole story: every attempt,
    the engines and transfers of each, the recompute, the end; and the JSON log carries the ids."""
    pd_log = pd_debug_log

    async def body(app, metrics):
        prompts = [[20 + i] * 10 for i in range(6)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=60) for p in prompts))
        assert all(status == 200 for status, _ in results)
        recomputed = [
            r.pd_request for r in pd_log.records if getattr(r, "pd_outcome", None) == "recomputed" and getattr(r, "pd_request", None)
        ]
        assert recomputed, "no recompute under this pressure"
        request_id = recomputed[0]
        assert request_id in {data["id"] for _, data in results}
        story = [r for r in pd_log.records if getattr(r, "pd_request", None) == request_id]
        attempts = sorted({r.pd_attempt for r in story if hasattr(r, "pd_attempt")})
        assert len(attempts) >= 2 and all(a.startswith(request_id + "-") for a in attempts)
        handoffs = [r for r in story if hasattr(r, "pd_transfer")]
        assert {r.pd_attempt for r in handoffs} == set(attempts)  # every attempt was disaggregated
        assert all(r.pd_transfer == r.pd_attempt and r.pd_prefill.startswith("prefill-") for r in handoffs)
        assert all(r.pd_decode.startswith("decode-") for r in handoffs)
        (end,) = [r for r in story if getattr(r, "pd_outcome", None) == "length"]
        assert end.pd_attempts == len(attempts) and "decode-" in end.pd_engines and "prefill-0" in end.pd_engines

        from ray._common.formatters import JSONFormatter

        line = json.loads(JSONFormatter().format(handoffs[0]))
        assert line["pd_request"] == request_id and line["pd_transfer"] == handoffs[0].pd_attempt

    pressure = args(router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run_with_metrics(body, pressure, tiny_tokenizer)


def test_the_end_line_names_the_prefill_engine_when_decode_finishes_before_the_prefill_call_returns(tiny_tokenizer, pd_log):
    """The prefill engine's reply can come after decode has streamed a short answer: the attempt
    then ends and cancels the call, and the request's end line still names the engine that
    computed its prompt."""

    async def body(app, metrics):
        runner = app.engines["prefill-0"].runner
        real, gate = runner.generate, asyncio.Event()

        async def reply_held(request):
            async for event in real(request):  # the push is done before its one event
                await gate.wait()
                yield event

        runner.generate = reply_held
        try:
            status, data = await completion(app, [31] * 10, max_tokens=3)
        finally:
            gate.set()
        assert status == 200 and len(data["choices"][0]["token_ids"]) == 3
        (end,) = [r for r in pd_log.records if getattr(r, "pd_request", None) == data["id"] and hasattr(r, "pd_outcome")]
        assert "prefill-0" in end.pd_engines.split(","), end.getMessage()
        assert metrics.prefill.observed == {}  # the premise: the prefill call never returned to the router

    run_with_metrics(body, args(), tiny_tokenizer)


def test_at_info_a_request_logs_its_end_and_only_the_attempts_after_its_first(tiny_tokenizer, pd_log):
    """The default level keeps the log (and the router's CPU, and every request's TTFT) to one
    line for a request that goes through at once; a request that needed more attempts still
    shows why and each attempt after the first, with its hand-off."""

    async def body(app, metrics):
        status, plain = await completion(app, [30] * 10, max_tokens=5)
        assert status == 200
        story = [r for r in pd_log.records if getattr(r, "pd_request", None) == plain["id"]]
        assert [getattr(r, "pd_outcome", None) for r in story] == ["length"], [r.getMessage() for r in story]
        assert story[0].pd_attempts == 1 and "decode-" in story[0].pd_engines and "prefill-0" in story[0].pd_engines

        prompts = [[20 + i] * 10 for i in range(6)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=60) for p in prompts))
        assert all(status == 200 for status, _ in results)
        resumed = {r.pd_request for r in pd_log.records if getattr(r, "pd_outcome", None) == "recomputed"}
        assert resumed, "no recompute under this pressure"
        for request_id in resumed:
            story = [r for r in pd_log.records if getattr(r, "pd_request", None) == request_id]
            attempts = {r.pd_attempt for r in story if hasattr(r, "pd_attempt") and not hasattr(r, "pd_outcome")}
            handoffs = {r.pd_attempt for r in story if hasattr(r, "pd_transfer")}
            (end,) = [r for r in story if getattr(r, "pd_outcome", None) == "length"]
            later = {f"{request_id}-{n}" for n in range(2, end.pd_attempts + 1)}
            assert attempts == handoffs == later, [r.getMessage() for r in story]

    pressure = args(router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run_with_metrics(body, pressure, tiny_tokenizer)


@pytest.mark.parametrize("debug", [True, False])
def test_a_decode_replica_logs_its_receive_timeline_at_debug_only(debug):
    """Once the first token of a pushed prompt reached the replica: the connector's receive
    record as one line (engines/records.receive_timeline), joined to the push by its transfer id."""
    from types import SimpleNamespace

    from serve_app.engines.decode import Decode

    record = {"outcome": "done", "frames_received": 4, "layers_received": 4, "bytes_received": 64, "armed_at": 100.0}
    record |= {"first_layer_at": 100.010, "last_layer_at": 100.040, "settled_at": 100.041}
    asked = []

    class Runner:
        async def transfer_record(self, transfer_id: str, timeout_s: float) -> dict | None:
            asked.append(transfer_id)
            return record

    # The method of the class Serve instantiates, on just what it reads of its replica.
    replica = SimpleNamespace(spec=SimpleNamespace(push_records=True), runner=Runner(), _timelines=set())

    async def first_token() -> None:
        Decode.func_or_class._log_receive(replica, "t-9", first_token_at=100.050)
        await asyncio.gather(*replica._timelines)

    with captured(logging.DEBUG if debug else logging.INFO) as handler:
        asyncio.run(first_token())
    lines = [r.getMessage() for r in handler.records if r.getMessage().startswith("transfer t-9:")]
    if not debug:
        assert lines == [] and asked == []  # nothing waited for, nothing logged
        return
    assert asked == ["t-9"] and replica._timelines == set()
    (line,) = lines
    assert "4 frames of 4 layers, 64 bytes done; first layer in +10.0 ms, last layer in +40.0 ms, settled +41.0 ms" in line
    assert "first token in the replica +50.0 ms after the receive was armed (at 100.0000, wall clock)" in line
