"""Tool calls (router/tools.py): named and required choices, and "auto" read by a configured
vLLM tool-call parser. Parsing with vLLM's request models and the tiny tokenizer, the response
framing, and the whole router on mock engines (tests/support/inprocess.py). test_foundation.py
runs named and required choices on real engines, where the grammar constrains the output;
test_cdcp.py and test_recompute_e2e.py run "auto" with vLLM's hermes parser, and test_cdcp.py
named and required choices in hermes' own format."""

from __future__ import annotations

import dataclasses
import json

import pytest

from serve_app.router.errors import OpenAIError
from serve_app.router.framing import ResponseFramer
from serve_app.router.output_parsers import load_parser
from serve_app.router.parsing import ModelContext, parse_request
from serve_app.router.recompute import Emission
from serve_app.router.tools import (
    ForcedCall,
    ParsedCalls,
    RequiredCalls,
    RequiredCallsStream,
    forces_json,
    no_parameters,
    required_tool_calls,
)
from tests.support.chat_replies import HERMES_CALL, MESSAGES, TOOLS, WEATHER, named, reply
from tests.support.inprocess import App, args, body_of, run


@pytest.fixture
def ctx(tiny_tokenizer):
    return ModelContext(name="tiny-llama", aliases=frozenset(), max_model_len=512, vocab_size=1024, tokenizer=tiny_tokenizer)


def refused(ctx, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse_request("chat", body, ctx)
    assert err.value.status == 400
    return err.value


def test_a_named_function_constrains_the_reply_to_its_arguments(ctx):
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("get_weather")}, ctx)
    assert parsed.tool_choice.name == "get_weather" and parsed.tool_choice.call_id.startswith("chatcmpl-tool-")
    assert parsed.sampling_params.structured_outputs.json == WEATHER
    # A function without parameters takes an object, never an unconstrained output.
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("now")}, ctx)
    assert parsed.sampling_params.structured_outputs.json == no_parameters()
    # "none": the tools reach the template, the reply is text.
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, ctx)
    assert parsed.tool_choice is None and parsed.sampling_params.structured_outputs is None


def test_required_calls_are_an_array_of_the_tools_calls(ctx):
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, ctx)
    schema = parsed.sampling_params.structured_outputs.json
    assert isinstance(parsed.tool_choice, RequiredCalls) and schema["type"] == "array" and schema["minItems"] == 1
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["now"]]
    assert [v["properties"]["parameters"] for v in variants] == [WEATHER, no_parameters()] and "maxItems" not in schema
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    assert parse_request("chat", body, ctx).sampling_params.structured_outputs.json["maxItems"] == 1
    # A tool's $defs move to the top, where its $refs point; two tools defining one name differently: a 400.
    with_defs = {"type": "object", "properties": {"d": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "integer"}}}
    other = {"type": "object", "properties": {}, "$defs": {"D": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": with_defs}}]
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}, ctx)
    schema = parsed.sampling_params.structured_outputs.json
    assert schema["$defs"] == {"D": {"type": "integer"}} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    tools.append({"type": "function", "function": {"name": "b", "parameters": other}})
    assert refused(ctx, {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}).param == "tools"


def test_a_named_or_required_tools_schema_is_bounded_in_depth_as_vllm_0_32_bounds_it(ctx):
    """The schema is an object in the body, which Python's parser takes 1,000 levels deep; its
    grammar costs steeply more with depth (vLLM 0.23, on Ascend, does not bound it)."""
    deep = json.loads('{"type": "array", "items": ' * 70 + "{}" + "}" * 70)
    tools = [{"type": "function", "function": {"name": "deep", "parameters": deep}}]
    for choice in (named("deep"), "required"):
        assert refused(ctx, {"messages": MESSAGES, "tools": tools, "tool_choice": choice}).param == "structured_outputs.json"
    shallow = json.loads('{"type": "array", "items": ' * 20 + "{}" + "}" * 20)
    tools = [{"type": "function", "function": {"name": "deep", "parameters": shallow}}]
    for choice in (named("deep"), "required"):
        assert parse_request("chat", {"messages": MESSAGES, "tools": tools, "tool_choice": choice}, ctx).tool_choice is not None


