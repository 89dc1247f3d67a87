"""Responses of several choices (``n`` > 1, several completion prompts), fast: the whole app in
this process on mock engines (tests/support/inprocess.py). The mock model is greedy whatever the
seed, so every sample of a prompt has the prompt's tokens; which seed each engine request got is
read off the engines' calls. Every test ends with the idle check: nothing held anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from serve_app.wire.sampling import sampling_fields
from tests.support.inprocess import PROMPT, App, args, body_of, completion, expected, run, sse_events, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

OTHER = [21, 22, 23, 24, 25]
MESSAGES = [{"role": "user", "content": "name three rivers"}]


def engine_calls(app: App) -> list[dict[str, Any]]:
    """Each decode engine request as it arrives: its id, seed and prompt, and how many outputs
    every request had sent by then (``sent``: request id -> outputs, filled as they go)."""
    calls: list[dict[str, Any]] = []
    sent: dict[str, int] = {}
    for name, engine in app.engines.items():
        if not name.startswith("decode"):
            continue
        real = engine.runner.generate

        async def recording(request: Any, real: Any = real) -> Any:
            fields = sampling_fields(request.sampling_params)
            calls.append({"id": request.request_id, "seed": fields.get("seed"), "n": fields.get("n", 1), "sent": dict(sent)})
            async for delta in real(request):
                sent[request.request_id] = sent.get(request.request_id, 0) + 1
                yield delta

        engine.runner.generate = recording
    return calls


def by_index(choices: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {choice["index"]: choice for choice in choices}


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_n_samples_of_a_prompt_come_as_n_choices_each_its_own_engine_request(tiny_tokenizer, mode):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        status, data = await completion(app, PROMPT, max_tokens=6, n=3, temperature=1.0, seed=40)
        assert status == 200, data
        choices = by_index(data["choices"])
        assert sorted(choices) == [0, 1, 2] and len(data["choices"]) == 3
        for choice in choices.values():
            assert choice["token_ids"] == expected(PROMPT, 6) and choice["finish_reason"] == "length"
            assert choice["prompt_token_ids"] == PROMPT
        # The prompt is counted once, as vLLM's server counts it; every sample's output.
        assert data["usage"] == {"prompt_tokens": 8, "completion_tokens": 18, "total_tokens": 26}
        # One engine request per sample, seeded as vLLM's engine seeds a prompt's samples.
        assert sorted((c["id"].rsplit("-", 2)[-2], c["seed"]) for c in calls) == [("0", 40), ("1", 41), ("2", 42)]
        assert {c["n"] for c in calls} == {1}
        assert len({c["id"] for c in calls}) == 3 and all(c["id"].startswith(data["id"]) for c in calls)

    run(body, args(router={"mode": mode}), tiny_tokenizer)


def test_a_prompts_samples_are_seeded_as_vllms_engine_seeds_them():
    """The router's samples against vLLM's own ParentRequest (what its engine does with n > 1)."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from serve_app.router.parsing import _nth_sample

    for seed in (None, 0, 77):
        params = SamplingParams(n=4, temperature=1.0, seed=seed)
        parent = ParentRequest(SimpleNamespace(request_id="r", external_req_id="r", params=params))
        for i in range(4):
            assert _nth_sample(params, i).seed == parent.get_child_info(i)[1].seed


