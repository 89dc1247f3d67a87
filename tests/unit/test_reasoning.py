"""A reasoning model's replies (router/output_parsers.py): the router splits the thinking from the
answer with the decode engines' reasoning parser, as vLLM's server does with the same parser,
streamed at any pace or whole, and with every tool choice. test_cdcp.py runs it on real engines.

On vLLM 0.32 with qwen3's parser, whole and fed a token a step and more. vLLM 0.23's qwen3
parser needs <think> tokens, which the tiny tokenizer lacks, so through test_on_vllm_023.py these
run granite's on whole replies only: vLLM's streaming granite parser loses or misplaces the
thinking however the text is cut (as it would on vLLM's own server). test_tools.py streams
vLLM 0.23's parsers through the same framing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import vllm

from serve_app.config.settings import load_config
from serve_app.router.output_parsers import load_parser
from serve_app.router.parsing import ModelContext, parse_request
from tests.support.chat_replies import HERMES_CALL, MESSAGES, TOOLS, named, reply
from tests.support.inprocess import App, args, body_of, engine_calls, run

ON_023 = vllm.__version__.startswith("0.23")
REASONING = "granite" if ON_023 else "qwen3"
STEPS = () if ON_023 else (1, 2, 3, 1000)  # tokens a step


def thinking(thought: str, answer: str) -> str:
    if ON_023:
        return f"Here is my thought process: {thought} Here is my response: {answer}"
    return f"<think>{thought}</think>{answer}"


def context(tokenizer, reasoning: str = REASONING, tool: str | None = None) -> ModelContext:
    return ModelContext(
        name="tiny-llama",
        aliases=frozenset(),
        max_model_len=512,
        vocab_size=1024,
        tokenizer=tokenizer,
        tool_parser=load_parser(tokenizer, tool=tool, reasoning=reasoning) if tool else None,
        reasoning_parser=load_parser(tokenizer, reasoning=reasoning),
    )


@pytest.fixture
def ctx(tiny_tokenizer):
    return context(tiny_tokenizer)


def in_steps(tokenizer, text: str, tokens_per_step: int) -> list[tuple[str, list[int]]]:
    """The text as the router streams it: steps of whole tokens (the parsers read token deltas;
    vLLM's streaming granite parser, for one, misreads a marker split inside a token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    steps, done = [], ""
    for i in range(0, len(ids), tokens_per_step):
        upto = tokenizer.decode(ids[: i + tokens_per_step])
        steps.append((upto[len(done) :], ids[i : i + tokens_per_step]))
        done = upto
    assert done == text
    return steps


def fed(parsed, steps: list[tuple[str, list[int]]]) -> dict:
    """The reply streamed in these steps, assembled as a client does."""
    from serve_app.router.framing import ResponseFramer
    from serve_app.router.recompute import Emission

    framer = ResponseFramer(parsed, str)
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for i, (text, ids) in enumerate(steps):
        finish = "stop" if i == len(steps) - 1 else None
        for chunk in framer.chunks(Emission(text=text, token_ids=ids, finish_reason=finish)):
            choice = chunk["choices"][0]
            out["reasoning"] += choice["delta"].get("reasoning") or ""
            out["content"] += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or ():
                one = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                one["name"] += call["function"].get("name") or ""
                one["arguments"] += call["function"].get("arguments") or ""
            out["finish"] = choice["finish_reason"] or out["finish"]
    out["calls"] = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out["calls"].items())]
    return out


def test_the_routers_reasoning_parser_is_the_decode_engines():
    """vLLM's one flag sets the engine's parser (a grammar holds only the answer) and the server's
    (the reply split): here the router reads the decode engines' engine argument."""
    assert load_config({}).reasoning_parser == (None, None)
    assert load_config({"engine_kwargs": {"reasoning_parser": "qwen3"}}).reasoning_parser == ("qwen3", None)
    structured = {"structured_outputs_config": {"reasoning_parser": "granite", "reasoning_parser_plugin": "/p.py"}}
    assert load_config({"decode": {"engine_kwargs": structured}}).reasoning_parser == ("granite", "/p.py")
    # The flat argument wins over structured_outputs_config's, as in vLLM's EngineArgs.
    config = load_config({"engine_kwargs": {"reasoning_parser": "qwen3"}, "decode": {"engine_kwargs": structured}})
    assert config.reasoning_parser == ("qwen3", "/p.py")


