"""The router's async orchestration, fast: the whole app in this process on mock engines
(tests/support/inprocess.py), no Ray, no vLLM engine. Its calls to the engines go through the
Serve handle stand-ins (``engine_transport: grpc``), where faults are injected; the tests taking
the ``transport`` fixture run over both transports (the engines' own HTTP endpoints too:
test_engine_http.py has that transport's own tests). Every test ends by checking that nothing is
held anywhere: router counters and leases, engine requests, KV, relay registrations."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from serve_app.router.service import Outcome, sse_body
from serve_app.wire.protocol import KVReady
from tests.support.inprocess import (
    PROMPT,
    App,
    args,
    body_of,
    completion,
    expected,
    handle_calls,
    leased,
    long_streaming_client,
    no_callbacks,
    play,
    recording_router_metrics,
    run,
    sse_events,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# ---------------------------------------------------------------------------- the good paths
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_completion_through_every_hop(tiny_tokenizer, transport, mode):
    async def body(app: App) -> None:
        status, data = await completion(app, PROMPT, max_tokens=12)
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == expected(PROMPT, 12)
        assert data["usage"] == {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20}
        status, events = await completion(app, PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert tokens_of(events) == expected(PROMPT, 12)
        assert events[-2]["usage"]["completion_tokens"] == 12
        prefilled = len(app.engines["prefill-0"].runner.requests)
        assert prefilled == (2 if mode == "disaggregated" else 0)
        calls = handle_calls(app)
        if transport == "grpc":
            assert "generate" in calls and ("run" in calls) == (mode == "disaggregated"), calls
        else:
            assert calls == []  # every generate and run went over HTTP
            snapshot = (await app.service.engine_snapshot())["engines"]
            for name, engine in app.engines.items():  # operators see where, never the token
                assert snapshot[name]["call_endpoint"] == engine.call_server.endpoint.url
                assert engine.call_server.token not in json.dumps(snapshot)

    run(body, args(router={"mode": mode, "engine_transport": transport}), tiny_tokenizer)


def test_stream_chunks_have_the_keys_vllms_server_sets_even_where_null(tiny_tokenizer):
    """logprobs on every chunk's choice (OpenAI's too), stop_reason on every completion chunk and
    on a chat's last: a client reading choice["logprobs"] gets null, not a KeyError."""

    async def body(app: App) -> None:
        _, events = await completion(app, PROMPT, max_tokens=3, stream=True)
        choices = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
        assert choices and all({"logprobs", "finish_reason", "stop_reason"} <= c.keys() for c in choices), choices
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        _, events = await body_of(await app.service.http("chat", json.dumps(chat).encode()))
        choices = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
        assert all({"logprobs", "finish_reason"} <= c.keys() for c in choices), choices
        assert "stop_reason" in choices[-1] and choices[-1]["finish_reason"] == "length", choices[-1]

    run(body, args(), tiny_tokenizer)


def test_a_short_prompt_is_prefilled_by_its_decode_engine(tiny_tokenizer):
    """router.local_prefill_max_tokens: an attempt's prompt up to that long skips the prefill
    engine (counted as pd_fallback_total{reason=local_prefill}); a longer one does not; the output
    is the same either way."""
    metrics = recording_router_metrics()

    async def body(app: App) -> None:
        short, long = PROMPT[:4], PROMPT + PROMPT
        for prompt, prefilled in ((short, 0), (PROMPT, 0), (long, 1)):
            status, data = await completion(app, prompt, max_tokens=6)
            assert status == 200 and data["choices"][0]["token_ids"] == expected(prompt, 6)
            assert len(app.engines["prefill-0"].runner.requests) == prefilled, prompt
        assert metrics.fallback.values == {(("reason", "local_prefill"),): 2.0}

    run(body, args(router={"local_prefill_max_tokens": len(PROMPT)}), tiny_tokenizer, metrics)


def test_while_the_prefill_queue_is_full_a_prompt_is_prefilled_by_its_decode_engine(tiny_tokenizer):
    """router.local_prefill_queue_tokens: while the prefill engine holds that many of this
    router's prompt tokens, a prompt of any length is prefilled by its decode engine instead of
    waiting in line (pd_fallback_total{reason=prefill_queue}); once the queue is below the bound
    again prompts go to the prefill engine; every output is the same either way."""
    metrics = recording_router_metrics()

    async def body(app: App) -> None:
        runner = app.engines["prefill-0"].runner
        real, gate = runner.generate, asyncio.Event()

        async def held(request):
            await gate.wait()  # the first prompt stays in the prefill engine's line
            async for event in real(request):
                yield event

        runner.generate = held
        first = asyncio.ensure_future(completion(app, PROMPT, max_tokens=6))
        await wait_until(lambda: leased(app, "prefill"))
        other = PROMPT[::-1]
        status, data = await completion(app, other, max_tokens=6)  # the queue is full: decode prefills it
        assert status == 200 and data["choices"][0]["token_ids"] == expected(other, 6)
        assert not first.done() and metrics.fallback.values == {(("reason", "prefill_queue"),): 1.0}
        gate.set()
        status, data = await first
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 6)
        status, data = await completion(app, other, max_tokens=6)  # the queue is empty again
        assert status == 200 and data["choices"][0]["token_ids"] == expected(other, 6)
        assert len(real.__self__.requests) == 2 and metrics.fallback.values == {(("reason", "prefill_queue"),): 1.0}

    run(body, args(router={"local_prefill_queue_tokens": len(PROMPT)}), tiny_tokenizer, metrics)


def test_a_stream_writes_what_is_ready_together_in_one_message(tiny_tokenizer):
    """Each body message the router sends is a group of events ready together: the chat role
    delta with the first text, and the last text with the usage chunk and [DONE], which also
    ends the response (no empty last message)."""

    def messages_of(sent: list) -> list[list]:
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
        return [[b[6:] for b in m["body"].decode().split("\n\n") if b.startswith("data: ")] for m in bodies]

    async def body(app: App) -> None:
        for route, raw in (
            ("completions", {"prompt": PROMPT, "max_tokens": 12}),
            ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}),
        ):
            raw = {**raw, "stream": True, "stream_options": {"include_usage": True}}
            sent: list[dict] = []
            await play(await app.service.http(route, json.dumps(raw).encode()), sent)
            messages = messages_of(sent)
            assert all(messages), messages  # no message without an event
            *_, last_text, usage, done = messages[-1]
            assert json.loads(last_text)["choices"][0]["finish_reason"] == "length"
            assert json.loads(usage)["usage"]["completion_tokens"] == 12 and done == "[DONE]"
            if route == "chat":
                role, first_text, *_ = messages[0]
                assert json.loads(role)["choices"][0]["delta"]["role"] == "assistant"
                assert json.loads(first_text)["choices"][0]["delta"]["content"] is not None

    run(body, args(), tiny_tokenizer)


def test_the_first_chunk_leaves_before_the_items_queued_behind_it_are_read():
    """The items an engine sent while the router was busy are read without waiting on the loop
    (and so leave in one write), but never ahead of the first chunk: the loop gets a turn, in
    which the in-replica server's transport sends what it was given, before the next read."""

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        log: list[str] = []

        async def queued_batches():
            for i in range(3):
                log.append(f"read {i}")
                yield [{"choices": [{"text": str(i)}]}]  # already there: no wait

        unsent: list[str] = []

        def send() -> None:
            log.append(f"sent {len(unsent)}")
            unsent.clear()

        session = SimpleNamespace(finished=False, client_wait_s=0.0, status=200)
        async for chunk in sse_body(session, [{"choices": [{"text": "first"}]}], queued_batches(), Outcome()):  # type: ignore[arg-type]
            log.append("write")
            if not unsent:  # as CoalescingTransport: one send per loop turn, of what it was given
                loop.call_soon(send)
            unsent.append(chunk)
        await asyncio.sleep(0)
        return log

    log = asyncio.run(main())
    assert log[:3] == ["write", "sent 1", "read 0"], log
    assert log[3:] == ["write", "read 1", "write", "read 2", "write", "write", "sent 4"], log  # the rest: one send


# ---------------------------------------------------------------------------- deadlines
def test_kv_ready_deadline_retries_then_fails_with_504(tiny_tokenizer):
    async def body(app: App) -> None:
        no_callbacks(app)
        status, data = await completion(app, PROMPT)
        assert status == 504 and "timed out waiting for KVReady" in data["error"]["message"], data
        assert "3 attempts" in data["error"]["message"]

    run(
        body,
        args(router={"max_attempts": 3, "timeouts": {"kv_ready_s": 0.2, "prefill_s": 1, "first_token_s": 1, "request_s": 20}}),
        tiny_tokenizer,
    )