def test_a_named_choice_takes_the_last_tool_of_its_name_and_goes_with_a_plain_text_format(ctx):
    """As vLLM's server: its tools by name are a map (the last one wins), and a response_format
    of "text" constrains nothing (some clients always send it); a real format is refused."""
    first = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": MESSAGES, "tools": [first, *TOOLS], "tool_choice": named("get_weather")}
    assert parse_request("chat", body, ctx).sampling_params.structured_outputs.json == WEATHER
    for choice in (named("get_weather"), "required"):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "response_format": {"type": "text"}}
        assert parse_request("chat", body, ctx).tool_choice is not None
        assert refused(ctx, {**body, "response_format": {"type": "json_object"}}).param == "response_format"


def test_auto_needs_a_model_specific_parser_and_is_refused_saying_what_works(ctx):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        error = refused(ctx, {"messages": MESSAGES, **body})
        assert error.param == "tool_choice" and "name the function" in error.message, body
    assert refused(ctx, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("missing")}).param.startswith("tool_choice")
    assert refused(ctx, {"messages": MESSAGES, "tool_choice": named("now")}).param == "tool_choice"  # no tools
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("now"), "response_format": {"type": "json_object"}}
    assert refused(ctx, body).param == "response_format"


def test_a_required_choices_calls_stream_whole_as_each_object_completes():
    """In one pass over the output (a string's braces and escaped quotes are no structure),
    whatever the chunking: 1, 2, 3 or 7 characters, or all at once."""
    text = '[ {"name": "get_weather", "parameters": {"city": "Oslo }", "days": {"n": 2}}} ,\n{"name":"now","parameters":{}}]'
    whole = required_tool_calls(text)
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == [
        (0, "get_weather", {"city": "Oslo }", "days": {"n": 2}}),
        (1, "now", {}),
    ]
    for step in (1, 2, 3, 7, len(text)):
        stream = RequiredCallsStream()
        calls = [c for i in range(0, len(text), step) for c in stream.feed(text[i : i + step])]
        assert [(c["index"], c["function"]) for c in calls] == [(c["index"], c["function"]) for c in whole], step
        assert len({c["id"] for c in calls}) == 2
    # Each call as soon as its object closes, not at the array's end.
    first_end = text.index("}} ,") + 2
    stream = RequiredCallsStream()
    assert stream.feed(text[: first_end - 1]) == [] and len(stream.feed(text[first_end - 1 : first_end])) == 1
    assert stream.feed(text[first_end:-2]) == [] and stream.feed(text[-2:])[0]["function"]["name"] == "now"
    # A call JSON cannot take (arguments nested past Python's recursion limit) is left out, not raised.
    deep = '[{"name": "now", "parameters": ' + "[" * 2000 + "]" * 2000 + "}]"
    assert RequiredCallsStream().feed(deep) == [] and required_tool_calls(deep) == []
    # Cut short (out of tokens): no calls.
    assert required_tool_calls(text[:-30]) == [] and required_tool_calls("{}") == []


def test_tools_and_tool_turns_reach_the_template_as_vllm_passes_them(tiny_tokenizer):
    template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}{% endfor %}"
    )
    ctx = ModelContext(name="tiny-llama", aliases=frozenset(), max_model_len=512, vocab_size=1024, tokenizer=tiny_tokenizer)
    ctx.trust_request_chat_template = True
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
    ]
    parsed = parse_request("chat", {"messages": messages, "tools": TOOLS, "tool_choice": "none", "chat_template": template}, ctx)
    text = tiny_tokenizer.decode(parsed.prompt_token_ids, skip_special_tokens=True)
    for part in ("[tool get_weather][tool now]", "[call c1 get_weather city=Oslo]", "<tool>rain[result of c1]"):
        assert part in text.replace(" [", "["), text
    # Arguments that are not a JSON object become an empty one (the history stays usable).
    for bad in ("not json", "[1, 2]", "[" * 5000 + "]" * 5000):
        broken = {**call, "function": {**call["function"], "arguments": bad}}
        body = {"messages": MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [broken]}], "chat_template": template}
        assert "city=]" in tiny_tokenizer.decode(parse_request("chat", body, ctx).prompt_token_ids).replace(" ", "")
    body = {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]}
    assert refused(ctx, body).param == "messages.0.tool_calls"


