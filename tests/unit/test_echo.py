"""``echo``, fast: the whole app in this process on mock engines (tests/support/inprocess.py). A
completion's echo puts the prompt before the output, and with ``logprobs`` the prompt's logprobs
before the output's (what evaluation harnesses read a prompt's likelihood from), as vLLM's server
does; the prompt's logprobs are computed where the prompt is, so such a request is colocated. A
chat request's echo puts the last message before the reply where its role is the reply's.
test_cdcp.py runs echo with logprobs on real engines. The mock model gives every prompt token
logprob -0.25 and every output token -0.5. Also here: logprobs naming tokens by id
(``return_tokens_as_token_ids``), which RL frameworks read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.inprocess import PROMPT, App, args, body_of, completion, engine_calls, expected, run, vllm_logprob_texts

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


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
        echoed = list(calls)
        _, plain = await completion(app, text, max_tokens=4)  # the output alone
        plain_calls = calls[len(echoed) :]
        assert choice["text"] == text + plain["choices"][0]["text"]
        # Each token's text as vLLM's engine gives it (a multi-byte character's pieces read together).
        output = expected(prompt_ids, 4)
        pieces = [tiny_tokenizer.decode(prompt_ids[:1])] + vllm_logprob_texts(tiny_tokenizer, prompt_ids[1:])
        pieces += vllm_logprob_texts(tiny_tokenizer, output)
        assert choice["tokens"] == pieces
        # The first prompt token has none (nothing predicts it); then the prompt's, then the output's.
        assert choice["token_logprobs"] == [None] + [-0.25] * (len(prompt_ids) - 1) + [-0.5] * 4
        assert choice["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        if not stream:
            top = data["choices"][0]["logprobs"]["top_logprobs"]
            assert top[0] is None and top[1] == {pieces[1]: -0.25}
            assert data["usage"]["prompt_tokens"] == len(prompt_ids) and data["usage"]["completion_tokens"] == 4
        # Colocated, however the router is set: the prompt's logprobs are its decode engine's, which
        # computes the prompt whole (as vLLM does for them: no prefix cache).
        assert [(c["engine"].split("-")[0], c["kv"], c["skip_cache"], c["prompt_logprobs"]) for c in echoed] == [("decode", None, True, 1)]
        # The same prompt without echo goes through a prefill engine, reading the caches.
        assert sorted(c["engine"].split("-")[0] for c in plain_calls) == ["decode", "prefill"]
        assert all(not c["skip_cache"] and c["prompt_logprobs"] is None for c in plain_calls)

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
        assert all(c["prompt_logprobs"] is None and not c["skip_cache"] and len(c["prompt"]) > len(PROMPT) for c in calls[1:])
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
def test_a_chat_reply_without_the_generation_prompt_bears_the_last_messages_role(tiny_tokenizer, stream):
    """add_generation_prompt: false: the model goes on with the last message, and the reply has
    its role (vLLM's server's get_chat_request_role), with echo that message's text first."""

    async def body(app: App) -> None:
        for echo in (False, True):
            request = {
                "messages": [{"role": "user", "content": "Describe the river"}],
                "add_generation_prompt": False,
                "max_tokens": 4,
                "echo": echo,
                "stream": stream,
            }
            status, data = await body_of(await app.service.http("chat", json.dumps(request).encode()))
            assert status == 200, data
            if stream:
                chunks = [e["choices"][0] for e in data if isinstance(e, dict) and e["choices"]]
                assert chunks[0]["delta"]["role"] == "user" and all("role" not in c["delta"] for c in chunks[1:])
                content = "".join(c["delta"].get("content") or "" for c in chunks)
            else:
                assert data["choices"][0]["message"]["role"] == "user"
                content = data["choices"][0]["message"]["content"]
            assert content.startswith("Describe the river") == echo, content

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
        assert choice["tokens"] == [tiny_tokenizer.decode(prompt_ids[:1])] + vllm_logprob_texts(tiny_tokenizer, prompt_ids[1:])
        assert choice["token_logprobs"] == [None] + [-0.25] * (len(prompt_ids) - 1)
        assert usage["completion_tokens"] == 1

    run(body, args(), tiny_tokenizer)