def test_prefill_deadline_then_the_next_attempt_succeeds(tiny_tokenizer):
    async def body(app: App) -> None:
        prefill = app.engines["prefill-0"]
        real = prefill.run
        calls = {"n": 0}

        async def hangs_once(request):
            calls["n"] += 1
            if calls["n"] == 1:
                await asyncio.Event().wait()  # past prefill_s: the first attempt is given up
            return await real(request)

        prefill.run = hangs_once
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert calls["n"] == 2

    run(body, args(router={"timeouts": {"kv_ready_s": 1, "prefill_s": 0.2, "first_token_s": 1, "request_s": 20}}), tiny_tokenizer)


def test_an_engine_whose_calls_fail_is_not_chosen_again_when_its_stats_answer(tiny_tokenizer):
    """Stats come through Serve, calls through the engine's own endpoint: an endpoint the router
    cannot reach (a loopback one, a firewalled port) fails every call while the stats say the
    engine is healthy. Marked unhealthy only until the next poll, it was chosen for about every
    other request (its score stays the lowest), each costing an attempt."""
    from serve_app.router.engine_client import EngineUnreachable

    async def body(app: App) -> None:
        broken = app.faults["decode-0"]
        broken.stream_raises_after, broken.stream_error = 0, lambda: EngineUnreachable("connection refused")
        for _ in range(10):
            status, data = await completion(app, PROMPT)
            assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
            await app.service.pool.refresh()  # as the poller does: its stats answer, healthy
        assert broken.calls.count("generate") == 1  # tried once, then left alone for its backoff
        assert app.faults["decode-1"].calls.count("generate") == 10

    colocated = args(router={"mode": "colocated", "balancer": "load"})
    run(body, colocated, tiny_tokenizer)


def test_first_token_deadline_moves_to_the_other_decode_engine(tiny_tokenizer):
    async def body(app: App) -> None:
        hung = app.faults["decode-0"]
        hung.hang = True
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        # The hung engine was tried first (else the deadline path went untested), then the other.
        assert "generate" in hung.calls and app.faults["decode-1"].calls.count("generate") >= 1

    colocated = args(router={"mode": "colocated", "timeouts": {"kv_ready_s": 1, "prefill_s": 1, "first_token_s": 0.2, "request_s": 20}})
    run(body, colocated, tiny_tokenizer)


def test_request_deadline_ends_the_response_with_504(tiny_tokenizer):
    async def body(app: App) -> None:
        for faults in app.faults.values():
            faults.hang = True
        status, data = await completion(app, PROMPT)
        assert status == 504 and data["error"]["message"] == "the request timed out", data
        for faults in app.faults.values():
            faults.hang = False

    tight = args(router={"timeouts": {"kv_ready_s": 5, "prefill_s": 5, "first_token_s": 5, "request_s": 0.3}})
    run(body, tight, tiny_tokenizer)


def test_no_decode_engine_is_waited_for_past_the_request_deadline(tiny_tokenizer):
    """While no decode engine is healthy the router waits up to kv_ready_s for one to come back,
    and no longer than the request's own deadline."""

    async def body(app: App) -> None:
        for name, faults in app.faults.items():
            faults.dead = name.startswith("decode")
        await app.service.pool.refresh()
        started = time.monotonic()
        status, data = await completion(app, PROMPT, max_tokens=5)
        took = time.monotonic() - started
        for faults in app.faults.values():
            faults.dead = False
        assert status == 504 and data["error"]["message"] == "the request timed out", data
        assert took < 5, f"request_s is 0.5 s, kv_ready_s 10 s: the response took {took:.2f} s"

    run(body, args(router={"timeouts": {"kv_ready_s": 10, "prefill_s": 10, "first_token_s": 10, "request_s": 0.5}}), tiny_tokenizer)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_request_deadline_mid_stream_ends_it_with_a_504_event(tiny_tokenizer, mode):
    """Tokens flow, then the decode engine stalls: the request's own deadline still ends it
    (the stream is read in the attempt's task then, under that deadline alone)."""

    async def body(app: App) -> None:
        app.service.warm_up()  # as a router replica does at start: the first request would pay for imports
        sent: list = []
        request = {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "return_token_ids": True}
        response = await app.service.http("completions", json.dumps(request).encode())
        client = asyncio.ensure_future(play(response, sent))
        await wait_until(lambda: len(sent) >= 4)
        for faults in app.faults.values():
            faults.hang = True
        await client
        for faults in app.faults.values():
            faults.hang = False
        events = sse_events(sent)
        assert response.status_code == 200 and tokens_of(events[:-2])
        assert events[-2]["error"] == {**events[-2]["error"], "code": 504, "message": "the request timed out"}, events[-2]
        assert events[-1] == "[DONE]"

    stalls = args(router={"mode": mode, "timeouts": {"kv_ready_s": 5, "prefill_s": 5, "first_token_s": 5, "request_s": 1.0}})
    run(body, stalls, tiny_tokenizer)


# ---------------------------------------------------------------------------- client disconnects
@pytest.mark.parametrize("phase", ["awaiting_kv", "prefilling", "decoding"])
def test_a_client_disconnect_in_each_phase_releases_everything(tiny_tokenizer, transport, phase):
    """The client leaves while its request waits for its KV, while the prefill engine holds it
    (and never answers), or while it decodes: the router cancels its engine calls (over HTTP it
    closes the connection, and the replica's endpoint cancels the call), which aborts the
    engines' requests; the idle check after the test holds every engine to it."""

    async def body(app: App) -> None:
        if phase == "awaiting_kv":
            no_callbacks(app)
        if phase == "prefilling":
            runner = app.engines["prefill-0"].runner
            real = runner.generate

            async def stuck(request):
                async for event in real(request):  # the engine holds the request ...
                    await asyncio.Event().wait()  # ... and its answer never comes
                    yield event

            runner.generate = stuck
        events: list = []
        task = asyncio.ensure_future(long_streaming_client(app, events))
        if phase == "awaiting_kv":
            await wait_until(
                lambda: leased(app, "decode") and any(e.relay.pending for n, e in app.engines.items() if n.startswith("decode"))
            )
        elif phase == "prefilling":
            await wait_until(lambda: leased(app, "prefill") and app.engines["prefill-0"].runner.stats().inflight)
        else:
            await wait_until(lambda: len(events) >= 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    # Slow enough that a stream left running would still hold its engine at the idle check.
    run(body, args(router={"engine_transport": transport}, mock={"decode_step_s": 0.005}), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_from_the_direct_http_server_before_any_token_releases_everything(tiny_tokenizer, stream):
    """uvicorn does not cancel a handler whose client left: a non-streamed request (while it
    decodes) and a streamed one before its first token (its decode engine never reports its KV
    ready) end when the ASGI server reports the disconnect, not at their end or deadline."""
    from serve_app.router.direct_http import openai_app

    async def body(app: App) -> None:
        if stream:
            no_callbacks(app)
        raw = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "stream": stream}).encode()
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        call = asyncio.ensure_future(openai_app(app.service)(scope, receive, send))
        if stream:
            await wait_until(lambda: any(e.relay.pending for n, e in app.engines.items() if n.startswith("decode")))
        else:
            await wait_until(lambda: app.engines["decode-0"].runner.stats().inflight)
            await asyncio.sleep(0.05)  # decoding
        gone.set()
        await asyncio.wait_for(call, 2)  # 2,000 tokens at 5 ms each would take 10 s
        assert sent[0]["status"] == 499 and not call.exception()

    run(body, args(mock={"decode_step_s": 0.005}), tiny_tokenizer)


def test_closing_an_attempt_cancels_a_prefill_call_whose_task_never_ran():
    """The decode engine can start leaving in the very turn its attempt starts the prefill call;
    the attempt then ends as a move, and is closed, before the call's task runs once. Cancelling
    that task alone would leave the call (already sent) running on the prefill engine."""
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.balancer import EngineLoad
    from serve_app.router.cdcp import AttemptRun
    from serve_app.router.pool import EnginePool
    from serve_app.router.recompute import AttemptPlan

    class Call:
        cancelled = False

        def __await__(self):
            return asyncio.Event().wait().__await__()  # never answers

        def cancel(self) -> None:
            self.cancelled = True

    class Stream:
        def cancel(self) -> None:
            pass

    async def main() -> None:
        pool = EnginePool({})
        pool.loads["prefill-0"] = EngineLoad(name="prefill-0", role="prefill", healthy=True)
        call = Call()
        executor = SimpleNamespace(pool=pool, timeouts=TimeoutsConfig(), metrics=None)
        attempt = AttemptRun(executor, AttemptPlan("r-1", 1, PROMPT, 4, True), "decode-0", Stream())
        with mock.patch.object(pool, "start_prefill", return_value=call):
            attempt._start_prefill(pool.loads["prefill-0"], {"request_id": "r-1"})
        assert pool.loads["prefill-0"].inflight == 1
        await attempt.close()  # no turn of the loop in between
        assert call.cancelled and pool.loads["prefill-0"].inflight == 0

    asyncio.run(main())