def test_the_reply_is_the_calls_arguments_streamed_or_not(tiny_tokenizer):
    async def body(app: App) -> None:
        plain = {"messages": MESSAGES, "max_tokens": 8}
        status, text = await body_of(await app.service.http("chat", json.dumps(plain).encode()))
        assert status == 200
        content = text["choices"][0]["message"]["content"]
        forced = {**plain, "tools": TOOLS, "tool_choice": named("get_weather")}
        status, data = await body_of(await app.service.http("chat", json.dumps(forced).encode()))
        assert status == 200, data
        choice = data["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        # The mock engine ignores the grammar: the arguments are exactly the text it produced.
        assert call["function"] == {"name": "get_weather", "arguments": content} and call["type"] == "function"
        assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"

        status, events = await body_of(await app.service.http("chat", json.dumps({**forced, "stream": True}).encode()))
        assert status == 200
        deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
        assert deltas[0]["role"] == "assistant" and not deltas[0]["content"] and not deltas[0].get("tool_calls")
        calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function" and calls[0]["id"]
        assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
        assert "".join(c["function"]["arguments"] for c in calls) == content
        assert not any(d.get("content") for d in deltas)

    run(body, args(), tiny_tokenizer)


def test_a_required_reply_cut_short_has_no_calls_and_no_text(tiny_tokenizer):
    """The mock engine ignores the grammar, so its text is no array, as a reply that ran out of
    tokens: neither calls nor text, as on vLLM's server, and finish_reason "length" says why.
    test_foundation.py has real engines write the calls."""

    async def body(app: App) -> None:
        forced = {"messages": MESSAGES, "max_tokens": 8, "tools": TOOLS, "tool_choice": "required"}
        status, data = await body_of(await app.service.http("chat", json.dumps(forced).encode()))
        assert status == 200, data
        choice = data["choices"][0]
        # (vLLM 0.23's message model writes an empty tool_calls list, 0.32's none.)
        assert {k: v for k, v in choice["message"].items() if v != []} == {"role": "assistant", "content": ""}
        assert choice["finish_reason"] == "length"
        status, events = await body_of(await app.service.http("chat", json.dumps({**forced, "stream": True}).encode()))
        deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
        assert status == 200 and not any(d.get("tool_calls") or d.get("content") for d in deltas)

    run(body, args(), tiny_tokenizer)


# ---------------------------------------------------------------- tool_choice "auto", with a parser

@pytest.fixture
def auto_ctx(ctx, tiny_tokenizer):
    return dataclasses.replace(ctx, tool_parser=load_parser(tiny_tokenizer, tool="hermes"))


def test_auto_is_served_with_a_tool_call_parser_as_vllms_server_adjusts_it(auto_ctx):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):  # "auto" is the default with tools
        parsed = parse_request("chat", {"messages": MESSAGES, **body}, auto_ctx)
        assert isinstance(parsed.tool_choice, ParsedCalls) and parsed.tool_choice.request.tools[0].function.name == "get_weather"
        # hermes keeps special tokens in the text (its markers are special tokens in some models).
        assert parsed.skip_special_tokens is False and parsed.sampling_params.skip_special_tokens is False
        assert parsed.sampling_params.structured_outputs is None  # the model may answer in text
    # The model decides, so a client's grammar may come too (as on vLLM's server).
    body = {"messages": MESSAGES, "tools": TOOLS, "structured_outputs": {"regex": "[a-z]+"}}
    assert parse_request("chat", body, auto_ctx).sampling_params.structured_outputs.regex == "[a-z]+"
    # Named and required choices: the router's own JSON where vLLM forces JSON with this parser
    # (below for the other case); "none" is text.
    required = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, auto_ctx)
    assert isinstance(required.tool_choice, RequiredCalls if forces_json(auto_ctx.tool_parser) else ParsedCalls)
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, auto_ctx)
    assert parsed.tool_choice is None and parsed.skip_special_tokens is True
    # A strict tool: vLLM 0.32 holds a call's arguments to its schema once the model opens one
    # (a structural tag triggered by hermes' marker); vLLM 0.23 does not.
    from vllm import envs

    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
    outputs = parse_request("chat", {"messages": MESSAGES, "tools": strict}, auto_ctx).sampling_params.structured_outputs
    if getattr(envs, "VLLM_ENFORCE_STRICT_TOOL_CALLING", False):
        tag = json.loads(outputs.structural_tag)
        assert "<tool_call>" in json.dumps(tag) and "get_weather" in json.dumps(tag)
    else:
        assert outputs is None