def test_a_prompts_samples_share_its_logprobs_and_the_others_read_the_cache(tiny_tokenizer):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        status, data = await completion(app, PROMPT, max_tokens=3, n=3, temperature=1.0, echo=True, logprobs=1)
        assert status == 200, data
        asked = [c for c in calls if c["prompt_logprobs"] is not None]
        assert len(asked) == 1 and asked[0]["skip_cache"] is True  # once, by the first sample
        assert all(not c["skip_cache"] for c in calls if c["prompt_logprobs"] is None)
        logprobs = [c["logprobs"]["token_logprobs"] for c in data["choices"]]
        assert logprobs[0] == logprobs[1] == logprobs[2] == [None] + [-0.25] * (len(PROMPT) - 1) + [-0.5] * 3

    run(body, args(router={"mode": "colocated"}), tiny_tokenizer)


def test_echo_logprobs_are_bounded_per_request(tiny_tokenizer, monkeypatch):
    import serve_app.router.parsing as parsing

    monkeypatch.setattr(parsing, "MAX_PROMPT_LOGPROB_ENTRIES", 8 * 2 * 3 * 2)

    async def body(app: App) -> None:
        # 8 tokens x 2 samples x 3, in the echo's logprobs and in the prompt_logprobs field: the bound
        status, data = await completion(app, PROMPT, max_tokens=3, n=2, temperature=1.0, echo=True, logprobs=2)
        assert status == 200, data
        status, data = await completion(app, PROMPT, max_tokens=3, n=2, temperature=1.0, echo=True, logprobs=3)
        assert status == 400 and data["error"]["param"] == "logprobs" and "128 logprobs of the prompts" in data["error"]["message"]
        status, data = await completion(app, PROMPT, max_tokens=3, n=2, temperature=1.0, logprobs=3)
        assert status == 200  # without echo, no prompt logprobs

    run(body, args(), tiny_tokenizer)


def test_without_the_engines_prompt_logprobs_the_prompts_are_null(tiny_tokenizer):
    """vLLM's server would fail the request; the router sends what it has (and logs it)."""

    async def body(app: App) -> None:
        for engine in app.engines.values():
            real = engine.runner.generate

            async def stripped(request: Any, real: Any = real) -> Any:
                async for delta in real(request):
                    delta.prompt_logprobs = None
                    yield delta

            engine.runner.generate = stripped
        status, data = await completion(app, PROMPT, max_tokens=3, echo=True, logprobs=1)
        assert status == 200 and data["choices"][0]["logprobs"]["token_logprobs"] == [None] * len(PROMPT) + [-0.5] * 3

    run(body, args(), tiny_tokenizer)