def one_decode_one_prefill(prefill_s: float) -> tuple[Any, SimpleNamespace]:
    """A pool of decode-0 (its KV endpoint known, for KVReady's check) and prefill-0, and the
    part of an ``AttemptExecutor`` an ``AttemptRun`` reads, picking prefill-0 at once."""
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.balancer import EngineLoad
    from serve_app.router.pool import EnginePool, Member
    from serve_app.wire.protocol import KVEndpoint

    pool = EnginePool({})
    pool.loads["prefill-0"] = EngineLoad(name="prefill-0", role="prefill", healthy=True)
    pool.members["prefill-0"] = Member("prefill-0", "prefill", None, None)
    pool.members["decode-0"] = Member("decode-0", "decode", None, None, kv_endpoint=KVEndpoint(engine_id="e", host="h", port=1))
    metrics = SimpleNamespace(kv_ready=SimpleNamespace(observe=lambda *a: None), prefill=SimpleNamespace(observe=lambda *a: None))
    executor = SimpleNamespace(pool=pool, timeouts=TimeoutsConfig(prefill_s=prefill_s), metrics=metrics, kv_ready_checks=frozenset())

    async def pick(role: str, *args: Any, **kwargs: Any) -> EngineLoad:
        return pool.loads["prefill-0"]

    executor.pick = pick
    return pool, executor


FAILS = ("call fails", "fails as the first token comes")


@pytest.mark.parametrize("how", ["outlives prefill_s", "engine leaves", *FAILS])
def test_a_prefill_call_that_ends_badly_once_tokens_flow_lets_the_decode_stream_go_on(how):
    """Tokens from the decode engine mean the prompt's KV is whole there: a prefill call that then
    outlives its deadline, whose engine starts leaving, or that fails (only its acknowledgements
    were left; also when its failure and the first token come in one turn of the loop) is let go
    (cancelled, its lease released) and the stream decodes on, instead of the attempt ending with
    a healthy stream's KV thrown away."""
    gate = asyncio.Event()  # "fails as the first token comes": opens both at once
    from serve_app.router.cdcp import AttemptFailed, AttemptRun, DeltaEvent
    from serve_app.router.recompute import AttemptPlan
    from serve_app.wire.protocol import TokenDelta

    class Call:
        cancelled = False

        def __await__(self):
            return self._answer().__await__()

        async def _answer(self):
            if how in FAILS:
                await (gate.wait() if how == FAILS[1] else asyncio.sleep(0.2))
                raise ConnectionError("the prefill engine went away")
            await asyncio.Event().wait()  # never answers

        def cancel(self) -> None:
            self.cancelled = True

    class Stream:
        cancelled = False

        def __init__(self) -> None:
            kv = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "request_id": "r-1"}
            self.items = [KVReady(kv)] + [TokenDelta([i]) for i in range(29)] + [TokenDelta([29], finish_reason="length")]

        async def __anext__(self):
            item = self.items.pop(0)
            if how == FAILS[1] and isinstance(item, TokenDelta) and item.token_ids == [0]:
                await gate.wait()
            elif not isinstance(item, KVReady):
                await asyncio.sleep(0.02)
            if how == "engine leaves" and isinstance(item, TokenDelta) and item.token_ids == [3]:  # tokens flow: its engine leaves
                asyncio.get_running_loop().call_soon(self.pool.drain, "prefill-0")
            return item

        def cancel(self) -> None:
            self.cancelled = True

    async def main() -> None:
        pool, executor = one_decode_one_prefill(prefill_s=0.3)
        call, stream = Call(), Stream()
        stream.pool = pool
        asyncio.get_running_loop().call_later(0.1, gate.set)
        attempt = AttemptRun(executor, AttemptPlan("r-1", 1, PROMPT, 30, True), "decode-0", stream, request_deadline=time.monotonic() + 60)
        tokens, failed, at_the_end = [], [], None
        with mock.patch.object(pool, "start_prefill", return_value=call):
            try:
                with mock.patch("serve_app.router.cdcp.PREFILL_LEAVING_GRACE_S", 0.1):
                    async for event in attempt.events():
                        tokens += event.delta.token_ids if isinstance(event, DeltaEvent) else []
                        failed += [event] if isinstance(event, AttemptFailed) else []
                        if isinstance(event, DeltaEvent) and event.delta.finish_reason is not None:
                            # Let go while the stream went on (0.6 s of tokens; the call's end
                            # came by 0.3 s), not by the attempt's close below, which always does.
                            load = pool.loads.get("prefill-0")
                            at_the_end = (call.cancelled, load is None or load.inflight == 0)
            finally:
                await attempt.close()
        assert tokens == list(range(30)) and not failed and attempt.phase.value == "decoding", (tokens, failed)
        assert at_the_end == (how not in FAILS, True)

    asyncio.run(main())


