"""``echo``, fast: the whole app in this process on mock engines (tests/support/inprocess.py). A
completion's echo puts the prompt before the output, and with ``logprobs`` the prompt's logprobs
before the output's (what evaluation harnesses read a prompt's likelihood from), as vLLM's server
does; the prompt's logprobs are computed where the prompt is, so such a request is colocated. A
chat request's echo puts the last message before the reply where its role is the reply's.
test_cdcp.py runs echo with logprobs on real engines. The mock model gives every prompt token
logprob -0.25 and every output token -0.5."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.wire.sampling import sampling_fields
from tests.support.inprocess import PROMPT, App, args, body_of, completion, expected, run

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def engine_calls(app: App) -> list[dict[str, Any]]:
    """Each engine request as it arrives: the engine, and its prompt logprobs setting."""
    calls: list[dict[str, Any]] = []
    for name, engine in app.engines.items():
        real = engine.runner.generate

        async def recording(request: Any, real: Any = real, name: str = name) -> Any:
            fields = sampling_fields(request.sampling_params)
            calls.append({"engine": name, "prompt_logprobs": fields.get("prompt_logprobs"), "prompt": list(request.prompt_token_ids)})
            async for delta in real(request):
                yield delta

        engine.runner.generate = recording
    return calls


def assembled(events: list) -> dict[str, Any]:
    """A streamed completion's one choice, put together as a client does."""
    out: dict[str, Any] = {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []}
    for event in events:
        if not isinstance(event, dict) or not event["choices"]:
            continue
        (choice,) = event["choices"]
        out["text"] += choice["text"]
        if choice.get("logprobs"):
            for key in ("tokens", "token_logprobs", "text_offset"):
                out[key] += choice["logprobs"][key]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_echo_puts_the_prompt_and_its_logprobs_before_the_output(tiny_tokenizer, stream):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        text = "The river runs"
        prompt_ids = tiny_tokenizer.encode(text)
        request = {"prompt": text, "max_tokens": 4, "echo": True, "logprobs": 1, "stream": stream}
        status, data = await body_of(await app.service.http("completions", json.dumps(request).encode()))
        assert status == 200, data
        choice = assembled(data) if stream else {"text": data["choices"][0]["text"], **data["choices"][0]["logprobs"]}
        _, plain = await completion(app, text, max_tokens=4)  # the output alone
        assert choice["text"] == text + plain["choices"][0]["text"]
        pieces = [tiny_tokenizer.decode([t]) for t in [*prompt_ids, *expected(prompt_ids, 4)]]
        assert choice["tokens"] == pieces
        # The first prompt token has none (nothing predicts it); then the prompt's, then the output's.
        assert choice["token_logprobs"] == [None] + [-0.25] * (len(prompt_ids) - 1) + [-0.5] * 4
        assert choice["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        if not stream:
            top = data["choices"][0]["logprobs"]["top_logprobs"]
            assert top[0] is None and top[1] == {pieces[1]: -0.25}
            assert data["usage"]["prompt_tokens"] == len(prompt_ids) and data["usage"]["completion_tokens"] == 4
        # Colocated, however the router is set: the prompt's logprobs are its decode engine's.
        assert [(c["engine"].split("-")[0], c["prompt_logprobs"]) for c in calls][0] == ("decode", 1)

    run(body, args(router={"mode": "disaggregated"}), tiny_tokenizer)


def test_echo_without_logprobs_token_prompts_and_several_prompts(tiny_tokenizer):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        other = [31, 32, 33, 34]
        status, data = await completion(app, [PROMPT, other], max_tokens=3, echo=True, return_token_ids=False)
        assert status == 200, data
        _, plain = await completion(app, [PROMPT, other], max_tokens=3, return_token_ids=False)
        for choice, alone, prompt in zip(data["choices"], plain["choices"], (PROMPT, other), strict=True):
            assert choice["text"] == tiny_tokenizer.decode(prompt) + alone["text"]  # token prompts are echoed as their text
        assert all(c["prompt_logprobs"] is None for c in calls)  # nothing asked of the engines without logprobs
        # With return_token_ids the prompt's ids carry it, and the text is the output's (as vLLM's server).
        status, data = await completion(app, PROMPT, max_tokens=3, echo=True)
        assert data["choices"][0]["text"] == plain["choices"][0]["text"] and data["choices"][0]["prompt_token_ids"] == PROMPT

    run(body, args(), tiny_tokenizer)


def test_a_resumed_attempt_never_asks_for_the_prompts_logprobs_again(tiny_tokenizer):
    """Its prompt holds the earlier output: the response keeps the first attempt's."""

    async def body(app: App) -> None:
        calls = engine_calls(app)
        for faults in app.faults.values():
            faults.stream_raises_after = 3
        status, data = await completion(app, PROMPT, max_tokens=10, echo=True, logprobs=0, return_token_ids=False)
        assert status == 200, data
        assert len(calls) >= 2 and calls[0]["prompt_logprobs"] == 0
        assert all(c["prompt_logprobs"] is None and len(c["prompt"]) > len(PROMPT) for c in calls[1:])
        logprobs = data["choices"][0]["logprobs"]["token_logprobs"]
        assert logprobs == [None] + [-0.25] * (len(PROMPT) - 1) + [-0.5] * 10

    run(body, args(router={"mode": "colocated", "max_attempts": 8}), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_echo_puts_the_last_message_before_the_reply_where_its_role_is_the_replys(tiny_tokenizer, stream):
    async def body(app: App) -> None:
        start = {"role": "assistant", "content": "The river is"}
        for messages, echoed in (
            ([{"role": "user", "content": "Describe the river"}, start], "The river is"),
            ([{"role": "user", "content": "Describe the river"}], ""),  # a user's message is not the reply's start
        ):
            request = {"messages": messages, "max_tokens": 4, "echo": True, "stream": stream}
            plain = {**request, "echo": False}
            status, data = await body_of(await app.service.http("chat", json.dumps(request).encode()))
            _, without = await body_of(await app.service.http("chat", json.dumps(plain).encode()))
            assert status == 200, data
            if stream:
                contents = [e["choices"][0]["delta"].get("content") for e in data if isinstance(e, dict) and e["choices"]]
                reply = "".join(e["choices"][0]["delta"].get("content") or "" for e in without if isinstance(e, dict) and e["choices"])
                assert "".join(c or "" for c in contents) == echoed + reply
                if echoed:  # its own chunk, after the role's
                    assert contents[:2] == ["", echoed]
            else:
                assert data["choices"][0]["message"]["content"] == echoed + without["choices"][0]["message"]["content"]

    run(body, args(), tiny_tokenizer)


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_with_no_output_is_the_prompt_alone(tiny_tokenizer, stream):
    """max_tokens 0 with echo (what scoring clients send): the prompt and its logprobs alone. As
    vLLM's server: the engine makes one token, left out of the text and logprobs, counted in usage."""

    async def body(app: App) -> None:
        text = "The river runs"
        prompt_ids = tiny_tokenizer.encode(text)
        request = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2, "stream": stream}
        if stream:
            request["stream_options"] = {"include_usage": True}
        status, data = await body_of(await app.service.http("completions", json.dumps(request).encode()))
        assert status == 200, data
        if stream:
            choice, usage = assembled(data), data[-2]["usage"]
            finish = [e["choices"][0]["finish_reason"] for e in data if isinstance(e, dict) and e["choices"]][-1]
        else:
            choice, usage = {"text": data["choices"][0]["text"], **data["choices"][0]["logprobs"]}, data["usage"]
            finish = data["choices"][0]["finish_reason"]
        assert choice["text"] == text and finish == "length"
        assert choice["tokens"] == [tiny_tokenizer.decode([t]) for t in prompt_ids]
        assert choice["token_logprobs"] == [None] + [-0.25] * (len(prompt_ids) - 1)
        assert usage["completion_tokens"] == 1

    run(body, args(), tiny_tokenizer)