def test_streamed_offsets_follow_the_tokens_while_a_stop_string_holds_text_back(tiny_tokenizer):
    """As vLLM's server: each chunk's text_offset goes on from the tokens' text before it, not
    from the text sent, which lags while the end of the output might begin a stop string."""

    async def body(app: App) -> None:
        output = expected(PROMPT, 12)
        pieces = vllm_logprob_texts(tiny_tokenizer, output)
        stop = pieces[4] + pieces[5] + "\x01never"  # the text of tokens 4 and 5 is held back, then sent
        request = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0, "stream": True, "stop": [stop]}
        status, events = await body_of(await app.service.http("completions", json.dumps(request).encode()))
        assert status == 200
        got = assembled(events)
        assert got["tokens"] == pieces
        assert got["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        sent = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]]
        assert "" in sent[:-1]  # some chunk's tokens were held back

    run(body, args(stream_items_per_s=0, mock={"decode_step_s": 0.005}), tiny_tokenizer)


def test_only_an_attempt_that_reads_the_prompts_logprobs_skips_the_prefix_cache(tiny_tokenizer):
    """vLLM skips the prefix cache for a request with prompt_logprobs, which its echo sets too:
    the router's parameters skip it only where they are read (a chat echo's in the reply's
    prompt_logprobs field, which a stream does not carry; a completion echo's with logprobs)."""
    from serve_app.router.parsing import ModelContext, parse_request

    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    for route, body, skips in (
        ("chat", {"messages": messages, "echo": True}, True),
        ("chat", {"messages": messages, "echo": True, "logprobs": True, "top_logprobs": 2}, True),
        ("chat", {"messages": messages, "echo": True, "stream": True}, False),
        ("chat", {"messages": messages, "prompt_logprobs": 0, "stream": True}, False),
        ("chat", {"messages": messages, "prompt_logprobs": 0}, True),
        ("completions", {"prompt": "x", "echo": True}, False),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 0}, True),
        ("completions", {"prompt": "x", "logprobs": 0}, False),
    ):
        params = parse_request(route, body, ctx).sampling_params
        assert bool(params.skip_reading_prefix_cache) is skips and (params.prompt_logprobs is not None) is skips, body


@pytest.mark.parametrize("stream", [False, True])
def test_a_large_echo_is_framed_off_the_event_loop(tiny_tokenizer, monkeypatch, stream):
    """Every stream of the replica waits while its loop frames a prompt's logprobs (0.5 s for the
    bound's 2^20 entries): past OFFLOAD_LOGPROB_ENTRIES they are framed in a worker thread, and a
    whole response encoded there too."""
    import asyncio

    import serve_app.router.service as service
    import serve_app.router.session as session

    # Logprobs 1 is over it, 0 under: a reply that is not streamed has them twice (the echo's and
    # the prompt_logprobs field, as vLLM's server), a stream once.
    bound = len(PROMPT) * (2 if stream else 4) - 1
    monkeypatch.setattr(session, "OFFLOAD_LOGPROB_ENTRIES", bound)
    monkeypatch.setattr(service, "OFFLOAD_LOGPROB_ENTRIES", bound)
    offloaded: list[str] = []
    real = asyncio.to_thread

    async def spy(fn: Any, *args: Any, **kwargs: Any) -> Any:
        offloaded.append(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "?"))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", spy)

    async def body(app: App) -> None:
        status, data = await completion(app, PROMPT, max_tokens=3, echo=True, logprobs=1, stream=stream)
        assert status == 200
        assert offloaded == (["chunks"] if stream else ["final", "JSONReply"])
        offloaded.clear()
        status, data = await completion(app, PROMPT, max_tokens=3, echo=True, logprobs=0, stream=stream)  # under it
        assert status == 200 and offloaded == []

    run(body, args(), tiny_tokenizer)