@pytest.mark.parametrize(("grace_s", "breaks", "kind"), [(0.05, False, "moved"), (5.0, False, "timeout"), (5.0, True, "moved")])
def test_a_prefill_engine_that_leaves_during_its_call_is_a_move_only_if_its_grace_ends_first(grace_s, breaks, kind):
    """A leaving prefill engine's call gets a grace; if ``prefill_s`` runs out first, the attempt
    timed out (counted against max_attempts), it was not moved. A call that breaks within the
    grace (its replica stopped) is a move, as a decode stream that breaks while its engine leaves."""
    from serve_app.router.cdcp import AttemptFailed, AttemptRun
    from serve_app.router.recompute import AttemptPlan

    class Call:
        def __await__(self):
            return self._answer().__await__()

        async def _answer(self) -> None:
            if breaks:
                await asyncio.sleep(0.05)
                raise ConnectionError("the prefill replica was stopped")
            await asyncio.Event().wait()  # never answers

        def cancel(self) -> None:
            pass

    class Stream:
        sent = False

        async def __anext__(self):
            if not self.sent:
                self.sent = True
                return KVReady({"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "request_id": "r-1"})
            await asyncio.Event().wait()  # no token: the prefill call is what the attempt waits for

        def cancel(self) -> None:
            pass

    async def main() -> AttemptFailed:
        pool, executor = one_decode_one_prefill(prefill_s=0.4)
        attempt = AttemptRun(executor, AttemptPlan("r-1", 1, PROMPT, 4, True), "decode-0", Stream(), request_deadline=time.monotonic() + 60)
        grace = mock.patch("serve_app.router.cdcp.PREFILL_LEAVING_GRACE_S", grace_s)

        def start_prefill(*args: Any, **kwargs: Any) -> Call:
            asyncio.get_running_loop().call_soon(pool.drain, "prefill-0")  # it leaves as its call starts
            return Call()

        with mock.patch.object(pool, "start_prefill", side_effect=start_prefill), grace:
            try:
                events = [event async for event in attempt.events()]
            finally:
                await attempt.close()
        return events[-1]

    failed = asyncio.run(main())
    assert isinstance(failed, AttemptFailed) and failed.kind == kind, failed


def test_waiting_for_a_prefill_engine_ends_at_the_deadline_given_or_when_told_to_give_up():
    """After KVReady with no prefill engine healthy, the wait for one is bounded by what is left
    of the attempt's deadlines, and ends as soon as its decode engine starts leaving."""
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.balancer import EngineLoad
    from serve_app.router.cdcp import AttemptExecutor
    from serve_app.router.pool import EnginePool

    async def main() -> None:
        pool = EnginePool({})
        pool.loads["prefill-0"] = EngineLoad(name="prefill-0", role="prefill", healthy=False)
        executor = AttemptExecutor(pool, TimeoutsConfig(kv_ready_s=30.0), recording_router_metrics())
        with mock.patch.object(pool, "refresh", mock.AsyncMock()):
            started = time.monotonic()
            assert await executor.pick("prefill", frozenset(), wait_s=0.3) is None
            assert time.monotonic() - started < 2
            leaving = False

            async def leave_soon() -> None:
                nonlocal leaving
                await asyncio.sleep(0.3)
                leaving = True

            started = time.monotonic()
            asyncio.ensure_future(leave_soon())
            assert await executor.pick("prefill", frozenset(), give_up=lambda: leaving) is None
            assert time.monotonic() - started < 2

    asyncio.run(main())


def test_waiting_for_an_engine_is_not_held_past_its_deadline_by_a_hung_stats_poll():
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.balancer import EngineLoad
    from serve_app.router.cdcp import AttemptExecutor
    from serve_app.router.pool import EnginePool

    async def hung_poll(*args: Any) -> None:
        await asyncio.sleep(10)  # an engine whose stats do not answer: the poll's own timeout is longer

    async def main() -> float:
        pool = EnginePool({})
        pool.loads["prefill-0"] = EngineLoad(name="prefill-0", role="prefill", healthy=False)
        executor = AttemptExecutor(pool, TimeoutsConfig(kv_ready_s=30.0), recording_router_metrics())
        with mock.patch.object(pool, "refresh", hung_poll):
            started = time.monotonic()
            assert await executor.pick("prefill", frozenset(), wait_s=0.3) is None
            return time.monotonic() - started

    assert asyncio.run(main()) < 4  # 0.3 s asked for; the poll alone would hold it 10 s


def test_closing_an_attempt_keeps_the_callers_own_cancellation():
    """A client's cancellation that lands while ``close`` waits for the attempt's cancelled read
    still reaches the caller (which would otherwise go on to its next attempt for nobody), and
    the decode stream is cancelled all the same."""
    from serve_app.config.settings import TimeoutsConfig
    from serve_app.router.cdcp import AttemptRun
    from serve_app.router.pool import EnginePool
    from serve_app.router.recompute import AttemptPlan

    class Stream:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # its cancellation takes a while to finish
            raise

    async def main() -> None:
        executor = SimpleNamespace(pool=EnginePool({}), timeouts=TimeoutsConfig(), metrics=None)
        stream = Stream()
        attempt = AttemptRun(executor, AttemptPlan("r-1", 1, PROMPT, 4, True), "decode-0", stream)
        attempt.next_item = asyncio.ensure_future(slow_to_stop())
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(attempt.close())
        await asyncio.sleep(0.05)
        closing.cancel()  # the client leaves meanwhile
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert stream.cancelled

    asyncio.run(main())


def test_a_handle_stream_closed_early_releases_everything(tiny_tokenizer):
    async def body(app: App) -> None:
        stream = app.service.generate({"prompt": PROMPT, "max_tokens": 2000})
        got = [await anext(stream) for _ in range(3)]
        assert all("choices" in e for e in got)
        await stream.aclose()

    run(body, args(), tiny_tokenizer)


def test_the_router_replicas_handle_stream_cancelled_by_serve_releases_its_request_at_once(tiny_tokenizer):
    """The caller of ``handle.options(stream=True).generate`` goes: Serve throws a cancellation
    into the replica's generator at its ``yield``. The request's engine calls and leases are
    released before that returns, not whenever the inner generator is collected."""
    from serve_app.router.deployment import Router

    async def body(app: App) -> None:
        replica = SimpleNamespace(service=app.service)  # all the method reads of its replica
        stream = Router.func_or_class.generate(replica, {"prompt": PROMPT, "max_tokens": 2000})
        assert "choices" in await anext(stream)
        assert leased(app, "decode")
        with pytest.raises(asyncio.CancelledError):
            await stream.athrow(asyncio.CancelledError())
        assert not leased(app, "decode") and not leased(app, "prefill")

    run(body, args(), tiny_tokenizer)


def test_a_handle_request_gets_the_errors_an_http_request_gets(tiny_tokenizer):
    """Not an object, or larger than router.http.max_body_bytes as JSON: the OpenAI error body
    HTTP sends (400, 413), returned or yielded, never a raw exception."""

    async def body(app: App) -> None:
        for request, status in (([1, 2], 400), ("hi", 400), ({"prompt": "x" * 20000, "max_tokens": 1}, 413)):
            answer = await app.service.complete(request)
            assert answer["error"]["code"] == status, (request, answer)
            events = [event async for event in app.service.generate(request)]
            assert len(events) == 1 and events[0]["error"]["code"] == status, (request, events)

    run(body, args(router={"http": {"max_body_bytes": 16384}}), tiny_tokenizer)


@pytest.mark.parametrize("n", [1, 2])
def test_a_bug_of_ours_mid_response_ends_it_with_an_openai_error_and_releases_everything(tiny_tokenizer, n):
    """Framing fails at a stream's third group or a whole response (a bug of ours, e.g. in a reply parser): over
    HTTP a stream ends with a 500 error event and ``[DONE]`` (as vLLM's server ends one), a
    whole response is a 500 OpenAI error body, not Starlette's plain text; over the handle API
    the same events and body, never an exception raised into the caller; nothing is held."""
    from serve_app.router.framing import ResponseFramer

    chunks = ResponseFramer.chunks
    calls = 0

    def failing(self: ResponseFramer, emission: Any) -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a bug of ours")
        return chunks(self, emission)

    def final(self: ResponseFramer, **_: Any) -> dict[str, Any]:
        raise RuntimeError("a bug of ours")

    async def body(app: App) -> None:
        nonlocal calls
        raw = {"prompt": PROMPT, "max_tokens": 40, "n": n, "temperature": 0 if n == 1 else 1.0}
        for stream in (True, False):
            calls = 0
            status, got = await body_of(await app.service.http("completions", json.dumps({**raw, "stream": stream}).encode()))
            if stream:
                assert status == 200 and got[-1] == "[DONE]", got
                assert got[-2]["error"]["code"] == 500 and all("error" not in event for event in got[:-2]), got
            else:
                assert status == 500 and got["error"]["code"] == 500 and got["error"]["type"] == "internal_error", got
            calls = 0
            events = [event async for event in app.service.generate({**raw, "stream": True})]
            assert events[-1]["error"]["code"] == 500 and all("error" not in event for event in events[:-1]), events
            calls = 0
            answer = await app.service.complete(raw)
            assert answer["error"]["code"] == 500, answer
        assert metrics.requests.value(route="completions", status="500") == 6  # each counted once
        await wait_until(lambda: not leased(app, "decode") and not leased(app, "prefill"))

    metrics = recording_router_metrics()
    with mock.patch.object(ResponseFramer, "chunks", failing), mock.patch.object(ResponseFramer, "final", final):
        run(body, args(), tiny_tokenizer, metrics)


def test_a_bug_of_ours_after_a_streams_last_group_leaves_the_whole_answer_to_the_client(tiny_tokenizer):
    """What runs after the last group (an attempt's bookkeeping) fails: the client already has
    the whole answer; the stream ends as usual, with no error event that would make a client
    throw the answer away, and the request counts as served."""
    from serve_app.router.session import ResponseSession

    def failing(self: ResponseSession, *_: Any) -> None:
        raise RuntimeError("a bug of ours")

    async def body(app: App) -> None:
        raw = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True, "stream": True}
        raw["stream_options"] = {"include_usage": True}
        status, got = await body_of(await app.service.http("completions", json.dumps(raw).encode()))
        assert status == 200 and got[-1] == "[DONE]" and all("error" not in event for event in got[:-1]), got
        assert tokens_of(got) == expected(PROMPT, 12) and got[-2]["usage"]["completion_tokens"] == 12
        events = [event async for event in app.service.generate(raw)]
        assert all("error" not in event for event in events) and events[-1]["usage"]["completion_tokens"] == 12, events
        assert metrics.requests.value(route="completions", status="200") == 2
        await wait_until(lambda: not leased(app, "decode") and not leased(app, "prefill"))

    metrics = recording_router_metrics()
    with mock.patch.object(ResponseSession, "_observe_end", failing):
        run(body, args(), tiny_tokenizer, metrics)


# ---------------------------------------------------------------------------- engine faults
def test_a_dead_prefill_engine_falls_back_to_colocated(tiny_tokenizer):
    async def body(app: App) -> None:
        app.faults["prefill-0"].dead = True
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert not app.service.pool.loads["prefill-0"].healthy
        status, data = await completion(app, PROMPT + [1])  # no healthy prefill: served colocated
        assert status == 200
        assert app.faults["prefill-0"].calls.count("run") == 1

    run(body, args(), tiny_tokenizer)


def test_a_prefill_that_raises_is_retried(tiny_tokenizer, transport):
    async def body(app: App) -> None:
        prefill = app.engines["prefill-0"]
        real = prefill.run
        calls = {"n": 0}

        async def flaky(request):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("prefill exploded")
            return await real(request)

        prefill.run = flaky
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert calls["n"] == 2

    run(body, args(router={"engine_transport": transport}), tiny_tokenizer)


@pytest.mark.parametrize("fault", ["dead", "stream_ends_after", "stream_raises_after", "stream_times_out"])
def test_a_decode_engine_lost_mid_stream_is_resumed_token_exact(tiny_tokenizer, fault):
    async def body(app: App) -> None:
        victim = app.faults["decode-0"]
        if fault == "dead":
            victim.dead = True
        elif fault == "stream_times_out":  # its transport's own timeout: an engine failure, not a deadline
            victim.stream_raises_after = 3
            victim.stream_error = lambda: TimeoutError("read timed out")
        else:
            setattr(victim, fault, 3)  # KVReady, then a couple of deltas, then gone
        status, events = await completion(app, PROMPT, max_tokens=40, stream=True)
        assert status == 200 and tokens_of(events) == expected(PROMPT, 40)
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
        assert app.faults["decode-1"].calls.count("generate") >= 1
        errors = app.service.metrics.errors
        assert errors.value(kind="decode") == 1 and errors.value(kind="timeout") is None
        assert app.service.metrics.migrations.values == {(("cause", "failure"), ("engine", "decode-0")): 1}

    run(body, args(router={"mode": "colocated"}, decode={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_no_decode_engine_at_all_is_a_503(tiny_tokenizer):
    async def body(app: App) -> None:
        for load in app.service.pool.of_role("decode"):
            load.healthy = False
        for faults in app.faults.values():
            faults.dead = True
        status, data = await completion(app, PROMPT)
        assert status == 503 and data["error"]["type"] == "service_unavailable"
        response = await app.service.health()
        assert response.status_code == 503
        for faults in app.faults.values():
            faults.dead = False
        await app.service.pool.refresh()

    run(body, args(router={"timeouts": {"kv_ready_s": 0.2, "prefill_s": 1, "first_token_s": 1, "request_s": 20}}), tiny_tokenizer)


def test_a_kv_ready_naming_another_engine_is_refused(tiny_tokenizer):
    async def body(app: App) -> None:
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                runner = engine.runner
                real = runner.endpoint
                runner.endpoint = type(real)(engine_id=real.engine_id, host=real.host, port=1)  # posts a port it does not own
        status, data = await completion(app, PROMPT)
        assert status == 502 and "KVReady for another engine" in data["error"]["message"], data

    run(body, args(router={"max_attempts": 2}), tiny_tokenizer)


def test_a_second_kv_ready_is_a_protocol_error_never_a_second_prefill(tiny_tokenizer):
    """A decode engine that sends its KVReady twice breaks the attempt's phase table
    (router/attempt_phase.py): the attempt fails as the engine's fault, and the request resumes
    on the other engine, token for token."""

    async def body(app: App) -> None:
        for name in ("decode-0", "decode-1"):
            app.faults[name].repeat_item = 1  # each engine's first stream repeats its KVReady once
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8), data
        assert app.service.metrics.errors.value(kind="protocol") == 2

    run(body, args(router={"max_attempts": 3}), tiny_tokenizer, recording_router_metrics())


def test_kv_ready_racing_the_first_token(tiny_tokenizer):
    """Prefill's call returns only well after decode has streamed tokens: the attempt reads and
    sends tokens while the call is still in flight (never holding them behind it), and ends with
    its last token, cancelling the call if it is still running."""

    async def body(app: App) -> None:
        prefill = app.engines["prefill-0"]
        real = prefill.run
        ended: dict[str, float] = {}

        async def slow_return(request):
            result = await real(request)
            try:
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                ended["cancelled"] = time.monotonic()
                raise
            ended["returned"] = time.monotonic()
            return result

        prefill.run = slow_return
        events, first_token_at = [], None
        async for event in app.service.generate({"prompt": PROMPT, "max_tokens": 30, "return_token_ids": True}):
            events.append(event)
            if first_token_at is None and tokens_of([event]):
                first_token_at = time.monotonic()
        assert tokens_of(events) == expected(PROMPT, 30)
        await wait_until(lambda: bool(ended))
        assert first_token_at is not None and first_token_at < min(ended.values()), (first_token_at, ended)

    run(body, args(), tiny_tokenizer)


def test_tokens_without_kv_ready_when_decode_needs_no_transfer(tiny_tokenizer):
    async def body(app: App) -> None:
        for name, engine in app.engines.items():
            if name.startswith("decode"):

                async def cached(seq, params):  # the whole prompt was in decode's prefix cache
                    seq.cached_tokens = len(seq.prompt)

                engine.runner._await_kv = cached
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert "run" not in app.faults["prefill-0"].calls

    run(body, args(), tiny_tokenizer)


def test_an_engine_rejection_is_a_400_and_not_retried(tiny_tokenizer, transport):
    from serve_app.wire.protocol import EngineRejected

    async def body(app: App) -> None:
        rejected: list = []
        for name, engine in app.engines.items():
            if name.startswith("decode"):

                async def reject(request):
                    rejected.append(request)
                    yield EngineRejected("token id 5000 is out of vocabulary")

                engine.runner.generate = reject
        status, data = await completion(app, PROMPT)
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
        assert "out of vocabulary" in data["error"]["message"], data
        assert len(rejected) == 1  # one engine call: a rejection is not retried elsewhere
        if transport == "grpc":
            assert handle_calls(app).count("generate") == 1

    run(body, args(router={"mode": "colocated", "engine_transport": transport}), tiny_tokenizer)


# ---------------------------------------------------------------------------- recompute
def test_recompute_under_kv_pressure_through_the_session(tiny_tokenizer):
    async def body(app: App) -> None:
        prompts = [[20 + i] * 10 for i in range(6)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=60, stream=bool(i % 2)) for i, p in enumerate(prompts)))
        recomputed = 0
        for i, (status, data) in enumerate(results):
            assert status == 200
            got = tokens_of(data) if i % 2 else data["choices"][0]["token_ids"]
            assert got == expected(prompts[i], 60), i
        for engine in app.engines.values():
            recomputed += sum(1 for r in engine.runner.requests.values() if r.get("stop_reason") == "recomputed")
        assert recomputed > 0
        # Every later attempt tells its decode engine how much of its prompt is earlier output.
        records = {rid: r for engine in app.engines.values() for rid, r in engine.runner.requests.items()}
        for rid, record in records.items():
            request, number = rid.rsplit("-", 1)
            earlier = record["prompt_tokens"] - records[f"{request}-1"]["prompt_tokens"]
            assert record.get("resumed_output_tokens", 0) == earlier and (earlier > 0) == (number != "1"), (rid, record)
        migrations = app.service.metrics.migrations.values
        assert {tags for tags in migrations} <= {(("cause", "kv_full"), ("engine", name)) for name in app.engines}
        assert sum(migrations.values()) == recomputed == app.service.metrics.recompute.value()

    pressure = args(router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run(body, pressure, tiny_tokenizer, recording_router_metrics())


# ---------------------------------------------------------------------------- routes and framing
def test_chat_and_completions_with_logprobs_stream_and_not(tiny_tokenizer):
    async def body(app: App) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        for stream in (False, True):
            raw = {"messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 1, "stream": stream, "return_token_ids": True}
            status, data = await body_of(await app.service.http("chat", json.dumps(raw).encode()))
            assert status == 200
            if stream:
                roles = [e["choices"][0]["delta"].get("role") for e in data if isinstance(e, dict) and e["choices"]]
                assert roles.count("assistant") == 1
                assert (
                    sum(
                        len(e["choices"][0]["logprobs"]["content"])
                        for e in data
                        if isinstance(e, dict) and e["choices"] and e["choices"][0].get("logprobs")
                    )
                    == 6
                )
            else:
                assert len(data["choices"][0]["logprobs"]["content"]) == 6 and data["choices"][0]["message"]["role"] == "assistant"
            raw = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 1, "stream": stream}
            status, data = await body_of(await app.service.http("completions", json.dumps(raw).encode()))
            assert status == 200
            chunks = data if stream else [data]
            assert (
                sum(
                    len(c["choices"][0]["logprobs"]["tokens"])
                    for c in chunks
                    if isinstance(c, dict) and c["choices"] and c["choices"][0].get("logprobs")
                )
                == 6
            )

    run(body, args(), tiny_tokenizer)


def test_bad_requests_and_internal_errors_get_openai_errors(tiny_tokenizer, monkeypatch):
    import serve_app.router.service as service

    async def body(app: App) -> None:
        status, data = await body_of(await app.service.http("completions", b"{not json"))
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
        status, data = await body_of(await app.service.http("chat", json.dumps({"messages": []}).encode()))
        assert status == 400 and data["error"]["param"] == "messages"
        assert (await app.service.complete({"prompt": PROMPT, "n": 0}))["error"]["param"] == "n"
        events = [e async for e in app.service.generate({"messages": "nope"})]
        assert len(events) == 1 and events[0]["error"]["code"] == 400

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(service, "parse_request", broken)
        status, data = await body_of(await app.service.http("completions", json.dumps({"prompt": "x"}).encode()))
        assert status == 500 and data["error"]["type"] == "internal_error"

    run(body, args(), tiny_tokenizer)


def test_a_failure_before_the_first_token_is_a_plain_error_response_even_when_streaming(tiny_tokenizer):
    async def body(app: App) -> None:
        no_callbacks(app)
        status, data = await completion(app, PROMPT, stream=True)
        assert status == 504 and data["error"]["code"] == 504

    run(
        body,
        args(router={"max_attempts": 1, "timeouts": {"kv_ready_s": 0.1, "prefill_s": 1, "first_token_s": 1, "request_s": 20}}),
        tiny_tokenizer,
    )


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(tiny_tokenizer):
    async def body(app: App) -> None:
        for faults in app.faults.values():
            faults.stream_raises_after = 3
        status, events = await completion(app, PROMPT, max_tokens=100, stream=True)
        assert status == 200
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 502 and "2 attempts" in errors[0]["error"]["message"]
        assert events[-1] == "[DONE]"

    run(body, args(router={"mode": "colocated", "max_attempts": 2}), tiny_tokenizer)


def test_handle_api_complete_and_generate(tiny_tokenizer):
    async def body(app: App) -> None:
        final = await app.service.complete({"prompt": PROMPT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
        assert final["usage"]["completion_tokens"] == 5 and final["object"] == "text_completion"
        events = [e async for e in app.service.generate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": False})]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    run(body, args(), tiny_tokenizer)


def test_models_health_snapshot_and_warm_up(tiny_tokenizer):
    async def body(app: App) -> None:
        service = app.service
        service.warm_up()
        assert [m["id"] for m in service.models()["data"]] == ["tiny-llama"]
        ok = await service.health()
        assert ok.status_code == 200 and json.loads(ok.body) == {"status": "ok"}
        snap = await service.engine_snapshot()
        assert snap["engines"]["decode-0"]["kv_endpoint"]["engine_id"] == "decode-0"
        service.start()
        await asyncio.sleep(0.05)  # the poller runs
        for load in service.pool.of_role("decode"):
            load.healthy = False

        async def why() -> dict[str, str]:
            return {"decode": "DEPLOY_FAILED: KV port 36016 is in use by pid 1 (x)", "router": "HEALTHY"}

        service.engine_status = why
        service.pool.refresh = _never  # keep the engines marked down for this check
        bad = await service.health()
        message = json.loads(bad.body)["error"]["message"]
        assert bad.status_code == 503 and "decode: DEPLOY_FAILED: KV port 36016" in message and "router" not in message

        async def broken() -> dict[str, str]:
            raise RuntimeError("controller unreachable")

        service.engine_status = broken
        assert (await service.health()).status_code == 503
        service.stop()
        del service.pool.refresh
        await service.pool.refresh()

    run(body, args(), tiny_tokenizer)


async def _never() -> None:
    return None


def test_the_router_serves_the_openai_api_itself(tiny_tokenizer):
    """router.http: the same routes as the Serve ingress, straight from the router replica."""
    import httpx

    from serve_app.router.direct_http import openai_app

    async def body(app: App) -> None:
        transport = httpx.ASGITransport(app=openai_app(app.service))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tiny-llama"
            assert "decode-0" in (await client.get("/pd/engines")).json()["engines"]
            done = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True})
            assert done.status_code == 200 and done.json()["choices"][0]["token_ids"] == expected(PROMPT, 5)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            assert response.status_code == 200 and lines[-1] == "data: [DONE]"
            missing = await client.get("/v1/nothing")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
            wrong = await client.get("/v1/completions")
            assert wrong.status_code == 405 and wrong.json()["error"]["type"]

    run(body, args(), tiny_tokenizer)


def test_the_serve_ingress_and_the_routers_own_server_have_the_same_routes(tiny_tokenizer):
    """Serve's proxy (the Router deployment's FastAPI app) and router.http answer the same paths
    and methods, nothing more (no OpenAPI page on either)."""
    from serve_app.router.deployment import http_app
    from serve_app.router.direct_http import openai_app

    async def body(app: App) -> None:
        def routes(asgi: Any) -> set[tuple[str, frozenset[str]]]:
            return {(route.path, frozenset(route.methods - {"HEAD"})) for route in asgi.routes}  # (Starlette adds HEAD to GET)

        direct = routes(openai_app(app.service))
        assert routes(http_app) == direct
        assert {path for path, _ in direct} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"}

    run(body, args(), tiny_tokenizer)


def test_an_in_replica_server_listens_and_stops():
    """The socket helper shares a port between replicas (SO_REUSEPORT) and the server stops."""
    import socket as socket_module

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from serve_app.runtime.http_server import InReplicaServer, listening_socket

    async def main() -> None:
        app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
        first = listening_socket("127.0.0.1", 0, reuse_port=True)
        port = first.getsockname()[1]
        second = listening_socket("127.0.0.1", port, reuse_port=True)  # a second replica, same port
        servers = [InReplicaServer(app, first), InReplicaServer(app, second)]
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        for server in servers:
            await server.stop()
        with pytest.raises(OSError), socket_module.create_connection(("127.0.0.1", port), timeout=1):
            pass

    asyncio.run(main())


# Python's own finalizer calls the wrapper's async __del__ too when the test drops the replica.
@pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited:RuntimeWarning")
def test_serve_awaits_a_stopping_router_replicas_drain():
    """What Serve runs when it stops a router replica is serve.ingress's wrapper, whose destructor
    awaits the router's only if that is a coroutine function (Ray Serve 2.60): a destructor that
    returned its drain as a coroutine had it dropped, and the replica was killed with its
    responses in progress. The drain runs whole: the HTTP server, then the service."""
    from serve_app.config.settings import load_config
    from serve_app.router.deployment import ROUTER_SHUTDOWN_MARGIN_S, Router

    stopped: list[tuple[Any, ...]] = []

    class HTTP:
        async def stop(self, timeout_s: float) -> None:
            await asyncio.sleep(0.01)
            stopped.append(("http", timeout_s))

    class Service:
        config = load_config({"router": {"graceful_shutdown_timeout_s": 20}})

        def stop(self) -> None:
            stopped.append(("service",))

    replica = object.__new__(Router.func_or_class)  # the class Serve instantiates
    replica.http, replica.service = HTTP(), Service()
    asyncio.run(replica.__del__())
    assert stopped == [("http", 20 - ROUTER_SHUTDOWN_MARGIN_S), ("service",)]
    del replica
    gc.collect()  # here, under this test's filter


# ---------------------------------------------------------------------------- a pool shrinking (drain)
async def busy_decode(app: App, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, load in app.service.pool.loads.items():
            if load.role == "decode" and load.inflight and app.engines[name].runner.stats().num_running:
                return name
        await asyncio.sleep(0.002)
    raise AssertionError("no decode engine busy")


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_stopping_decode_engine_hands_its_streams_to_another_token_exact(tiny_tokenizer, mode):
    """Serve stops a decode replica (its replica leaves the list): the attempts streaming from it
    move to the other decode engine through the recompute path; the client sees one response,
    the same tokens as without the move; a move is no error and costs no attempt."""

    async def body(app: App) -> None:
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=300, stream=True))
        victim = await busy_decode(app)
        await asyncio.sleep(0.02)  # some tokens have flowed
        app.service.pool.drain(victim)
        status, events = await request
        assert status == 200 and tokens_of(events) == expected(PROMPT, 300)
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
        metrics = app.service.metrics
        assert metrics.migrations.values == {(("cause", "drain"), ("engine", victim)): 1} and not metrics.errors.values
        assert victim not in app.service.pool.loads  # forgotten once nothing is held on it
        # Nothing new goes to it: the next request runs on the other engine alone.
        calls = len(app.faults[victim].calls)
        assert (await completion(app, PROMPT, max_tokens=4))[0] == 200
        assert len(app.faults[victim].calls) == calls

    run(body, args(router={"mode": mode, "max_attempts": 1}, decode={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_a_prefill_engine_that_leaves_without_answering_its_call_hands_the_prompt_to_another(tiny_tokenizer):
    """Serve stops the prefill replica an attempt's call waits on, and the replica never answers
    (it died: a call pinned to it through Serve's handle waits in Serve's queue). After a short
    grace the attempt resumes with the other prefill engine, as a move, not at prefill_s as a
    failure; the decode engine's blocks are not held meanwhile."""

    async def body(app: App) -> None:
        prefills = [name for name in app.engines if name.startswith("prefill")]
        for name in prefills:  # whichever the balancer picks never answers
            app.faults[name].hang = True
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=8))
        await wait_until(lambda: leased(app, "prefill"))
        (victim,) = [load.name for load in app.service.pool.of_role("prefill") if load.inflight]
        for name in prefills:
            app.faults[name].hang = name == victim
        started = time.monotonic()
        app.service.pool.drain(victim)
        status, data = await request
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8), data
        assert time.monotonic() - started < 10, "the attempt waited for prefill_s (20 s)"
        app.faults[victim].hang = False

    timeouts = {"kv_ready_s": 5, "prefill_s": 20, "first_token_s": 20, "request_s": 60}
    router = {"engine_transport": "grpc", "max_attempts": 1, "timeouts": timeouts}
    with mock.patch("serve_app.router.cdcp.PREFILL_LEAVING_GRACE_S", 0.5):
        run(body, args(router=router, prefill={"num_replicas": 2}), tiny_tokenizer)


def test_with_no_other_decode_engine_a_moved_request_fails_with_a_503_not_a_hang(tiny_tokenizer):
    async def body(app: App) -> None:
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=300))
        victim = await busy_decode(app)
        app.service.pool.drain(victim)
        status, response = await request  # waits up to kv_ready_s (2 s here) for a decode engine
        assert status == 503 and "no decode engine" in response["error"]["message"]

    run(body, args(router={"mode": "colocated"}, decode={"num_replicas": 1}), tiny_tokenizer)


