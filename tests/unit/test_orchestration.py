"""The router's async orchestration, fast: the whole app in this process on mock engines
(tests/unit/inprocess.py), no Ray, no vLLM engine. Every test ends by checking that nothing is
held anywhere: router counters and leases, engine requests, KV, relay registrations."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from serve_app.engines.mock_runner import next_token
from serve_app.router.service import Outcome, sse_body
from serve_app.runtime.metrics import RouterMetrics
from tests.unit.inprocess import MOCK_ARGS, App, recording_router_metrics

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def args(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(MOCK_ARGS)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def run(coro_fn, app_args: dict[str, Any], tokenizer, metrics: RouterMetrics | None = None) -> Any:
    async def main() -> Any:
        app = await App.start(app_args, tokenizer, metrics)
        try:
            result = await asyncio.wait_for(coro_fn(app), 30)
            await app.idle()
            return result
        finally:
            await app.stop()

    return asyncio.run(main())


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


async def play(response, sent: list) -> None:
    """Run a Starlette response as its server would, for a client that never disconnects by
    itself (cancel the task to have it leave); every ASGI message it sends goes into ``sent``."""

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    await response({"type": "http"}, receive, send)


def sse_events(sent: list[dict]) -> list:
    """The SSE events (dicts, and "[DONE]") in the ASGI messages a response sent."""
    events: list = []
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def body_of(response) -> tuple[int, Any]:
    """(status, JSON body or the list of SSE events) of a Starlette response, consumed here."""
    if hasattr(response, "body_iterator"):
        sent: list[dict] = []
        await play(response, sent)
        return response.status_code, sse_events(sent)
    return response.status_code, json.loads(response.body)


async def completion(app: App, prompt: list[int], max_tokens: int = 8, stream: bool = False, **extra: Any) -> tuple[int, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, "stream": stream, **extra}
    return await body_of(await app.service.http("completions", json.dumps(body).encode()))


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids") or []]


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


# ---------------------------------------------------------------------------- the good paths
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_completion_through_every_hop(engines_without_ray, tiny_tokenizer, mode):
    async def body(app: App) -> None:
        status, data = await completion(app, PROMPT, max_tokens=12)
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == expected(PROMPT, 12)
        assert data["usage"] == {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20}
        status, events = await completion(app, PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert tokens_of(events) == expected(PROMPT, 12)
        assert events[-2]["usage"]["completion_tokens"] == 12
        if mode == "disaggregated":
            decode_calls = [f.calls for n, f in app.faults.items() if n.startswith("prefill")]
            assert any("run" in calls for calls in decode_calls)

    run(body, args(router={"mode": mode}), tiny_tokenizer)


def test_a_stream_writes_what_is_ready_together_in_one_message(engines_without_ray, tiny_tokenizer):
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


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def leased(app: App, role: str) -> bool:
    return any(load.inflight for load in app.service.pool.of_role(role))


def no_callbacks(app: App) -> None:
    """Decode engines allocate KV but never call the metaserver back."""
    for name, engine in app.engines.items():
        if name.startswith("decode"):

            async def lost(*_: Any, **__: Any) -> None:
                return None

            engine.runner.post_callback = lost


def fail_status(data: Any) -> int:
    return data["error"]["code"]


# ---------------------------------------------------------------------------- deadlines
def test_kv_ready_deadline_retries_then_fails_with_504(engines_without_ray, tiny_tokenizer):
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


def test_prefill_deadline_then_the_next_attempt_succeeds(engines_without_ray, tiny_tokenizer):
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


def test_first_token_deadline_moves_to_the_other_decode_engine(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        hung = app.faults["decode-0"]
        hung.hang = True
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert app.faults["decode-1"].calls.count("generate") >= 1

    colocated = args(router={"mode": "colocated", "timeouts": {"kv_ready_s": 1, "prefill_s": 1, "first_token_s": 0.2, "request_s": 20}})
    run(body, colocated, tiny_tokenizer)


def test_request_deadline_ends_the_response_with_504(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        for faults in app.faults.values():
            faults.hang = True
        status, data = await completion(app, PROMPT)
        assert status == 504 and data["error"]["message"] == "the request timed out", data
        for faults in app.faults.values():
            faults.hang = False

    tight = args(router={"timeouts": {"kv_ready_s": 5, "prefill_s": 5, "first_token_s": 5, "request_s": 0.3}})
    run(body, tight, tiny_tokenizer)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_request_deadline_mid_stream_ends_it_with_a_504_event(engines_without_ray, tiny_tokenizer, mode):
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


async def long_streaming_client(app: App, events: list) -> None:
    """A client streaming a long completion that never disconnects by itself: cancel its task
    to have it leave. What it is sent goes into ``events``."""
    response = await app.service.http("completions", json.dumps({"prompt": PROMPT, "max_tokens": 2000, "stream": True}).encode())
    await play(response, events)


# ---------------------------------------------------------------------------- client disconnects
@pytest.mark.parametrize("phase", ["awaiting_kv", "prefilling", "decoding"])
def test_a_client_disconnect_in_each_phase_releases_everything(engines_without_ray, tiny_tokenizer, phase):
    async def body(app: App) -> None:
        if phase == "awaiting_kv":
            no_callbacks(app)
        if phase == "prefilling":
            app.faults["prefill-0"].hang = True
        events: list = []
        task = asyncio.ensure_future(long_streaming_client(app, events))
        if phase == "awaiting_kv":
            await wait_until(
                lambda: leased(app, "decode") and any(e.relay.pending for n, e in app.engines.items() if n.startswith("decode"))
            )
        elif phase == "prefilling":
            await wait_until(lambda: leased(app, "prefill"))
        else:
            await wait_until(lambda: len(events) >= 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        app.faults["prefill-0"].hang = False

    run(body, args(), tiny_tokenizer)


def test_a_handle_stream_closed_early_releases_everything(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        stream = app.service.generate({"prompt": PROMPT, "max_tokens": 2000})
        got = [await anext(stream) for _ in range(3)]
        assert all("choices" in e for e in got)
        await stream.aclose()

    run(body, args(), tiny_tokenizer)


# ---------------------------------------------------------------------------- engine faults
def test_a_dead_prefill_engine_falls_back_to_colocated(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        app.faults["prefill-0"].dead = True
        status, data = await completion(app, PROMPT)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 8)
        assert not app.service.pool.loads["prefill-0"].healthy
        status, data = await completion(app, PROMPT + [1])  # no healthy prefill: served colocated
        assert status == 200
        assert app.faults["prefill-0"].calls.count("run") == 1

    run(body, args(), tiny_tokenizer)


def test_a_prefill_that_raises_is_retried(engines_without_ray, tiny_tokenizer):
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

    run(body, args(), tiny_tokenizer)


@pytest.mark.parametrize("fault", ["dead", "stream_ends_after", "stream_raises_after", "stream_times_out"])
def test_a_decode_engine_lost_mid_stream_is_resumed_token_exact(engines_without_ray, tiny_tokenizer, fault):
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

    run(body, args(router={"mode": "colocated"}, decode={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_no_decode_engine_at_all_is_a_503(engines_without_ray, tiny_tokenizer):
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


def test_a_kv_ready_naming_another_engine_is_refused(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                runner = engine.runner
                real = runner.endpoint
                runner.endpoint = type(real)(engine_id=real.engine_id, host=real.host, port=1)  # posts a port it does not own
        status, data = await completion(app, PROMPT)
        assert status == 502 and "KVReady for another engine" in data["error"]["message"], data

    run(body, args(router={"max_attempts": 2}), tiny_tokenizer)


def test_a_second_kv_ready_is_a_protocol_error_never_a_second_prefill(engines_without_ray, tiny_tokenizer):
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


def test_kv_ready_racing_the_first_token(engines_without_ray, tiny_tokenizer):
    """Prefill's call returns only after decode has already streamed tokens: the attempt keeps
    reading tokens while prefill is still 'in flight', and finishes when both are done."""

    async def body(app: App) -> None:
        prefill = app.engines["prefill-0"]
        real = prefill.run

        async def slow_return(request):
            result = await real(request)
            await asyncio.sleep(0.2)
            return result

        prefill.run = slow_return
        status, events = await completion(app, PROMPT, max_tokens=30, stream=True)
        assert status == 200 and tokens_of(events) == expected(PROMPT, 30)

    run(body, args(), tiny_tokenizer)


def test_tokens_without_kv_ready_when_decode_needs_no_transfer(engines_without_ray, tiny_tokenizer):
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


def test_an_engine_rejection_is_a_400_and_not_retried(engines_without_ray, tiny_tokenizer):
    from serve_app.wire.protocol import EngineRejected

    async def body(app: App) -> None:
        for name, engine in app.engines.items():
            if name.startswith("decode"):

                async def reject(request):
                    yield EngineRejected("token id 5000 is out of vocabulary")

                engine.runner.generate = reject
        status, data = await completion(app, PROMPT)
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
        assert sum(f.calls.count("generate") for f in app.faults.values()) == 1

    run(body, args(router={"mode": "colocated"}), tiny_tokenizer)


# ---------------------------------------------------------------------------- recompute
def test_recompute_under_kv_pressure_through_the_session(engines_without_ray, tiny_tokenizer):
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

    pressure = args(router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run(body, pressure, tiny_tokenizer)


# ---------------------------------------------------------------------------- routes and framing
def test_chat_and_completions_with_logprobs_stream_and_not(engines_without_ray, tiny_tokenizer):
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


def test_bad_requests_and_internal_errors_get_openai_errors(engines_without_ray, tiny_tokenizer, monkeypatch):
    import serve_app.router.service as service

    async def body(app: App) -> None:
        status, data = await body_of(await app.service.http("completions", b"{not json"))
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
        status, data = await body_of(await app.service.http("chat", json.dumps({"messages": []}).encode()))
        assert status == 400 and data["error"]["param"] == "messages"
        assert (await app.service.complete({"prompt": PROMPT, "n": 3}))["error"]["param"] == "n"
        events = [e async for e in app.service.generate({"messages": "nope"})]
        assert len(events) == 1 and events[0]["error"]["code"] == 400

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(service, "parse_request", broken)
        status, data = await body_of(await app.service.http("completions", json.dumps({"prompt": "x"}).encode()))
        assert status == 500 and data["error"]["type"] == "internal_error"

    run(body, args(), tiny_tokenizer)


def test_a_failure_before_the_first_token_is_a_plain_error_response_even_when_streaming(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        no_callbacks(app)
        status, data = await completion(app, PROMPT, stream=True)
        assert status == 504 and data["error"]["code"] == 504

    run(
        body,
        args(router={"max_attempts": 1, "timeouts": {"kv_ready_s": 0.1, "prefill_s": 1, "first_token_s": 1, "request_s": 20}}),
        tiny_tokenizer,
    )


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        for faults in app.faults.values():
            faults.stream_raises_after = 3
        status, events = await completion(app, PROMPT, max_tokens=100, stream=True)
        assert status == 200
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 502 and "2 attempts" in errors[0]["error"]["message"]
        assert events[-1] == "[DONE]"

    run(body, args(router={"mode": "colocated", "max_attempts": 2}), tiny_tokenizer)


def test_handle_api_complete_and_generate(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        final = await app.service.complete({"prompt": PROMPT, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
        assert final["usage"]["completion_tokens"] == 5 and final["object"] == "text_completion"
        events = [e async for e in app.service.generate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": False})]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    run(body, args(), tiny_tokenizer)


def test_models_health_snapshot_and_warm_up(engines_without_ray, tiny_tokenizer):
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


def test_the_router_serves_the_openai_api_itself(engines_without_ray, tiny_tokenizer):
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
def test_a_stopping_decode_engine_hands_its_streams_to_another_token_exact(engines_without_ray, tiny_tokenizer, mode):
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
        assert metrics.moves.value(engine=victim) == 1 and not metrics.errors.values
        assert victim not in app.service.pool.loads  # forgotten once nothing is held on it
        # Nothing new goes to it: the next request runs on the other engine alone.
        calls = len(app.faults[victim].calls)
        assert (await completion(app, PROMPT, max_tokens=4))[0] == 200
        assert len(app.faults[victim].calls) == calls

    run(body, args(router={"mode": mode, "max_attempts": 1}, decode={"num_replicas": 2}), tiny_tokenizer, recording_router_metrics())


def test_with_no_other_decode_engine_a_moved_request_fails_with_a_503_not_a_hang(engines_without_ray, tiny_tokenizer):
    async def body(app: App) -> None:
        request = asyncio.ensure_future(completion(app, PROMPT, max_tokens=300))
        victim = await busy_decode(app)
        app.service.pool.drain(victim)
        status, response = await request  # waits up to kv_ready_s (2 s here) for a decode engine
        assert status == 503 and "no decode engine" in response["error"]["message"]

    run(body, args(router={"mode": "colocated"}, decode={"num_replicas": 1}), tiny_tokenizer)


def test_a_decode_replica_serve_stops_ends_its_streams_as_moved_and_the_router_resumes_them(engines_without_ray, tiny_tokenizer):
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
        assert metrics.moves.value(engine=victim) == 1 and not metrics.errors.values
        assert victim not in app.service.pool.loads
        await stopping  # it stops once nothing is in flight and no call has come for a while
        assert app.engines[victim]._stopped

    app_args = args(router={"mode": "disaggregated", "max_attempts": 1}, decode={"num_replicas": 2})
    run(body, app_args, tiny_tokenizer, recording_router_metrics())


def test_prefix_routing_keeps_each_prefix_on_one_prefill_and_one_decode_engine(engines_without_ray, tiny_tokenizer):
    """router.balancer: prefix through the whole schedule: both choices (decode first, then
    prefill) follow the prompt's prefix, outputs are unchanged, and the router counts the prompt
    tokens it expected the chosen engines to hold."""
    from serve_app.router.prefix_index import chain_keys, rendezvous

    block = 16
    prefixes = [[100 + 7 * p + i % 5 for i in range(4 * block)] for p in range(4)]

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