def test_return_tokens_as_token_ids_names_every_token_by_its_id(tiny_tokenizer):
    """As vLLM's server: ``token_id:<id>`` for each token and alternative (the offsets go by
    those names); a chat token's bytes stay its text's."""

    async def body(app: App) -> None:
        status, data = await completion(app, PROMPT, max_tokens=3, echo=True, logprobs=1, return_tokens_as_token_ids=True)
        assert status == 200, data
        logprobs = data["choices"][0]["logprobs"]
        ids = [*PROMPT, *expected(PROMPT, 3)]
        names = [f"token_id:{t}" for t in ids]
        assert logprobs["tokens"] == names
        assert logprobs["top_logprobs"][1] == {names[1]: -0.25} and logprobs["top_logprobs"][-1] == {names[-1]: -0.5}
        assert logprobs["text_offset"] == [sum(len(n) for n in names[:i]) for i in range(len(names))]
        request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
        status, data = await body_of(await app.service.http("chat", json.dumps({**request, "return_tokens_as_token_ids": True}).encode()))
        _, plain = await body_of(await app.service.http("chat", json.dumps(request).encode()))
        assert status == 200, data
        output = [int(named["token"].removeprefix("token_id:")) for named in data["choices"][0]["logprobs"]["content"]]
        assert [text["token"] for text in plain["choices"][0]["logprobs"]["content"]] == vllm_logprob_texts(tiny_tokenizer, output)
        for named, text in zip(data["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"], strict=True):
            token_id = int(named["token"].removeprefix("token_id:"))
            assert named["token"] == f"token_id:{token_id}"
            assert named["bytes"] == text["bytes"]
            assert [t["token"] for t in named["top_logprobs"]] == [f"token_id:{token_id}"]
            assert named["top_logprobs"][0]["bytes"] == list(f"token_id:{token_id}".encode())

    run(body, args(), tiny_tokenizer)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(tiny_tokenizer):
    """As vLLM's server (with include_usage): each chunk's usage so far, each choice's own."""

    async def body(app: App) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        status, events = await completion(app, PROMPT, max_tokens=6, n=2, temperature=1.0, stream=True, stream_options=options)
        assert status == 200
        chunks = [e for e in events if isinstance(e, dict)]
        seen: dict[int, int] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            seen[choice["index"]] = seen.get(choice["index"], 0) + len(choice["token_ids"])
            so_far = seen[choice["index"]]
            assert chunk["usage"] == {"prompt_tokens": 8, "completion_tokens": so_far, "total_tokens": 8 + so_far}
        assert chunks[-1]["usage"]["completion_tokens"] == 12 and seen == {0: 6, 1: 6}
        request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "stream_options": options}
        status, events = await body_of(await app.service.http("chat", json.dumps(request).encode()))
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["usage"]["completion_tokens"] == 0
        assert [c["usage"]["completion_tokens"] for c in chunks[1:]][-2:] == [4, 4]  # the last choice chunk, the usage chunk
        # A chat echo's chunk comes before any output too.
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
        status, events = await body_of(await app.service.http("chat", json.dumps({**request, "messages": messages, "echo": True}).encode()))
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[1]["choices"][0]["delta"]["content"] == "Hello" and chunks[1]["usage"]["completion_tokens"] == 0
        assert chunks[2]["usage"]["completion_tokens"] > 0
        plain = await completion(app, PROMPT, max_tokens=3, stream=True, stream_options={"include_usage": True})
        assert all("usage" not in e for e in plain[1] if isinstance(e, dict) and e["choices"])

    run(body, args(), tiny_tokenizer)


def test_a_chat_tokens_top_logprobs_start_with_it_as_on_vllms_server(tiny_tokenizer):
    """vLLM's server lists a chat token's top_logprobs as the first k of its engine's entries: the
    sampled token, then the best others, whatever the sampled one's rank."""
    from serve_app.wire.protocol import TokenLogprob

    async def body(app: App) -> None:
        for engine in app.engines.values():
            real = engine.runner.generate

            async def third(request: Any, real: Any = real) -> Any:  # each sampled token ranked 3rd
                async for delta in real(request):
                    if delta.logprobs is not None:
                        delta.logprobs = [TokenLogprob(t, -2.0, ((t + 1, -0.5), (t + 2, -1.0), (t, -2.0)), rank=3) for t in delta.token_ids]
                    yield delta

            engine.runner.generate = third
        request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
        status, data = await body_of(await app.service.http("chat", json.dumps({**request, "return_tokens_as_token_ids": True}).encode()))
        assert status == 200, data
        for entry in data["choices"][0]["logprobs"]["content"]:
            t = int(entry["token"].removeprefix("token_id:"))
            listed = [(top["token"], top["logprob"]) for top in entry["top_logprobs"]]
            assert listed == [(f"token_id:{t}", -2.0), (f"token_id:{t + 1}", -0.5)]

    run(body, args(), tiny_tokenizer)