def test_a_decode_replica_serve_stops_ends_its_streams_as_moved_and_the_router_resumes_them(tiny_tokenizer):
    """The engine's side of a drain, for when Serve's list of running replicas drops the replica
    late: its destructor (which Serve calls when stopping it) ends each stream at its next output
    with stop_reason 'moved', and answers a new call so at once; the router resumes the request on
    the other engine, token for token, and chooses the stopping one for nothing new."""

    async def body(app: App) -> None:
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=300, stream=True))
        victim = await busy_decode(app)
        await asyncio.sleep(0.02)
        # As the app builds a replica: its drain is bounded by the deployment's graceful shutdown
        # (the in-process engines are built with none, so they stop at once at the test's end).
        app.engines[victim].drain_s = 10.0
        stopping = asyncio.ensure_future(app.engines[victim].__del__())
        status, events = await request
        assert status == 200 and tokens_of(events) == expected(PROMPT, 300)
        assert len({e["id"] for e in events if isinstance(e, dict)}) == 1
        metrics = app.service.metrics
        assert metrics.migrations.values == {(("cause", "drain"), ("engine", victim)): 1} and not metrics.errors.values
        assert victim not in app.service.pool.loads
        # pd_pool_replicas follows the drain at once, before Serve's list of replicas drops it.
        assert metrics.pool_replicas.values == {(("role", "decode"),): 1}
        assert app.engines[victim].runner.stats().inflight == 0
        # It stops once nothing is in flight and no call has come for a while: well before its
        # drain bound (10 s), which would end it with requests still held.
        await asyncio.wait_for(stopping, 5)
        assert app.engines[victim]._stopped

    app_args = args(router={"mode": "disaggregated", "max_attempts": 1}, decode={"num_replicas": 2})
    run(body, app_args, tiny_tokenizer, recording_router_metrics())


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_call_still_running_at_its_replicas_drain_deadline_ends_as_a_move(tiny_tokenizer, role):
    """The drain's deadline aborts what the replica still holds, and the router resumes the
    request elsewhere as a move (no attempt spent, no error). Decode: a stream still without
    output (waiting for a slow prefill's KV), which the engine's stop ended never (it waited for
    output until the process was killed). Prefill: the prompt it still computes, which was a
    failed call."""

    async def body(app: App) -> None:
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=20))
        deadline = time.monotonic() + 5
        # Once the prefill runs: the decode engine has said where the KV goes, and waits for it.
        while not any(e.runner.held() for n, e in app.engines.items() if n.startswith("prefill")):
            assert time.monotonic() < deadline, "no prefill engine took the request"
            await asyncio.sleep(0.005)
        (victim,) = [n for n, e in app.engines.items() if n.startswith(role) and e.runner.held()]
        app.engines[victim].drain_s = 0.2  # well before the prefill ends (about 1 s)
        stopping = asyncio.ensure_future(app.engines[victim].__del__())
        status, data = await asyncio.wait_for(request, 30)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 20)
        metrics = app.service.metrics
        assert metrics.migrations.values == {(("cause", "drain"), ("engine", victim)): 1} and not metrics.errors.values
        await asyncio.wait_for(stopping, 5)
        assert app.engines[victim].runner.held() == []

    slow_prefill = args(
        router={"mode": "disaggregated", "max_attempts": 1, "local_prefill_max_tokens": 0},
        prefill={"num_replicas": 2},
        decode={"num_replicas": 2},
        mock={"decode_step_s": 0.001, "prefill_s_per_token": 0.12},
    )
    run(body, slow_prefill, tiny_tokenizer, recording_router_metrics())