def test_the_thinking_is_split_from_the_answer_streamed_at_any_pace_or_whole(ctx, tiny_tokenizer):
    parsed = parse_request("chat", {"messages": MESSAGES}, ctx)
    text = thinking("It is cold.", "Take a coat.")
    whole = reply(parsed, text)
    assert (whole["message"]["reasoning"].strip(), whole["message"]["content"].strip()) == ("It is cold.", "Take a coat.")
    assert whole["finish_reason"] == "stop"
    for k in STEPS:
        got = fed(parsed, in_steps(tiny_tokenizer, text, k))
        assert (got["reasoning"].strip(), got["content"].strip(), got["finish"]) == ("It is cold.", "Take a coat.", "stop"), k
    # Completions are never split (as on vLLM's server).
    assert parse_request("completions", {"prompt": "x"}, ctx).reasoning is None


def test_usage_counts_the_thinking_as_vllms_server_does(ctx, tiny_tokenizer):
    """vLLM 0.32's server reports every chat reply's thinking in usage where it has a reasoning
    parser (its parser's count: qwen3's, the tokens before the end marker); vLLM 0.23's reports
    none."""
    from serve_app.router.framing import ResponseFramer

    for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "include_reasoning": False}):
        parsed = parse_request("chat", body, ctx)
        for text, thought in ((thinking("It is cold.", "Take a coat."), "It is cold."), (thinking("", "Take a coat."), "")):
            ids = tiny_tokenizer.encode(text, add_special_tokens=False)
            usage = ResponseFramer(parsed, str).final(
                text=text, token_ids=ids, logprobs=None, finish_reason="stop", stop_reason=None, prompt_tokens=3
            )["usage"]
            assert usage["completion_tokens"] == len(ids)
            if ON_023:
                assert "completion_tokens_details" not in usage
            else:  # the thought's own tokens, not the markers'
                thought_tokens = len(tiny_tokenizer.encode(thought, add_special_tokens=False))
                assert usage["completion_tokens_details"] == {"reasoning_tokens": thought_tokens}
    # Completions never count it (as on vLLM's server).
    completion = parse_request("completions", {"prompt": "x"}, ctx)
    assert "completion_tokens_details" not in ResponseFramer(completion, str).usage_chunk(1, 5)["usage"]


def test_include_reasoning_false_leaves_it_out_and_the_tokens_that_spell_it(ctx, tiny_tokenizer):
    body = {"messages": MESSAGES, "include_reasoning": False, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    parsed = parse_request("chat", body, ctx)
    assert parsed.logprobs is None and parsed.sampling_params.logprobs is None and not parsed.returns_output_ids
    text = thinking("It is cold.", "Take a coat.")
    message = reply(parsed, text)["message"]
    assert "reasoning" not in message and message["content"].strip() == "Take a coat."
    for k in STEPS:
        got = fed(parsed, in_steps(tiny_tokenizer, text, k))
        assert got["reasoning"] == "" and got["content"].strip() == "Take a coat.", k
    # The output's token ids are hidden; the prompt's still come (as on vLLM 0.32's server).
    from serve_app.router.framing import ResponseFramer
    from serve_app.router.recompute import Emission

    whole = ResponseFramer(parsed, str).final(
        text=text, token_ids=[7] * 3, logprobs=None, finish_reason="stop", stop_reason=None, prompt_tokens=3
    )
    assert whole["prompt_token_ids"] == parsed.prompt_token_ids and whole["choices"][0].get("token_ids") is None
    (first, *_) = ResponseFramer(parsed, str).chunks(Emission(text="x", token_ids=[7], finish_reason=None))
    assert first["prompt_token_ids"] == parsed.prompt_token_ids and first["choices"][0].get("token_ids") is None


def test_a_named_or_required_call_follows_the_thinking(ctx, tiny_tokenizer):
    arguments = {"city": "Oslo", "days": 2}
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("get_weather")}, ctx)
    text = thinking("Need the weather.", json.dumps(arguments))
    message = reply(parsed, text)["message"]
    assert message["reasoning"].strip() == "Need the weather."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == arguments
    for k in STEPS:
        got = fed(parsed, in_steps(tiny_tokenizer, text, k))
        assert got["calls"] == [("get_weather", arguments)] and got["reasoning"].strip() == "Need the weather.", k
        assert got["finish"] == "stop" and not got["content"]
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, ctx)
    text = thinking("Need the weather.", json.dumps([{"name": "get_weather", "parameters": arguments}]))
    whole = reply(parsed, text)
    assert whole["finish_reason"] == "tool_calls" and json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == arguments
    for k in STEPS:
        got = fed(parsed, in_steps(tiny_tokenizer, text, k))
        assert got["calls"] == [("get_weather", arguments)] and got["finish"] == "tool_calls" and not got["content"], k