def test_a_prompts_later_samples_start_once_its_first_has_a_token(tiny_tokenizer):
    """So that the prompt is in the engines' prefix caches when they come: computed once, not n
    times side by side."""

    async def body(app: App) -> None:
        calls = engine_calls(app)
        status, data = await completion(app, PROMPT, max_tokens=4, n=3, temperature=1.0)
        assert status == 200, data
        first = next(c for c in calls if c["id"].endswith("-0-1"))
        assert calls[0] is first and first["sent"] == {}
        for later in calls[1:]:
            assert later["sent"].get(first["id"], 0) >= 1, calls

    run(body, args(router={"mode": "colocated"}), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_times_n_are_indexed_prompt_by_prompt(tiny_tokenizer, stream):
    async def body(app: App) -> None:
        usage = {"include_usage": True} if stream else None
        status, data = await completion(app, [PROMPT, OTHER], max_tokens=5, n=2, temperature=1.0, stream=stream, stream_options=usage)
        assert status == 200, data
        if stream:
            events = [e for e in data if isinstance(e, dict)]
            assert data[-1] == "[DONE]" and events[-1]["choices"] == []
            usage = events[-1]["usage"]
            tokens: dict[int, list[int]] = {}
            prompts: dict[int, list[int]] = {}
            for event in events[:-1]:
                (choice,) = event["choices"]
                tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                if "prompt_token_ids" in choice:
                    assert choice["index"] not in prompts  # in a choice's first chunk only
                    prompts[choice["index"]] = choice["prompt_token_ids"]
        else:
            usage = data["usage"]
            tokens = {c["index"]: c["token_ids"] for c in data["choices"]}
            prompts = {c["index"]: c["prompt_token_ids"] for c in data["choices"]}
            assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
        assert tokens == {0: expected(PROMPT, 5), 1: expected(PROMPT, 5), 2: expected(OTHER, 5), 3: expected(OTHER, 5)}
        assert prompts == {0: PROMPT, 1: PROMPT, 2: OTHER, 3: OTHER}
        assert usage == {"prompt_tokens": 13, "completion_tokens": 20, "total_tokens": 33}

    run(body, args(), tiny_tokenizer)


def test_chat_n_streams_each_choice_with_its_role_and_the_prompt(tiny_tokenizer):
    async def body(app: App) -> None:
        request = {"messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0, "return_token_ids": True, "stream": True}
        status, events = await body_of(await app.service.http("chat", json.dumps(request).encode()))
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [e["choices"][0] | {"prompt": e.get("prompt_token_ids")} for e in events if isinstance(e, dict)]
        assert {c["index"] for c in chunks} == {0, 1}
        for index in (0, 1):
            mine = [c for c in chunks if c["index"] == index]
            assert mine[0]["delta"]["role"] == "assistant" and mine[0]["delta"]["content"] == ""
            assert mine[0]["prompt"] and not any(c["prompt"] for c in mine[1:])  # as vLLM's server: with each role
            assert sum(len(c.get("token_ids") or []) for c in mine) == 4 and mine[-1]["finish_reason"] == "length"
        status, data = await body_of(await app.service.http("chat", json.dumps({**request, "stream": False}).encode()))
        assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1]
        assert data["choices"][0]["message"]["content"] == data["choices"][1]["message"]["content"]
        assert data["usage"]["completion_tokens"] == 8 and data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])

    run(body, args(), tiny_tokenizer)