def test_prefix_routing_keeps_each_prefix_on_one_prefill_and_one_decode_engine(tiny_tokenizer):
    """router.balancer: prefix through the whole schedule: both choices (decode first, then
    prefill) follow the prompt's prefix, outputs are unchanged, and the router counts the prompt
    tokens it expected the chosen engines to hold."""
    from serve_app.router.prefix_index import chain_keys, rendezvous

    block = 16
    # Four prefixes the rule places two and two on either role's engines, so that the bound
    # (router.prefix.max_imbalance) never moves one: that is tests/unit/test_prefix_routing.py's.
    prefixes = [[100 + 7 * p + i % 5 for i in range(4 * block)] for p in (0, 1, 3, 10)]

    async def body(app: App) -> None:
        served: dict[int, set[tuple[str, str]]] = {p: set() for p in range(len(prefixes))}
        for turn in range(3):
            for p, prefix in enumerate(prefixes):
                prompt = prefix + [500 + turn, 600 + p]
                before = {name: list(f.calls) for name, f in app.faults.items()}
                status, data = await completion(app, prompt)
                assert status == 200 and data["choices"][0]["token_ids"] == expected(prompt, 8)
                call = {"decode": "generate", "prefill": "run"}
                grew = [n for n, f in app.faults.items() if call[n.split("-")[0]] in f.calls[len(before[n]) :]]
                decode = [n for n in grew if n.startswith("decode")]
                prefill = [n for n in grew if n.startswith("prefill")]
                assert len(decode) == 1 and len(prefill) == 1, grew
                served[p].add((decode[0], prefill[0]))
        for p, engines in served.items():
            (pair,) = engines  # one decode and one prefill engine for every request of the prefix
            first = chain_keys(prefixes[p], block)[0]
            assert pair == (rendezvous(first, ["decode-0", "decode-1"]), rendezvous(first, ["prefill-0", "prefill-1"]))
        routed = app.service.metrics.prefix_routed
        # Two requests of each prefix after its first were expected to find its 4 blocks, per role.
        assert sum(v for k, v in routed.values.items()) == 2 * len(prefixes) * 4 * block * 2

    app_args = args(prefill={"num_replicas": 2}, router={"balancer": "prefix", "prefix": {"block_tokens": block}})
    run(body, app_args, tiny_tokenizer, recording_router_metrics())