@pytest.fixture
def native_ctx(ctx, tiny_tokenizer, tmp_path):
    """hermes as vLLM 0.32 has it (a format xgrammar knows): a named or required choice is
    served in the model's own format, not vLLM's JSON. A subclass says so on any vLLM version."""
    plugin = tmp_path / "pd_native_tool_parser.py"
    plugin.write_text(
        "from vllm.tool_parsers import ToolParserManager\n"
        "from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser\n"
        "ToolParserManager.register_module('pd_native_calls', module=type('PdNativeCalls', (Hermes2ProToolParser,), "
        "{'supports_required_and_named': False}))\n"
    )
    return dataclasses.replace(ctx, tool_parser=load_parser(tiny_tokenizer, tool="pd_native_calls", tool_plugin=str(plugin)))


def test_a_parser_that_is_not_vllms_json_serves_named_and_required_choices_in_its_own_format(native_ctx, auto_ctx, tiny_tokenizer):
    """As vLLM's server: where the tool parser does not take vLLM's JSON for a named or required
    choice (``supports_required_and_named``), the request is adjusted by the parser (vLLM 0.32:
    a structural tag holding the model to calls in its format) and the calls are read by it."""
    from vllm import envs
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    # vLLM 0.32's own hermes parser is such a parser (a structural tag model, strict calling on).
    strict = getattr(envs, "VLLM_ENFORCE_STRICT_TOOL_CALLING", False) and getattr(
        auto_ctx.tool_parser.tool_parser_cls, "structural_tag_model", None
    )
    assert forces_json(auto_ctx.tool_parser) is not bool(strict) and not forces_json(native_ctx.tool_parser)
    for choice in ("required", named("get_weather")):
        parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}, native_ctx)
        assert isinstance(parsed.tool_choice, ParsedCalls) and parsed.tool_choice.forced
        assert parsed.tool_choice.named is (choice != "required")
        assert parsed.sampling_params.skip_special_tokens is False  # hermes' adjustment, as for auto
        # The grammar is what vLLM's parser makes of the request (on vLLM 0.23 its JSON, on 0.32
        # the parser's structural tag), not the router's own.
        outputs = parsed.sampling_params.structured_outputs
        theirs = ChatCompletionRequest(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice)
        native_ctx.tool_parser(tiny_tokenizer, theirs.tools).adjust_request(theirs)
        assert outputs == theirs.structured_outputs
        if strict:
            assert outputs.json is None
            tag = json.loads(outputs.structural_tag)
            assert tag["format"]["at_least_one"] is True and tag["format"]["stop_after_first"] is (choice != "required")
            names = {t["begin"].split('"name": "')[1].split('"')[0] for t in tag["format"]["tags"]}
            assert names == ({"get_weather", "now"} if choice == "required" else {"get_weather"})
        # Another grammar beside a choice that forces calls is a 400, as with the router's own.
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "response_format": {"type": "json_object"}}
        assert refused(native_ctx, body).param == "response_format"
        assert refused(native_ctx, {**body, "tool_choice": named("missing")}).param.startswith("tool_choice")
    # With a parser that takes vLLM's JSON (vLLM 0.32 makes every structural tag model's False),
    # the router's own JSON grammar.
    json_only = {"supports_required_and_named": True, "structural_tag_model": None}
    json_calls = type("JsonCalls", (native_ctx.tool_parser.tool_parser_cls,), json_only)
    hermes_json = dataclasses.replace(native_ctx, tool_parser=type("Json", (native_ctx.tool_parser,), {"tool_parser_cls": json_calls}))
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named("now")}, hermes_json)
    assert isinstance(parsed.tool_choice, ForcedCall) and parsed.sampling_params.structured_outputs.json == no_parameters()