def test_auto_calls_follow_the_thinking(tiny_tokenizer):
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS}, context(tiny_tokenizer, tool="hermes"))
    text = thinking("Need a tool.", HERMES_CALL)
    whole = reply(parsed, text)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["reasoning"].strip() == "Need a tool."
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    for k in STEPS:
        got = fed(parsed, in_steps(tiny_tokenizer, text, k))
        assert got["calls"] == [("get_weather", {"city": "Oslo", "days": 2})] and got["finish"] == "tool_calls", k
        assert got["reasoning"].strip() == "Need a tool." and not got["content"].strip()


def test_thinking_off_in_the_template_is_off_for_the_parser(tiny_tokenizer):
    """The parser gets what the chat template got (``chat_template_kwargs``, and the
    ``enable_thinking`` that ``reasoning_effort: none`` implies): qwen3's reads a reply without
    <think> tags as all thinking unless thinking is off, as on vLLM's server."""
    if ON_023:
        pytest.skip("vLLM 0.23's qwen3 parser needs <think> tokens, which the tiny tokenizer lacks")
    ctx = context(tiny_tokenizer)
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        parsed = parse_request("chat", {"messages": MESSAGES, **off}, ctx)
        message = reply(parsed, "It rains.")["message"]
        assert message["content"] == "It rains." and not message.get("reasoning"), off
        for k in STEPS:
            got = fed(parsed, in_steps(tiny_tokenizer, "It rains.", k))
            assert (got["reasoning"], got["content"]) == ("", "It rains."), (off, k)
    # Thinking on (the default), cut short before it ended: reasoning, and content null.
    message = reply(parse_request("chat", {"messages": MESSAGES}, ctx), "<think>Still thinking", finish="length")["message"]
    assert message["reasoning"] == "Still thinking" and message["content"] is None


def test_reasoning_left_out_of_a_stream_whatever_the_parser_sends_or_fails_to(tiny_tokenizer):
    """``include_reasoning: false`` holds even where vLLM's parser sends the reasoning anyway
    (vLLM 0.32's drops it itself, 0.23's does not), and where it fails."""
    from serve_app.runtime.compat import DeltaMessage

    class Thinker:
        def __init__(self, *args, **kwargs):
            pass

        def parse_delta(self, delta_text, *args, **kwargs):
            return DeltaMessage(reasoning=delta_text) if delta_text.startswith("t") else DeltaMessage(content=delta_text)

    ctx = context(tiny_tokenizer)
    parsed = parse_request("chat", {"messages": MESSAGES, "include_reasoning": False}, ctx)
    split = dataclasses.replace(parsed.reasoning, parser_cls=Thinker)
    steps = [("think ", [7]), ("answer", [8])]
    assert fed(dataclasses.replace(parsed, reasoning=split), steps)["reasoning"] == ""
    shown = dataclasses.replace(split, include=True)
    got = fed(dataclasses.replace(parsed, reasoning=shown), steps)
    assert (got["reasoning"], got["content"]) == ("think ", "answer")

    class Failing(Thinker):
        def parse_delta(self, delta_text, *args, **kwargs):
            raise RuntimeError("broken parser")

        def parse(self, *args, **kwargs):
            raise RuntimeError("broken parser")

    # A parser that fails cannot tell thinking from answer: where thinking is hidden, none of the
    # text goes out (it may be thinking); where it is shown, the text goes out as content.
    hidden = dataclasses.replace(parsed, reasoning=dataclasses.replace(split, parser_cls=Failing))
    assert fed(hidden, steps) == {"reasoning": "", "content": "", "calls": [], "finish": "stop"}
    assert reply(hidden, "think answer")["message"]["content"] is None
    visible = dataclasses.replace(parsed, reasoning=dataclasses.replace(shown, parser_cls=Failing))
    assert fed(visible, steps)["content"] == "think answer" and reply(visible, "think answer")["message"]["content"] == "think answer"