def _record_engine_requests(app: App) -> list[tuple[str, Any]]:
    """Every EngineRequest an engine is given, as (engine, request), from now on."""
    seen: list[tuple[str, Any]] = []
    for name, engine in app.engines.items():
        original = engine.runner.generate

        def generate(request: Any, _name: str = name, _original: Any = original) -> Any:
            seen.append((_name, request))
            return _original(request)

        engine.runner.generate = generate
    return seen


def test_a_cache_salt_reaches_both_engines_and_keys_the_prefix_routing(tiny_tokenizer, transport):
    """vLLM's cache_salt: the decode and the prefill engine both get it (each keys its prefix
    cache with it), and cache-aware routing keys the prompt's blocks with it as well, so a salted
    prompt goes where that salt's blocks are, not where the unsalted prompt's are."""
    from serve_app.router.prefix_index import chain_keys, rendezvous

    block = 16
    prompt = [300 + i % 7 for i in range(4 * block)] + [9]
    decodes, prefills = ["decode-0", "decode-1"], ["prefill-0", "prefill-1"]

    def home(salt: str | None) -> tuple[str, str]:
        first = chain_keys(prompt, block, cache_salt=salt)[0]
        return rendezvous(first, decodes), rendezvous(first, prefills)

    # A salt whose blocks' home differs from the unsalted prompt's in both roles: the two
    # prefixes then load each role's engines evenly, and the imbalance bound never moves one.
    def apart(s: str) -> bool:
        return all(a != b for a, b in zip(home(s), home(None)))

    salt = next((s for s in (f"tenant-{i}" for i in range(64)) if apart(s)), None)
    assert salt is not None

    async def body(app: App) -> None:
        seen = _record_engine_requests(app)
        for cache_salt in (None, salt, None, salt):
            extra = {} if cache_salt is None else {"cache_salt": cache_salt}
            before = len(seen)
            status, data = await completion(app, prompt, **extra)
            assert status == 200 and data["choices"][0]["token_ids"] == expected(prompt, 8)
            calls = seen[before:]
            assert sorted(name.split("-")[0] for name, _ in calls) == ["decode", "prefill"], calls
            assert all(request.cache_salt == cache_salt for _, request in calls), calls
            engines = {name.split("-")[0]: name for name, _ in calls}
            assert (engines["decode"], engines["prefill"]) == home(cache_salt)

    router = {"balancer": "prefix", "prefix": {"block_tokens": block}, "engine_transport": transport}
    run(body, args(prefill={"num_replicas": 2}, router=router), tiny_tokenizer)