def test_a_named_or_required_choice_in_the_parsers_format_is_framed_as_vllms_server_frames_it(native_ctx):
    """Calls read by the parser, whole or streamed at any pace; content "" beside them (vLLM
    0.32 writes ``content or ""`` for these choices; 0.23 drops the text); "tool_calls" ends a
    required choice's reply, "stop" a named one's; a reply cut short inside its call has no call
    and keeps its finish."""
    second = HERMES_CALL.replace("Oslo", "Bergen")
    for choice, finish in (("required", "tool_calls"), (named("get_weather"), "stop")):
        parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}, native_ctx)
        text = HERMES_CALL if choice != "required" else HERMES_CALL + "\n" + second
        want = [("get_weather", {"city": "Oslo", "days": 2})]
        if choice == "required":
            want.append(("get_weather", {"city": "Bergen", "days": 2}))
        whole = reply(parsed, text)
        assert whole["finish_reason"] == finish and whole["message"]["content"] == "", whole
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] == want
        for step in (1, 3, 16, len(text)):
            content, calls, last = streamed(parsed, text, step)
            assert not content.strip() and last == finish, step
            assert [(name, json.loads(arguments)) for _, name, arguments in calls] == want, step
        # Cut short inside the call: no call, and the text as content, as vLLM 0.32 sends it
        # (hermes' parser, not one of its engine-based ones, gives it back whole); "length" says
        # why, whole or streamed.
        cut = reply(parsed, HERMES_CALL[:-20], finish="length")
        assert cut["finish_reason"] == "length" and not cut["message"].get("tool_calls") and cut["message"]["content"] == HERMES_CALL[:-20]
        assert streamed(parsed, HERMES_CALL[:-20], 4, finish="length")[2] == "length"
    # Prose where a required choice's call should be (a parser without a grammar for its format):
    # no call, the text, and "stop" (vLLM says "tool_calls" with no calls; the router's own JSON
    # choice says "stop" too).
    required = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}, native_ctx)
    text = "I cannot call a tool."
    prose = reply(required, text)
    assert prose["finish_reason"] == "stop" and prose["message"]["content"] == text and not prose["message"].get("tool_calls")
    assert streamed(required, text, 4) == (text, [], "stop")
    # parallel_tool_calls: false keeps the first call, as for auto.
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    (call,) = reply(parse_request("chat", body, native_ctx), HERMES_CALL + "\n" + second)["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] == "Oslo"


def test_a_tool_call_parser_fails_at_start_not_on_a_request(tiny_tokenizer, tmp_path):
    assert load_parser(tiny_tokenizer) is None
    with pytest.raises(ValueError, match=r"router.tool_call_parser: vLLM has no tool parser named 'nope' \(it has: .*hermes"):
        load_parser(tiny_tokenizer, tool="nope")
    with pytest.raises(ValueError, match=r"reasoning_parser: vLLM has no reasoning parser named 'nope' \(it has: .*granite"):
        load_parser(tiny_tokenizer, tool="hermes", reasoning="nope")
    # llama3_json's calls start with <|python_tag|>, which is no token of the tiny tokenizer.
    with pytest.raises(ValueError, match="'llama3_json' parser does not fit the served model's tokenizer"):
        load_parser(tiny_tokenizer, tool="llama3_json")
    # A parser of one's own, registered by a plugin file (vLLM's --tool-parser-plugin).
    plugin = tmp_path / "pd_test_tool_parser.py"
    plugin.write_text(
        "from vllm.tool_parsers import ToolParserManager\n"
        "from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser\n"
        "ToolParserManager.register_module('pd_test_calls', module=type('PdTestCalls', (Hermes2ProToolParser,), {}))\n"
    )
    assert load_parser(tiny_tokenizer, tool="pd_test_calls", tool_plugin=str(plugin)).tool_parser_cls.__name__ == "PdTestCalls"


def streamed(parsed, text: str, step: int, finish: str = "stop") -> tuple[str, list[tuple[str, str, str]], str | None]:
    """The text fed ``step`` characters a step: the content, each call's (id, name, arguments)
    assembled as a client does, and the last finish_reason."""
    framer = ResponseFramer(parsed, str)
    content, calls, last = "", {}, None
    for i in range(0, len(text), step):
        end = i + step >= len(text)
        for chunk in framer.chunks(Emission(text=text[i : i + step], token_ids=[7], finish_reason=finish if end else None)):
            choice = chunk["choices"][0]
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or ():
                mine = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                mine["id"] = mine["id"] or call.get("id")
                mine["name"] += call.get("function", {}).get("name") or ""
                mine["arguments"] += call.get("function", {}).get("arguments") or ""
            last = choice["finish_reason"] or last
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], last


