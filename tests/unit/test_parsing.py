"""Request validation and prompt building, with vLLM's protocol models and the tiny tokenizer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from serve_app.router.errors import OpenAIError
from serve_app.router.parsing import ModelContext, decode_json, parse_request, route_of


@pytest.fixture
def ctx(tiny_tokenizer):
    return ModelContext(name="tiny-llama", aliases=frozenset({"/m"}), max_model_len=128, vocab_size=1024, tokenizer=tiny_tokenizer)


def refused(ctx, route, body, status=400):
    with pytest.raises(OpenAIError) as err:
        parse_request(route, body, ctx)
    assert err.value.status == status
    return err.value


def test_completion_prompt_is_tokenized_once_with_bos(ctx, tiny_tokenizer):
    parsed = parse_request("completions", {"prompt": "The river", "max_tokens": 3}, ctx)
    assert parsed.prompt_token_ids == tiny_tokenizer.encode("The river")
    assert parsed.prompt_token_ids[0] == tiny_tokenizer.bos_token_id
    assert parse_request("completions", {"prompt": [5, 6, 7]}, ctx).prompt_token_ids == [5, 6, 7]
    assert parse_request("completions", {"prompt": ["one prompt"]}, ctx).prompt_token_ids == tiny_tokenizer.encode("one prompt")


def test_chat_template_applied_once_without_a_second_bos(ctx, tiny_tokenizer):
    parsed = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, ctx)
    assert parsed.prompt_token_ids.count(tiny_tokenizer.bos_token_id) == 1
    assert tiny_tokenizer.decode(parsed.prompt_token_ids) == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"


def test_text_like_content_parts_are_read_as_text_as_vllms_server_reads_them(ctx, tiny_tokenizer):
    """An OpenAI assistant turn sent back may hold a refusal part: vLLM's server renders it (and
    its other text-like parts) as text, one part a line; so does the router."""
    turn = [{"type": "refusal", "refusal": "I can't"}, {"type": "text", "text": "but"}]
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": turn}, {"role": "user", "content": "ok"}]}
    text = tiny_tokenizer.decode(parse_request("chat", body, ctx).prompt_token_ids)
    assert "<|assistant|>\nI can't\nbut<|end|>" in text, text


def test_a_misshapen_field_is_named_with_validators_built_for_the_models_own_fields_only(ctx):
    """A field of the wrong shape is found by validating each of the body's fields alone, with
    validators built once; a client's own keys (vLLM's models keep them) must not evict them,
    else every such request would rebuild them on the event loop."""
    from serve_app.router import parsing

    parsing._field_adapter.cache_clear()
    body = {**{f"junk{i}": 1 for i in range(300)}, "prompt": "x", "structured_outputs": []}  # the junk first
    assert refused(ctx, "completions", body).param == "structured_outputs"
    assert parsing._field_adapter.cache_info().currsize <= 2  # prompt, structured_outputs


def test_stop_strings_move_to_the_router_and_engines_skip_detokenizing(ctx):
    parsed = parse_request("completions", {"prompt": "x", "stop": ["a", "bc"], "max_tokens": 4, "temperature": 0}, ctx)
    assert parsed.stops == ["a", "bc"]
    params = parsed.sampling_params
    assert params.stop == [] and params.detokenize is False and params.max_tokens == 4 and params.temperature == 0
    assert parse_request("completions", {"prompt": "x", "stop": "z"}, ctx).stops == ["z"]


def test_logprobs_settings(ctx):
    assert parse_request("completions", {"prompt": "x", "logprobs": 3}, ctx).logprobs == 3
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, ctx).logprobs == 2
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}]}, ctx).logprobs is None
    assert refused(ctx, "completions", {"prompt": "x", "logprobs": 50}).param == "logprobs"


def test_structured_output_reaches_the_engines_as_vllm_builds_it(ctx):
    """``response_format`` and ``structured_outputs`` become vLLM's own ``StructuredOutputsParams``
    and survive the trip to an engine (a resumed attempt's grammar goes on from the earlier output:
    vllm_plugins/resumed_grammar.py)."""
    from serve_app.wire.sampling import decode_sampling, encode_sampling

    def engine_params(route: str, body: dict) -> Any:
        return decode_sampling(encode_sampling(parse_request(route, body, ctx).sampling_params))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    params = engine_params("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": json_schema})
    assert params.structured_outputs.json == schema
    params = engine_params("completions", {"prompt": "x", "response_format": {"type": "json_object"}})
    assert params.structured_outputs.json_object is True
    params = engine_params("completions", {"prompt": "x", "structured_outputs": {"regex": "[ab]+"}})
    assert params.structured_outputs.regex == "[ab]+"
    # vLLM's own check of the shape: one kind of constraint per request.
    error = refused(ctx, "completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert "structured" in error.message.lower()
    # A schema as a string is bounded as the body is (vLLM 0.23 would spend seconds converting it).
    def nested(levels: int) -> str:  # ``levels`` objects, one inside the other
        return '{"type": "array", "items": ' * (levels - 1) + "{}" + "}" * (levels - 1)

    assert refused(ctx, "completions", {"prompt": "x", "structured_outputs": {"json": nested(65)}}).param == "structured_outputs.json"
    assert engine_params("completions", {"prompt": "x", "structured_outputs": {"json": nested(64)}}).structured_outputs.json


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # served with echo only (test_echo.py)
        ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),  # served up to 20 (test_prompt_logprobs.py)
        ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completions", {"prompt": ["a"] * 129}, "prompt"),  # more choices than router.max_choices' default
        ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tool_choice"),  # tool_choice "auto", the default with tools: no tool-call parser here
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages"),
        ("completions", {"prompt": "x", "n": 129, "temperature": 1.0}, "n"),
        ("completions", {"prompt": "x", "n": 0}, "n"),
        ("completions", {"prompt": ""}, "prompt"),
    ],
)
def test_unsupported_or_bad_fields_are_named(ctx, route, body, param):
    named = refused(ctx, route, body).param
    assert named == param or named.startswith(param + "."), named  # the field, or a part of it


def test_lengths_against_the_model(ctx):
    long_prompt = list(range(10, 138))  # 128 tokens: no room left
    assert refused(ctx, "completions", {"prompt": long_prompt}).param == "prompt"
    assert parse_request("completions", {"prompt": [1, 2], "max_tokens": 126}, ctx).max_tokens == 126
    # One more: refused as vLLM 0.23's server does, cut down as 0.32's does (the next test).
    assert refused(replace(ctx, clamps_max_tokens=False), "completions", {"prompt": [1, 2], "max_tokens": 127}).param == "max_tokens"
    assert parse_request("completions", {"prompt": [1, 2], "max_tokens": 127}, replace(ctx, clamps_max_tokens=True)).max_tokens == 126


def test_model_names(ctx):
    assert parse_request("completions", {"prompt": "x", "model": "/m"}, ctx).model == "/m"
    err = refused(ctx, "completions", {"prompt": "x", "model": "other"}, status=404)
    assert err.param == "model"
    assert err.body()["error"] == {"message": err.message, "type": "invalid_request_error", "param": "model", "code": 404}


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(
    "extra,param",
    [
        ({"kv_transfer_params": {"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/x"}}, "kv_transfer_params"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
        ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
        ({"pd_resumed_output_tokens": 3}, "pd_resumed_output_tokens"),
        ({"vllm_xargs": {"pd_resumed_output_tokens": 3}}, "vllm_xargs.pd_resumed_output_tokens"),
    ],
)
def test_clients_cannot_set_kv_transfer_params(ctx, route, extra, param):
    body = {"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert refused(ctx, route, {**body, **extra}).param == param


def test_other_vllm_xargs_reach_the_engine_but_never_kv_transfer_params(ctx):
    parsed = parse_request("completions", {"prompt": "x", "vllm_xargs": {"my_processor_arg": 3}}, ctx)
    assert parsed.sampling_params.extra_args == {"my_processor_arg": 3}


def test_json_and_routes():
    with pytest.raises(OpenAIError):
        decode_json(b"{")
    assert route_of({"messages": []}) == "chat" and route_of({"prompt": "x"}) == "completions"


def test_a_client_template_past_its_time_bound_is_stopped_in_its_thread_and_the_tracer_restored(tiny_tokenizer):
    """The bound is a trace function on the rendering thread: it must stop the template there
    (a 400 naming where the template came from) and leave the thread's own tracer (a debugger's,
    coverage's) as it was, or every later request on that worker thread would run untraced."""
    import sys

    ctx = ModelContext(
        name="tiny-llama",
        aliases=frozenset(),
        max_model_len=128,
        vocab_size=1024,
        tokenizer=tiny_tokenizer,
        trust_request_chat_template=True,
        client_template_timeout_s=0.0,
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    trivial = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def tracer(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        err = refused(ctx, "chat", {**body, "chat_template_kwargs": {"chat_template": trivial}})
        after = sys.gettrace()
    finally:
        sys.settrace(before)
    assert err.param == "chat_template_kwargs.chat_template" and "did not finish" in err.message
    assert after is tracer
    assert parse_request("chat", body, ctx).prompt_token_ids  # the server's own template: no bound


def test_token_ids_a_request_names_in_the_vocabulary_are_accepted_on_every_vllm(ctx):
    """allowed_token_ids, logit_bias and stop_token_ids within the vocabulary parse (on vLLM 0.23,
    whose allowed-token check takes a tokenizer, the router's own check stood in the way of every
    such request: it is skipped there and the engine checks); one past it is a 400 wherever vLLM's
    check has the shape the router calls."""
    body = {"prompt": [5, 6], "allowed_token_ids": [5, 6, 7], "logit_bias": {"7": 1.0}, "stop_token_ids": [9]}
    parsed = parse_request("completions", body, ctx)
    assert parsed.sampling_params.allowed_token_ids == [5, 6, 7]
    assert "logit_bias" in str(refused(ctx, "completions", {"prompt": [5], "logit_bias": {"5000": 1.0}}))


def test_repetition_detection_within_the_bound_reaches_the_engine_and_past_it_is_a_400(ctx):
    """vLLM's repetition_detection (0.32 and 0.23) is checked by the engine core after every token, for
    each pattern length up to max_pattern_size: bounded, so that one client cannot slow every
    other request's step with it."""
    from vllm import sampling_params

    from serve_app.router.parsing import MAX_REPETITION_PATTERN

    if not hasattr(sampling_params, "RepetitionDetectionParams"):
        pytest.skip("this vLLM has no repetition_detection")

    detection = {"max_pattern_size": MAX_REPETITION_PATTERN, "min_pattern_size": 2, "min_count": 3}
    parsed = parse_request("completions", {"prompt": [5, 6], "repetition_detection": detection}, ctx)
    sent = parsed.sampling_params.repetition_detection
    assert (sent.max_pattern_size, sent.min_pattern_size, sent.min_count) == (MAX_REPETITION_PATTERN, 2, 3)
    too_long = {"prompt": [5], "repetition_detection": {**detection, "max_pattern_size": MAX_REPETITION_PATTERN + 1}}
    assert "repetition_detection.max_pattern_size" in str(refused(ctx, "completions", too_long))


def test_chat_template_inputs_are_passed_on_or_refused_never_dropped(tiny_tokenizer):
    """A message's name and reasoning, and the request's reasoning_effort (with enable_thinking
    unless the client set it), and a tool-calling turn's calls and results, reach the template as
    on vLLM's server."""
    from unittest import mock

    from serve_app.router.errors import OpenAIError
    from serve_app.router.parsing import ModelContext, parse_request

    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello", "reasoning": "a greeting"},
        {"role": "user", "content": "More"},
    ]
    with mock.patch.object(tiny_tokenizer, "apply_chat_template", return_value="text") as render:
        parse_request("chat", {"messages": messages, "reasoning_effort": "none"}, ctx)
        (conversation,), kwargs = render.call_args
        assert conversation[0]["name"] == "ann" and conversation[1]["reasoning_content"] == conversation[1]["reasoning"] == "a greeting"
        assert kwargs["reasoning_effort"] == "none" and kwargs["enable_thinking"] is False
        own = {"enable_thinking": False, "reasoning_effort": "high"}
        parse_request("chat", {"messages": messages, "reasoning_effort": "low", "chat_template_kwargs": own}, ctx)
        # The client's own enable_thinking wins; the reasoning_effort field wins over its kwargs.
        assert render.call_args[1]["enable_thinking"] is False and render.call_args[1]["reasoning_effort"] == "low"
        empty = [{"role": "assistant", "content": "Hello", "reasoning": ""}, {"role": "user", "content": "More"}]
        parse_request("chat", {"messages": empty}, ctx)
        assert render.call_args[0][0][0]["reasoning"] == ""  # passed on, as vLLM does
        parse_request("chat", {"messages": messages}, ctx)
        assert "reasoning_effort" not in render.call_args[1] and "enable_thinking" not in render.call_args[1]
        # A tool-calling turn reaches the template with its calls (arguments as an object, as
        # vLLM's server passes them) and the tool's answer with its call's id.
        calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
        turns = [{"role": "assistant", "content": None, "tool_calls": calls}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
        parse_request("chat", {"messages": turns}, ctx)
        rendered = render.call_args[0][0]
        assert rendered[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}} and rendered[1]["tool_call_id"] == "c1"
    with pytest.raises(OpenAIError) as refused:
        parse_request("chat", {"messages": [{"role": "user", "content": "ok", "tool_calls": calls}]}, ctx)
    assert refused.value.status == 400 and refused.value.param == "messages.0.tool_calls"
    with pytest.raises(OpenAIError) as refused:  # vLLM's own message models refuse it first
        parse_request("chat", {"messages": [{"role": "tool", "content": "42", "tool_call_id": 7}]}, ctx)
    assert refused.value.status == 400 and "tool_call_id" in refused.value.message


@pytest.mark.parametrize("clamps", [False, True])
def test_truncate_prompt_tokens_cuts_as_vllms_renderer_does(ctx, tiny_tokenizer, clamps):
    """vLLM's truncate_prompt_tokens: the first tokens (the tokenizer's side) or, with
    truncation_side left, the last; at most, and with -1 exactly, what fits: vLLM 0.23's server
    keeps room for max_tokens (a larger truncation refused), vLLM 0.32's, which cuts max_tokens
    down, keeps a token of room (a truncation past the context refused). Against the installed
    vLLM's own TokenizeParams where it reads it the same way."""
    from vllm.renderers.params import TokenizeParams

    from serve_app.runtime.compat import CLAMPS_MAX_TOKENS

    ctx = replace(ctx, clamps_max_tokens=clamps)
    prompt = list(range(10, 210))  # 200 tokens, over the context of 128
    for side in (None, "left", "right"):
        for max_tokens in (1, 4):
            bound, room = (128, 127) if clamps else (128 - max_tokens, 128 - max_tokens)
            for keep in (1, 5, 124, 127, 128):
                body = {"prompt": prompt, "truncate_prompt_tokens": keep, "truncation_side": side, "max_tokens": max_tokens}
                if keep > bound:
                    assert refused(ctx, "completions", body).param == "truncate_prompt_tokens"
                    continue
                if keep > room:  # 0.32: the whole context kept, none left for output (vLLM refuses it then too)
                    assert "leaves no room" in refused(ctx, "completions", body).message
                    continue
                ours = parse_request("completions", {**body}, ctx).prompt_token_ids
                assert ours == (prompt[-keep:] if side == "left" else prompt[:keep]), body
                if clamps == CLAMPS_MAX_TOKENS:
                    theirs = TokenizeParams(
                        max_total_tokens=128, max_output_tokens=max_tokens, truncate_prompt_tokens=keep, truncation_side=side
                    )._token_truncation(tiny_tokenizer, prompt)
                    assert ours == theirs, body
            body = {"prompt": prompt, "truncate_prompt_tokens": -1, "truncation_side": side, "max_tokens": max_tokens}
            cut = parse_request("completions", body, ctx)
            assert cut.prompt_token_ids == (prompt[-room:] if side == "left" else prompt[:room])
    # A text prompt too long for the context is tokenized whole before it is cut; an echo is
    # the prompt as sent, as vLLM's server echoes it.
    long_text = "the river " * 2000
    body = {"prompt": long_text, "truncate_prompt_tokens": 20, "truncation_side": "left", "echo": True}
    parsed = parse_request("completions", body, ctx)
    assert parsed.prompt_token_ids == tiny_tokenizer.encode(long_text)[-20:] and parsed.echo == long_text
    messages = [{"role": "user", "content": long_text}]
    assert len(parse_request("chat", {"messages": messages, "truncate_prompt_tokens": -1}, ctx).prompt_token_ids) == 127
    assert refused(ctx, "chat", {"messages": messages}).param == "messages"


@pytest.mark.parametrize("clamps", [False, True])
def test_a_max_tokens_past_the_prompts_room_is_cut_down_or_refused_as_the_installed_vllms_server_does(ctx, clamps):
    """vLLM 0.32's server cuts max_tokens down to what the prompt leaves of the context; vLLM
    0.23's refuses the request. Both refuse a max_tokens over the whole context, and a prompt that
    leaves no room. The router does as the installed vLLM does (checked against its own renderer
    bound and get_max_tokens), each prompt of a list for itself."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.renderers.params import TokenizeParams

    from serve_app.runtime.compat import CLAMPS_MAX_TOKENS

    ctx = replace(ctx, clamps_max_tokens=clamps)
    prompt = list(range(10, 110))  # 100 tokens of the context's 128
    for prompt_ids, max_tokens in ((prompt, 28), (prompt, 29), (prompt, 128), (prompt, 129), (list(range(10, 138)), 1), (prompt[:50], 60)):
        body = {"prompt": prompt_ids, "max_tokens": max_tokens}
        fits = len(prompt_ids) + max_tokens <= 128
        if max_tokens > 128 or len(prompt_ids) >= 128 or not (fits or clamps):
            err = refused(ctx, "completions", body)
            assert err.param == ("prompt" if len(prompt_ids) >= 128 else "max_tokens"), body
            ours = None
        else:
            ours = parse_request("completions", body, ctx).sampling_params.max_tokens
            assert ours == min(max_tokens, 128 - len(prompt_ids)), body
        if clamps == CLAMPS_MAX_TOKENS:  # the installed vLLM's server: its renderer's bound, then get_max_tokens
            try:
                TokenizeParams(max_total_tokens=128, max_output_tokens=max_tokens)._token_len_check(None, prompt_ids)
                theirs = get_max_tokens(128, max_tokens, len(prompt_ids), {})
            except Exception:
                theirs = None
            assert ours == (theirs if theirs else None), body
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 510}
    if clamps:
        assert parse_request("chat", chat, replace(ctx, max_model_len=512)).sampling_params.max_tokens < 510
    else:
        assert refused(replace(ctx, max_model_len=512), "chat", chat).param == "max_completion_tokens"
    listed = {"prompt": [prompt, prompt[:50]], "max_tokens": 60}
    if clamps:
        assert [c.sampling_params.max_tokens for c in parse_request("completions", listed, ctx).choices] == [28, 60]
    else:
        assert refused(ctx, "completions", listed).param == "max_tokens"


@pytest.mark.parametrize("trusted", [False, True])
def test_retrieval_documents_reach_the_chat_template_as_on_vllms_server(tiny_tokenizer, trusted):
    """``documents`` (RAG templates read them) are rendered by the template, and the prompt's ids
    are those vLLM's own renderer makes of the same request."""
    pytest.importorskip("vllm.renderers.online_renderer", reason="vLLM 0.23 builds its renderer over an engine client")
    import asyncio

    from tests.support import vllm_renderer

    documents = [{"title": "Mill", "text": "The mill stood by the river."}, {"title": "Gare", "text": "Où est la gare ? 東京"}]
    body = {"messages": [{"role": "user", "content": "Where is the mill?"}], "documents": documents, "max_tokens": 4}
    if trusted:  # a template that reads them (the tiny model's own does not)
        body["chat_template"] = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[0].content }}"
    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)
    ctx.trust_request_chat_template = trusted
    ids = parse_request("chat", body, ctx).prompt_token_ids
    online = vllm_renderer.online_renderer(256, trust_request_chat_template=trusted)
    assert ids == asyncio.run(vllm_renderer.chat_prompt_ids(online, body))
    assert ("[Mill] The mill stood by the river." in tiny_tokenizer.decode(ids)) is trusted