def test_chat_return_prompt_text_comes_with_each_choices_role_and_once_in_a_reply(tiny_tokenizer):
    """vLLM's ``return_prompt_text``: streamed, the rendered prompt comes with each
    choice's first chunk, as the prompt's token ids do; in a whole reply, once at its top."""

    async def body(app: App) -> None:
        request = {"messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0, "return_prompt_text": True, "stream": True}
        rendered = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        status, events = await body_of(await app.service.http("chat", json.dumps(request).encode()))
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [e["choices"][0] | {"text": e.get("prompt_text")} for e in events if isinstance(e, dict)]
        for index in (0, 1):
            mine = [c for c in chunks if c["index"] == index]
            assert mine[0]["delta"]["role"] == "assistant" and mine[0]["text"] == rendered
            assert not any(c["text"] for c in mine[1:])
        status, data = await body_of(await app.service.http("chat", json.dumps({**request, "stream": False}).encode()))
        assert status == 200 and data["prompt_text"] == rendered and len(data["choices"]) == 2
        status, data = await body_of(await app.service.http("chat", json.dumps({**request, "return_prompt_text": False}).encode()))
        assert status == 200 and not any("prompt_text" in e for e in data if isinstance(e, dict))

    run(body, args(), tiny_tokenizer)


def test_named_tool_calls_get_an_id_per_choice(tiny_tokenizer):
    async def body(app: App) -> None:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        request = {
            "messages": MESSAGES, "max_tokens": 3, "n": 2, "temperature": 1.0, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }  # fmt: skip
        status, data = await body_of(await app.service.http("chat", json.dumps(request).encode()))
        assert status == 200, data
        ids = [call["id"] for choice in data["choices"] for call in choice["message"]["tool_calls"]]
        assert len(ids) == 2 and ids[0] != ids[1]

    run(body, args(), tiny_tokenizer)


def test_the_handle_api_serves_several_choices(tiny_tokenizer):
    async def body(app: App) -> None:
        request = {"prompt": [PROMPT, OTHER], "max_tokens": 3, "stream_options": {"include_usage": True}}
        events = [e async for e in app.service.generate(request)]
        assert {e["choices"][0]["index"] for e in events if e["choices"]} == {0, 1}
        assert events[-1]["usage"]["completion_tokens"] == 6
        final = await app.service.complete({"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 1.0})
        assert [c["index"] for c in final["choices"]] == [0, 1] and final["usage"]["prompt_tokens"] == 8

    run(body, args(), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_one_failed_choice_fails_the_response_and_stops_the_others(tiny_tokenizer, stream):
    """As vLLM's server: the client gets the error, and the other choices are stopped (their
    engine requests aborted, every lease released: the idle check after the test)."""

    async def body(app: App) -> None:
        sent: dict[str, int] = {}
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                real = engine.runner.generate

                async def failing(request: Any, real: Any = real) -> Any:
                    deltas = 0
                    async for delta in real(request):
                        deltas += 1
                        if request.request_id.split("-")[-2] == "2" and deltas > 2:  # the third choice's, once it has output
                            raise RuntimeError("the engine failed")
                        sent[request.request_id] = sent.get(request.request_id, 0) + len(delta.token_ids)
                        yield delta

                engine.runner.generate = failing
        status, data = await completion(app, [PROMPT, OTHER, PROMPT], max_tokens=2000, stream=stream)
        if stream:
            assert status == 200 and data[-1] == "[DONE]"
            errors = [e for e in data if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and errors[0]["error"]["code"] == 502
        else:
            assert status == 502 and "error" in data
        # The others were stopped, not waited for (the idle check after the test: and released).
        assert len(sent) == 3 and max(sent.values()) < 2000, sent

    run(body, args(router={"mode": "colocated", "max_attempts": 1}, mock={"decode_step_s": 0.005}), tiny_tokenizer)


def test_a_client_gone_mid_stream_stops_every_choice(tiny_tokenizer):
    async def body(app: App) -> None:
        sent: list = []
        request = {"prompt": PROMPT, "max_tokens": 2000, "n": 3, "temperature": 1.0, "stream": True}

        async def client() -> None:
            from tests.support.inprocess import play

            await play(await app.service.http("completions", json.dumps(request).encode()), sent)

        task = asyncio.ensure_future(client())
        await wait_until(lambda: len({c["index"] for e in sse_events(sent) if isinstance(e, dict) for c in e["choices"]}) == 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(body, args(router={"mode": "colocated"}, mock={"decode_step_s": 0.005}), tiny_tokenizer)


@pytest.mark.parametrize(
    "request_body,param,message",
    [
        ({"prompt": PROMPT, "n": 5, "temperature": 1.0}, "n", "n=5 asks for 5 choices; this server allows at most 4"),
        ({"prompt": [PROMPT, OTHER, PROMPT], "n": 2, "temperature": 1.0}, "prompt", "3 prompts times n=2 asks for 6 choices"),
        ({"prompt": [PROMPT] * 5}, "prompt", "5 prompts asks for 5 choices"),
        ({"prompt": PROMPT, "n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling"),
        ({"prompt": PROMPT, "n": 0}, "n", "n must be at least 1"),
        ({"prompt": [PROMPT, [1, 999999]]}, "prompt", "Token id 999999 in prompt[1] is out of range"),
        ({"prompt": [PROMPT, []]}, "prompt", "The prompt[1] is empty"),
    ],
)
def test_too_many_choices_and_bad_samples_are_refused_before_any_engine(tiny_tokenizer, request_body, param, message):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        status, data = await body_of(await app.service.http("completions", json.dumps(request_body).encode()))
        assert status == 400 and message in data["error"]["message"] and data["error"].get("param") == param, data
        assert calls == []

    run(body, args(router={"max_choices": 4}), tiny_tokenizer)


def test_a_client_gone_while_later_samples_wait_for_the_first_stops_them_all(tiny_tokenizer):
    """The first sample's engine has not answered yet: the others wait for it, and none of them
    is left behind when the client leaves."""

    async def body(app: App) -> None:
        started: list[str] = []
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                real = engine.runner.generate

                async def silent(request: Any, real: Any = real) -> Any:
                    started.append(request.request_id)
                    async for delta in real(request):
                        await asyncio.Event().wait()  # the engine holds the request and never answers
                        yield delta

                engine.runner.generate = silent
        request = {"prompt": PROMPT, "max_tokens": 50, "n": 3, "temperature": 1.0, "stream": True}
        task = asyncio.ensure_future(app.service.http("completions", json.dumps(request).encode()))
        await wait_until(lambda: started)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(started) == 1  # the others never started

    run(body, args(router={"mode": "colocated"}), tiny_tokenizer)


def test_a_handle_stream_of_several_choices_closed_early_releases_them_at_once(tiny_tokenizer):
    async def body(app: App) -> None:
        events = app.service.generate({"prompt": [PROMPT, OTHER], "max_tokens": 2000})
        await anext(events)
        await events.aclose()
        # Closed, not left to the collector: nothing is held by the time aclose returns.
        assert app.service.inflight == 0 and not any(load.inflight for load in app.service.pool.of_role("decode"))

    run(body, args(router={"mode": "colocated"}, mock={"decode_step_s": 0.005}), tiny_tokenizer)


def test_a_slow_reader_holds_the_choices_back_as_it_holds_one(tiny_tokenizer):
    """A client that stops reading: the router takes at most a group per choice more from the
    engines (their output waits there, merged), not the whole of every choice as chunks."""

    async def body(app: App) -> None:
        pulled = 0
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                real = engine.runner.generate

                async def counted(request: Any, real: Any = real) -> Any:
                    nonlocal pulled
                    async for delta in real(request):
                        pulled += 1
                        yield delta

                engine.runner.generate = counted
        reading = asyncio.Event()

        async def stalled_send(message: dict) -> None:
            if message["type"] == "http.response.body":
                reading.set()
                await asyncio.Event().wait()  # the client reads the first write, then nothing more

        async def never() -> dict:
            await asyncio.Event().wait()
            return {}

        request = {"prompt": PROMPT, "max_tokens": 400, "n": 3, "temperature": 1.0, "stream": True}
        response = await app.service.http("completions", json.dumps(request).encode())
        task = asyncio.ensure_future(response({"type": "http"}, never, stalled_send))
        await reading.wait()
        await asyncio.sleep(1.0)  # 400 tokens' worth of steps: unheld, each choice would run to its end
        held = pulled
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Each choice: its first group, one waiting for room, one in the queue, one being sent.
        assert held <= 4 * 3, held

    run(body, args(router={"mode": "colocated"}, mock={"decode_step_s": 0.0025}, stream_items_per_s=0), tiny_tokenizer)


SLOW_ENGINE = {"decode_step_s": 0.01}  # 2,000 tokens take 20 s: an engine request left running shows


def failing_on(prompt: list[int], after: int):
    """Each decode engine's runner, wrapped: ``prompt``'s request fails after ``after`` deltas."""

    def wrap(real: Any) -> Any:
        async def generate(request: Any) -> Any:
            n = 0
            async for delta in real(request):
                n += 1
                if list(request.prompt_token_ids) == prompt and n > after:
                    raise RuntimeError("the engine failed")
                yield delta

        return generate

    return wrap


async def stalled_client(response: Any, stall: Callable[[dict], bool], stalled: asyncio.Event) -> None:
    """A client that takes the response's writes until ``stall(message)``, then none."""

    async def send(message: dict) -> None:
        if stall(message):
            stalled.set()
            await asyncio.Event().wait()

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    await response({"type": "http"}, receive, send)


def test_the_other_choices_are_released_before_a_slow_client_takes_the_error(tiny_tokenizer):
    """One choice fails mid-stream: its error event ends the response, and the other choices'
    engine requests and leases are released before that write, as a one-choice stream releases
    its own, not once the client has taken it."""

    async def body(app: App) -> None:
        for name, engine in app.engines.items():
            if name.startswith("decode"):
                engine.runner.generate = failing_on(PROMPT, after=2)(engine.runner.generate)
        raw = json.dumps({"prompt": [PROMPT, OTHER], "max_tokens": 2000, "stream": True}).encode()
        response = await app.service.http("completions", raw)
        at_error = asyncio.Event()
        client = asyncio.ensure_future(stalled_client(response, lambda m: b'"error"' in m.get("body", b""), at_error))
        await asyncio.wait_for(at_error.wait(), 5)
        await asyncio.sleep(0.5)
        running = {n: sorted(e.runner._by_id) for n, e in app.engines.items() if e.runner._by_id}
        held = {load.name: load.inflight for load in app.service.pool.loads.values() if load.inflight}
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        assert not running and not held, (running, held)

    run(body, args(router={"mode": "colocated", "max_attempts": 1}, mock=SLOW_ENGINE), tiny_tokenizer)


def test_a_choice_its_stop_string_ended_releases_its_engine_while_the_client_reads_nothing(tiny_tokenizer):
    """Two choices, a client that takes no write: choice 1's first token completes its stop
    string after choice 0 has filled the queue; its engine request is aborted then, not once the
    client has made room for its last chunk."""

    async def body(app: App) -> None:
        holders: dict[str, Any] = {}
        for name, engine in app.engines.items():
            if name.startswith("decode"):

                async def late(request: Any, real: Any = engine.runner.generate, runner: Any = engine.runner) -> Any:
                    holders[request.request_id] = runner
                    first = True
                    async for delta in real(request):
                        if first and list(request.prompt_token_ids) == PROMPT:
                            await asyncio.sleep(0.3)  # the other choice fills the queue first
                        first = False
                        yield delta

                engine.runner.generate = late
        # PROMPT's first token is "arts"; OTHER's output never holds it.
        raw = json.dumps({"prompt": [OTHER, PROMPT], "max_tokens": 2000, "stop": ["arts"], "stream": True}).encode()
        response = await app.service.http("completions", raw)
        client = asyncio.ensure_future(stalled_client(response, lambda m: m["type"] == "http.response.body", asyncio.Event()))
        await wait_until(lambda: any(r.split("-")[-2] == "1" for r in holders))
        stopped = next(r for r in holders if r.split("-")[-2] == "1")
        await wait_until(lambda: stopped not in holders[stopped]._by_id, 3.0)
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client

    run(body, args(router={"mode": "colocated"}, mock=SLOW_ENGINE, stream_items_per_s=0), tiny_tokenizer)