def test_auto_calls_are_read_out_of_the_text_streamed_at_any_pace_or_whole(auto_ctx):
    """The same calls and content whether the parser sees the text a character at a time or
    whole; the text is the response's, whatever attempts produced it (a recompute's boundary
    falls anywhere, like a step's)."""
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS}, auto_ctx)
    text = "Checking. " + HERMES_CALL + "\n" + HERMES_CALL.replace("Oslo", "Bergen").replace("2}", "5}")
    whole = reply(parsed, text)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"].strip() == "Checking."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("get_weather", {"city": "Bergen", "days": 5})]
    assert all(c["id"] and c["type"] == "function" for c in whole["message"]["tool_calls"])
    # Calls alone: content is null, and there (OpenAI's message always has it).
    assert reply(parsed, HERMES_CALL)["message"]["content"] is None
    for step in (1, 2, 3, 7, 16, len(text)):
        content, got, finish = streamed(parsed, text, step)
        assert content.strip() == "Checking." and finish == "tool_calls", step
        assert [(name, json.loads(arguments)) for _, name, arguments in got] == calls, step
        assert len({call_id for call_id, _, _ in got}) == 2 and all(got_id for got_id, _, _ in got)


def test_auto_text_without_a_call_is_content_and_a_call_cut_short_keeps_its_finish(auto_ctx):
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS}, auto_ctx)
    plain = "No tool is needed: it rains in Oslo."
    whole = reply(parsed, plain)
    assert whole["message"]["content"] == plain and not whole["message"].get("tool_calls") and whole["finish_reason"] == "stop"
    assert streamed(parsed, plain, 3) == (plain, [], "stop")
    # Out of tokens inside a call: "length" says so, as on vLLM's server when streaming; a whole
    # reply with a call says "tool_calls" whatever ended it, as vLLM's server does too.
    _, _, finish = streamed(parsed, HERMES_CALL[:-20], 4, finish="length")
    assert finish == "length"
    assert reply(parsed, HERMES_CALL, finish="length")["finish_reason"] == "tool_calls"