def test_a_resumed_attempt_keeps_the_cache_salt(tiny_tokenizer):
    async def body(app: App) -> None:
        seen = _record_engine_requests(app)
        prompts = [[40 + i] * 10 for i in range(6)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=60, cache_salt=f"salt-{i}") for i, p in enumerate(prompts)))
        for i, (status, data) in enumerate(results):
            assert status == 200 and data["choices"][0]["token_ids"] == expected(prompts[i], 60), i
        resumed = [request for _, request in seen if not request.request_id.endswith("-1")]
        assert resumed, "no request was resumed: the KV pressure did not bite"
        for _, request in seen:
            # The attempt id is "<response id>-<n>"; each prompt's first ten tokens name its salt.
            assert request.cache_salt == f"salt-{request.prompt_token_ids[0] - 40}", request

    pressure = args(router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run(body, pressure, tiny_tokenizer)


def test_a_stopping_prefill_engine_hands_its_calls_back_and_is_chosen_for_nothing_new(tiny_tokenizer):
    """Serve stops a prefill replica before the router's list says so: the replica answers new
    calls 'moved' at once (it takes no prompt, and such calls do not hold off its drain), the
    router drains it and resumes the attempt on the other prefill engine, as a move."""

    async def body(app: App) -> None:
        victim = app.engines["prefill-0"]
        victim.drain_s = 10.0
        stopping = asyncio.ensure_future(victim.__del__())
        await asyncio.sleep(0)
        assert victim.draining
        for i in range(4):
            prompt = [40 + i, *PROMPT]
            status, data = await completion(app, prompt)
            assert status == 200 and data["choices"][0]["token_ids"] == expected(prompt, 8)
        assert len(victim.runner.requests) == 0  # it computed nothing
        assert len(app.engines["prefill-1"].runner.requests) == 4
        metrics = app.service.metrics
        assert metrics.migrations.values == {(("cause", "drain"), ("engine", "prefill-0")): 1} and not metrics.errors.values
        assert app.service.pool.draining("prefill-0")
        await asyncio.wait_for(stopping, 5)  # quiet well before its 10 s bound

    run(body, args(prefill={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_the_latency_signals_count_every_prefill_call_and_decode_time_per_token(tiny_tokenizer):
    """The autoscaling latencies: a prefill call that fails still counts (under overload the
    failed and cancelled calls are the slow ones), and decode's is the time per token of a
    stream's outputs, not the gap between its (paced, several-token) outputs."""

    async def body(app: App) -> None:
        prefill, decode = app.engines["prefill-0"], app.engines["decode-0"]
        original = prefill.runner.generate

        def broken(request: Any) -> Any:
            prefill.runner.generate = original  # once
            raise RuntimeError("the engine broke")

        prefill.runner.generate = broken
        prompts = [[50 + i, *PROMPT] for i in range(2)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=80, stream=True) for p in prompts))
        for prompt, (status, events) in zip(prompts, results, strict=True):
            assert status == 200 and tokens_of(events) == expected(prompt, 80)
        assert len(prefill.latency._samples) == 3  # the failed call, its retry, the other prompt
        per_token = [seconds for _, seconds in decode.latency._samples]
        # Two streams at 20 items/s between them: an output every 0.1 s or so, of about 20
        # tokens at 0.005 s each. Per token that is some milliseconds, far under the gap.
        assert len(per_token) >= 4 and max(per_token) < 0.03, per_token

    run(body, args(mock={"decode_step_s": 0.005}, stream_items_per_s=20), tiny_tokenizer)


def test_a_decode_engine_that_starts_stopping_while_an_attempt_waits_for_its_kv_moves_it_before_any_prefill(tiny_tokenizer):
    """Serve stops a decode replica between the attempt's admission and its KV parameters: the
    replica answers "moved" instead of passing the parameters on, so no prefill engine computes
    and pushes a prompt it would only cut at the first token; the attempt resumes elsewhere."""

    async def body(app: App) -> None:
        stopped: list[str] = []
        for name in ("decode-0", "decode-1"):
            engine = app.engines[name]
            original = engine._generate

            async def stopping_at_kv(request: Any, engine: Any = engine, original: Any = original, name: str = name) -> Any:
                async for event in original(request):
                    if isinstance(event, KVReady) and not stopped:
                        stopped.append(name)
                        engine.draining = True  # as Serve's stop sets it
                    yield event

            engine._generate = stopping_at_kv
        prompt = [41, *PROMPT]
        status, data = await completion(app, prompt)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(prompt, 8)
        assert stopped and len(app.engines["prefill-0"].runner.requests) == 1  # one prefill: the resumed attempt's
        metrics = app.service.metrics
        assert metrics.migrations.values == {(("cause", "drain"), ("engine", stopped[0])): 1} and not metrics.errors.values

    run(body, args(decode={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_an_engine_replica_whose_call_endpoint_or_relay_stopped_fails_its_health_check(tiny_tokenizer):
    """Serve restarts a replica whose health check fails: one whose engine is fine but whose call
    endpoint (every router call fails) or metaserver relay (every disaggregated attempt waits out
    its KV deadline) has exited must fail it too."""

    async def body(app: App) -> None:
        decode, prefill = app.engines["decode-0"], app.engines["prefill-0"]
        await decode.check_health()
        await prefill.check_health()
        for server in (decode.relay._server, prefill.call_server._server):
            server.close()
            await asyncio.wait_for(asyncio.shield(server._task), 5)
        for engine, what in ((decode, "metaserver relay"), (prefill, "call endpoint")):
            with pytest.raises(RuntimeError, match=what):
                await engine.check_health()

    run(body, args(router={"engine_transport": "http"}), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_when_a_prompts_first_sample_fails_its_other_samples_start_nothing(tiny_tokenizer, stream):
    """n > 1: the other samples wait for the first one's first token; when it fails instead, the
    response fails with it, and they must not pick an engine and open a stream meanwhile."""

    async def body(app: App) -> None:
        for name in app.faults:
            if name.startswith("decode"):
                app.faults[name].dead = True
        status, data = await completion(app, PROMPT, max_tokens=4, n=2, stream=stream)
        await asyncio.sleep(0.2)
        assert status != 200 or "error" in json.dumps(data)
        assert handle_calls(app) == ["generate"], handle_calls(app)  # the first sample's one attempt only

    run(body, args(router={"mode": "colocated", "max_attempts": 1}), tiny_tokenizer)


def test_a_router_replica_whose_http_server_stopped_fails_its_health_check():
    """Serve restarts a replica whose health check fails: a router whose own HTTP server has
    exited serves nothing on its port (with one replica, the app is down) but looked healthy.
    Stopping (its destructor closes the server) is not a failure."""
    from serve_app.router.deployment import Router

    replica = SimpleNamespace(http=SimpleNamespace(serving=True))
    Router.func_or_class.check_health(replica)
    replica.http.serving = False
    with pytest.raises(RuntimeError, match="HTTP server"):
        Router.func_or_class.check_health(replica)
    replica.stopping = True
    Router.func_or_class.check_health(replica)
    Router.func_or_class.check_health(SimpleNamespace(http=None))  # served through Serve's proxy only