def test_the_router_reads_replies_with_the_engines_parser(tiny_tokenizer):
    """The decode engines' reasoning_parser reaches the router's parsing, streamed or not. The
    mock engine writes no markers: qwen3's parser reads that as thinking never ended (Qwen3's
    template opens it in the prompt), granite's as an answer without thinking."""

    async def body(app: App) -> None:
        assert app.service.ctx.reasoning_parser is not None
        plain = {"messages": MESSAGES, "max_tokens": 8, "stream": False}
        status, data = await body_of(await app.service.http("chat", json.dumps(plain).encode()))
        message = data["choices"][0]["message"]
        assert status == 200
        said = (message.get("reasoning") or "") + (message.get("content") or "")
        status, events = await body_of(await app.service.http("chat", json.dumps({**plain, "stream": True}).encode()))
        deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
        assert status == 200 and said and "".join((d.get("reasoning") or "") + (d.get("content") or "") for d in deltas) == said
        assert bool(message.get("reasoning")) is not ON_023
        # Usage counts the thinking (vLLM 0.32): all of it here, streamed or whole, every choice's.
        details = None if ON_023 else {"reasoning_tokens": 8}
        assert data["usage"].get("completion_tokens_details") == details
        streamed = {**plain, "stream": True, "stream_options": {"include_usage": True}}
        for n, request in ((1, streamed), (2, streamed), (2, plain)):
            status, got = await body_of(await app.service.http("chat", json.dumps({**request, "n": n, "temperature": 1}).encode()))
            usage = got[-2]["usage"] if request["stream"] else got["usage"]
            assert status == 200 and usage["completion_tokens"] == 8 * n
            assert usage.get("completion_tokens_details") == (details and {"reasoning_tokens": 8 * n})

    run(body, args(engine_kwargs={"reasoning_parser": REASONING}), tiny_tokenizer)