@pytest.mark.parametrize("truncate", [None, 4])
def test_return_prompt_text_is_the_conversation_vllms_renderer_shows(tiny_tokenizer, truncate):
    """A chat request's ``return_prompt_text``: the rendered conversation, as vLLM's server shows
    it (whole, where ``truncate_prompt_tokens`` cuts its tokens); none unless asked for."""
    pytest.importorskip("vllm.renderers.online_renderer", reason="vLLM 0.23 builds its renderer over an engine client")
    import asyncio

    from tests.support import vllm_renderer

    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ?"}], "max_tokens": 4}
    if truncate is not None:
        body["truncate_prompt_tokens"] = truncate
    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)
    assert parse_request("chat", body, ctx).prompt_text is None
    parsed = parse_request("chat", {**body, "return_prompt_text": True}, ctx)
    expected = asyncio.run(vllm_renderer.chat_prompt_text(vllm_renderer.online_renderer(256), body))
    assert parsed.prompt_text == expected and "Où est la gare ?" in expected
    assert len(parsed.prompt_token_ids) == (truncate or len(tiny_tokenizer.encode(expected, add_special_tokens=False)))


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TURN_CALL = {"role": "assistant", "content": None, "tool_calls": [CALL]}


@pytest.mark.parametrize(
    "messages,extra",
    [
        ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),  # as a system turn
        ([{"role": "user", "content": "Hi"}, {"role": "developer", "content": "Be brief."}], {}),  # moved first
        ([{"role": "system", "content": "A."}, {"role": "developer", "content": "B."}, {"role": "user", "content": "Hi"}], {}),
        ([{"role": "user", "content": "Hi"}, TURN_CALL, {"role": "tool", "content": "x", "tool_call_id": "c1"}], {}),
        ([{"role": "system", "content": []}, {"role": "user", "content": "Hi"}], {}),  # an empty list of parts: ""
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {}),
    ],
)
def test_a_chat_prompt_is_the_one_vllms_renderer_makes(tiny_tokenizer, messages, extra):
    """Roles, tool-call turns and empty tools as vLLM's server renders them."""
    pytest.importorskip("vllm.renderers.online_renderer", reason="vLLM 0.23 builds its renderer over an engine client")
    import asyncio

    from tests.support import vllm_renderer

    body = {"messages": messages, "max_tokens": 4, **extra}
    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)
    ours = parse_request("chat", body, ctx).prompt_token_ids
    assert ours == asyncio.run(vllm_renderer.chat_prompt_ids(vllm_renderer.online_renderer(256), body))