def test_a_failing_tool_call_parser_sends_the_rest_as_content_and_is_logged_once(auto_ctx, caplog):
    """A parser that raises (vLLM's parsers are model-specific code) must not end a response the
    engines computed: it is not called again (its state lacks the step it failed on), the text
    from there on goes on as content (what it held back before is lost), and the failure is
    logged once, with the request."""

    class Broken:
        calls = 0

        def __init__(self, *args, **kwargs):
            pass

        def parse_delta(self, delta_text, *args, **kwargs):
            Broken.calls += 1
            if Broken.calls == 2:
                raise RuntimeError("broken parser")
            return None  # holds the text back, as a parser does while it reads a marker

        def parse(self, *args, **kwargs):
            raise RuntimeError("broken parser")

    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS}, auto_ctx)
    parsed = dataclasses.replace(parsed, tool_choice=dataclasses.replace(parsed.tool_choice, parser_cls=Broken))
    message = reply(parsed, HERMES_CALL)["message"]
    assert message["content"] == HERMES_CALL and not message.get("tool_calls")
    caplog.clear()
    content, calls, finish = streamed(parsed, HERMES_CALL, 5)
    assert Broken.calls == 2 and content == HERMES_CALL[5:] and calls == [] and finish == "stop"
    # (Counted by when each was made: after Serve's logging set-up in another test, caplog can see a record twice.)
    failures = {(r.created, r.getMessage()) for r in caplog.records if "the reply parser failed" in r.getMessage()}
    assert len(failures) == 1 and parsed.response_id in next(iter(failures))[1], failures

    class Unbuildable(Broken):
        builds = 0

        def __init__(self, *args, **kwargs):
            Unbuildable.builds += 1
            raise RuntimeError("cannot build")

    parsed = dataclasses.replace(parsed, tool_choice=dataclasses.replace(parsed.tool_choice, parser_cls=Unbuildable))
    caplog.clear()
    assert streamed(parsed, HERMES_CALL, 5) == (HERMES_CALL, [], "stop") and Unbuildable.builds == 1
    assert len({(r.created, r.getMessage()) for r in caplog.records if "the reply parser failed" in r.getMessage()}) == 1


def test_parallel_tool_calls_false_keeps_the_first_auto_call(auto_ctx):
    """As vLLM's server filters them: the model may write several, the client gets the first."""
    parsed = parse_request("chat", {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False}, auto_ctx)
    text = HERMES_CALL + "\n" + HERMES_CALL.replace("Oslo", "Bergen")
    (call,) = reply(parsed, text)["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] == "Oslo"
    for step in (1, 7, len(text)):
        _, calls, finish = streamed(parsed, text, step)
        assert [json.loads(arguments)["city"] for _, _, arguments in calls] == ["Oslo"] and finish == "tool_calls", step


def test_auto_through_the_router_with_a_parser_configured(tiny_tokenizer):
    """router.tool_call_parser reaches the router's parsing: the mock engine writes no call, so
    the reply to a request with tools is the same text as without them."""

    async def body(app: App) -> None:
        plain = {"messages": MESSAGES, "max_tokens": 8}
        status, data = await body_of(await app.service.http("chat", json.dumps(plain).encode()))
        assert status == 200
        content = data["choices"][0]["message"]["content"]
        status, data = await body_of(await app.service.http("chat", json.dumps({**plain, "tools": TOOLS}).encode()))
        assert status == 200, data
        assert data["choices"][0]["message"]["content"] == content and not data["choices"][0]["message"].get("tool_calls")
        status, events = await body_of(await app.service.http("chat", json.dumps({**plain, "tools": TOOLS, "stream": True}).encode()))
        assert status == 200
        deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == content

    run(body, args(router={"tool_call_parser": "hermes"}), tiny_tokenizer)


def test_a_lone_surrogate_the_model_wrote_in_a_calls_arguments_is_sent_escaped_whole_or_streamed():
    """JSON lets a model write ``"\\ud83d"``; parsed, that is a character UTF-8 cannot encode,
    which failed the whole reply with a 500 and cut a stream without its end. It is written as
    the escape again: valid JSON, the same value."""
    import asyncio

    from serve_app.router.framing import SSE_DONE, sse
    from serve_app.router.service import JSONReply, LastChunk, SessionStreamingResponse

    (call,) = required_tool_calls('[{"name": "get_weather", "parameters": {"city": "\\ud83d"}}]')
    assert json.loads(call["function"]["arguments"]) == {"city": "\ud83d"}
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "", "tool_calls": [call]}}]}
    assert b"\\ud83d" in JSONReply(body).body and json.loads(JSONReply(body).body) == body

    async def events():
        yield sse(body)
        yield LastChunk(SSE_DONE)

    async def stream() -> list[bytes]:
        sent: list[bytes] = []

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(message["body"])

        async def closed():
            return None

        async def receive():
            await asyncio.sleep(3600)

        await SessionStreamingResponse(events(), closed)({"type": "http"}, receive, send)
        return sent

    first, last = asyncio.run(stream())
    assert json.loads(first.decode().removeprefix("data: ")) == body and last == SSE_DONE.encode()