def test_the_decode_engine_is_told_what_vllms_server_tells_it(tiny_tokenizer):
    """A reasoning model's chat request reaches the decode engine as vLLM's server hands it to
    its engine (``_engine_reasoning_kwargs``): the template's variables for the engine's reasoning
    parser, and ``reasoning_ended`` True where the client hides the thinking (a grammar then holds
    from the first token), else None (the engine reads the prompt); on every attempt, and on no
    prefill engine (it samples nothing a client sees). Not for completions, nor without a parser."""

    async def body(app: App) -> None:
        calls = engine_calls(app)
        kwargs = {"enable_thinking": False, "custom": [1, {"a": "b"}]}
        # Thinking off in the template: qwen3's parser reads the prompt as past its thinking
        # (granite's, on vLLM 0.23, has no such switch).
        off = None if ON_023 else True
        for extra, ended, template in (
            ({}, None, {}),
            ({"include_reasoning": False}, True, {}),
            ({"chat_template_kwargs": kwargs}, off, kwargs),
            ({"chat_template_kwargs": {"enable_thinking": True}}, None, {"enable_thinking": True}),
            ({"reasoning_effort": "none"}, off, {"reasoning_effort": "none", "enable_thinking": False}),
            ({"reasoning_effort": "none", "include_reasoning": False}, True, {"reasoning_effort": "none", "enable_thinking": False}),
        ):
            before = len(calls)
            status, _ = await body_of(await app.service.http("chat", json.dumps({"messages": MESSAGES, "max_tokens": 4, **extra}).encode()))
            assert status == 200
            sent = {call["engine"].split("-")[0]: call for call in calls[before:]}
            assert set(sent) == {"decode", "prefill"}
            decode = sent["decode"]
            assert (decode["reasoning_ended"], decode["reasoning_parser_kwargs"]) == (ended, {"chat_template_kwargs": template})
            assert (sent["prefill"]["reasoning_ended"], sent["prefill"]["reasoning_parser_kwargs"]) == (None, None)
        # The kwargs travel to the engine in msgpack: a number it cannot carry is the client's 400.
        huge = {"messages": MESSAGES, "max_tokens": 4, "chat_template_kwargs": {"x": [10**30]}}
        before = len(calls)
        status, error = await body_of(await app.service.http("chat", json.dumps(huge).encode()))
        assert status == 400 and error["error"]["param"] == "chat_template_kwargs" and calls[before:] == []
        before = len(calls)
        status, _ = await body_of(await app.service.http("completions", json.dumps({"prompt": "Hi", "max_tokens": 4}).encode()))
        assert status == 200 and {(c["reasoning_ended"], c["reasoning_parser_kwargs"]) for c in calls[before:]} == {(None, None)}

    run(body, args(engine_kwargs={"reasoning_parser": REASONING}), tiny_tokenizer)

    async def without_parser(app: App) -> None:
        calls = engine_calls(app)
        body = {"messages": MESSAGES, "max_tokens": 4, "include_reasoning": False}
        assert (await body_of(await app.service.http("chat", json.dumps(body).encode())))[0] == 200
        assert {(c["reasoning_ended"], c["reasoning_parser_kwargs"]) for c in calls} == {(None, None)}

    run(without_parser, args(), tiny_tokenizer)


def test_template_variables_the_engine_could_not_be_sent_are_a_400(ctx):
    """The variables travel to the decode engine in msgpack (``reasoning_parser_kwargs``): a
    number past 64 bits there failed every attempt's engine call, a 502 after max_attempts. One
    nested deeper than the range check looks went through; such nesting is refused as a whole."""
    from serve_app.router.errors import OpenAIError

    deep: object = 2**70
    for _ in range(70):
        deep = [deep]
    for kwargs, message in (({"x": [[2**70]]}, "holds a number outside"), ({"x": deep}, "nests deeper than 64 levels")):
        with pytest.raises(OpenAIError) as err:
            parse_request("chat", {"messages": MESSAGES, "chat_template_kwargs": kwargs}, ctx)
        assert err.value.status == 400 and err.value.param == "chat_template_kwargs" and message in str(err.value)
    assert parse_request("chat", {"messages": MESSAGES, "chat_template_kwargs": {"x": [[2**40]]}}, ctx)


def test_template_variables_the_models_parser_refuses_are_a_400(ctx):
    """The reply parser is built with the client's template variables (``reasoning_effort``
    among them), which a parser may refuse with a ValueError: a 400 naming the field, as vLLM's
    server answers, not a 500."""
    from serve_app.router.errors import OpenAIError

    class Picky(ctx.reasoning_parser):
        def __init__(self, *args, **kwargs):
            if (kwargs.get("chat_template_kwargs") or {}).get("reasoning_effort") == "high":
                raise ValueError("Unsupported reasoning_effort 'high'")
            super().__init__(*args, **kwargs)

    picky = dataclasses.replace(ctx, reasoning_parser=Picky)
    refused = (
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"reasoning_effort": "high"}}, "chat_template_kwargs"),
    )
    for body, param in refused:
        with pytest.raises(OpenAIError) as err:
            parse_request("chat", {"messages": MESSAGES, **body}, picky)
        assert err.value.status == 400 and err.value.param == param and "Unsupported reasoning_effort" in str(err.value)
    assert parse_request("chat", {"messages": MESSAGES, "reasoning_effort": "low"}, picky).reasoning is not None
