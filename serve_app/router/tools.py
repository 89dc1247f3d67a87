"""Tool calling: a named or a required call, and "auto" read by the model's own tool-call parser.

Without a tool-call parser, or with one whose format is JSON vLLM can force (its
``supports_required_and_named``), a named or a required choice constrains the whole output with a
JSON schema (structured output, which goes on across a recompute:
vllm_plugins/resumed_grammar.py), so the tool calls are read from JSON the grammar guarantees
rather than from the model's own tool-call format. That is what vLLM's server does for these two
choices too, with the same schemas, and the client sees the same response (except that a required
choice streams each call whole, once its object is complete, where vLLM's server streams its
arguments in pieces; clients assemble both alike):

* ``tool_choice: {"type": "function", "function": {"name": ...}}``: the output is that function's
  arguments (its parameter schema is the grammar); the reply is one call, ``finish_reason``
  "stop" (OpenAI's for a named call).
* ``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}`` objects,
  one per call, each naming one of ``tools`` and holding to its schema (one call only with
  ``parallel_tool_calls: false``); the reply is those calls, ``finish_reason`` "tool_calls".

``"auto"`` (the default when ``tools`` are sent) lets the model decide, and its calls are written in
its own format, which only a parser for that model's format can read out of the text. With
``router.tool_call_parser`` naming one of vLLM's parsers (``--tool-call-parser``), the router runs
it on the response text, streamed or not, as vLLM's server does with ``--enable-auto-tool-choice``
(``ParsedCalls``); the text is the whole response's, whatever the attempts behind it, so a recompute
is invisible to the parser too. Without one, ``"auto"`` is refused, saying what works. ``"none"``
renders the tools into the prompt (as vLLM does) and answers in text.

A parser whose format is not that JSON (vLLM 0.32's parsers of formats xgrammar knows, hermes
among them, under ``VLLM_ENFORCE_STRICT_TOOL_CALLING``, on by default; XML formats such as
glm4_moe's in both versions) serves a named or required choice the way vLLM's server does: the
parser's ``adjust_request`` holds the model to calls in its own format (a structural tag, where
the parser has one) and the parser reads them, as an auto choice's (``ParsedCalls.forced``).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from serve_app.router.errors import bad_request
from serve_app.router.output_parsers import ParserUse

logger = logging.getLogger("pd_serve.router")

AUTO_REFUSED = (
    'tool_choice "auto" needs the model\'s tool-call format parsed out of its text, and this server has no '
    "tool-call parser configured (router.tool_call_parser): name the function to call (tool_choice: "
    '{"type": "function", "function": {"name": ...}}), or send tool_choice "required" or "none"'
)


def no_parameters() -> dict[str, Any]:
    """Where a function declares no parameters: an object (vLLM's choice), never free text."""
    return {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ForcedCall:
    """A named tool choice: the output is this one call's arguments; its id is fixed for the
    whole response (every attempt, every chunk)."""

    name: str
    schema: dict[str, Any]
    call_id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class RequiredCalls:
    """``tool_choice: "required"``: the output is a JSON array of calls."""

    schema: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls(ParserUse):
    """Calls in the model's own format, read out of the text by the configured tool-call parser
    (with the reasoning parser, if any, ahead of it): ``tool_choice: "auto"``, where the model may
    answer in text instead, and a named or required choice where the parser's format is not the
    JSON vLLM forces (module docstring)."""

    @property
    def forced(self) -> bool:
        """A named or required choice: the reply is calls (content "" beside them, as on vLLM's
        server), and the choice is one of the tools' or no grammar beside it (a 400)."""
        return self.request.tool_choice not in (None, "auto")

    @property
    def named(self) -> bool:
        """A named choice, whose reply ends with "stop" (OpenAI's for a named call)."""
        return self.forced and self.request.tool_choice != "required"

    def first_call_only(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``parallel_tool_calls: false``: the first call alone, as vLLM's server filters them
        (its grammar need not hold the model to one)."""
        if self.request.parallel_tool_calls is not False:
            return calls
        return [call for i, call in enumerate(calls) if call.get("index", i) == 0]


ToolChoice = ForcedCall | RequiredCalls | ParsedCalls


def tool_choice_of(
    request: Any, parser_cls: Any = None, tokenizer: Any = None, template_kwargs: dict[str, Any] | None = None
) -> ToolChoice | None:
    """What a chat request's ``tool_choice`` asks of the output (None: text). vLLM's request model
    has already checked the choice's shape and that a named function is among ``tools``.
    ``parser_cls``: the configured tool-call parser (router/output_parsers.py), which "auto" needs,
    and which reads a named or required choice's calls where its format is not vLLM's JSON."""
    choice = request.tool_choice
    if not request.tools or choice is None or choice == "none":
        return None
    tool = None
    if not isinstance(choice, str):
        name = choice.function.name
        # The last tool of that name, as vLLM's server (a map by name) takes it.
        tool = next((t for t in reversed(request.tools) if t.function.name == name), None)
        if tool is None:  # vLLM's validator refuses it first; never constrain by another tool's schema
            raise bad_request(f"Tool '{name}' has not been passed in `tools`", param="tool_choice")
    if parser_cls is not None and (choice == "auto" or not forces_json(parser_cls)):
        return ParsedCalls(parser_cls=parser_cls, request=request, tokenizer=tokenizer, template_kwargs=dict(template_kwargs or {}))
    if choice == "required":
        return RequiredCalls(schema=required_calls_schema(request.tools, single=request.parallel_tool_calls is False))
    if tool is None:
        raise bad_request(AUTO_REFUSED, param="tool_choice")
    return ForcedCall(name=tool.function.name, schema=tool.function.parameters or no_parameters())


def forces_json(parser_cls: Any) -> bool:
    """Whether vLLM's server serves a named or required choice with this parser configured by
    forcing its JSON (the tool parser's ``supports_required_and_named``; True where the class
    does not say, as in vLLM's base class)."""
    return bool(getattr(getattr(parser_cls, "tool_parser_cls", None), "supports_required_and_named", True))


def required_calls_schema(tools: list[Any], single: bool) -> dict[str, Any]:
    """An array of at least one ``{"name", "parameters"}`` object, each one of the tools with its
    own parameter schema. A tool's ``$defs`` move to the top (a ``$ref`` names them from the
    root); two tools that define one name differently are a 400, as on vLLM's server."""
    variants, defs = [], {}
    for tool in tools:
        parameters = dict(tool.function.parameters or no_parameters())
        own_defs = parameters.pop("$defs", None) or {}
        if not isinstance(own_defs, dict):
            raise bad_request(f"`$defs` in the parameters of tool '{tool.function.name}' must be an object", param="tools")
        for name, schema in own_defs.items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request(f"Tool definition '{name}' has multiple schemas, which is not supported", param="tools")
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def required_tool_call(element: Any, index: int) -> dict[str, Any] | None:
    """One element of a required choice's array (parsed, or its JSON text) as an OpenAI tool call,
    arguments as vLLM's server writes them; None for one JSON cannot take (nested past Python's
    recursion limit, which a client's own schema may allow)."""
    try:
        item = json.loads(element) if isinstance(element, str) else element
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
    except (ValueError, RecursionError, AttributeError):
        logger.warning("a required tool call's JSON could not be read or written; it was left out")
        return None
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": item.get("name"), "arguments": arguments}}


def required_tool_calls(text: str) -> list[dict[str, Any]]:
    """A whole required choice's output as tool calls; none when it is not a complete array (the
    output ran out of tokens first: as on vLLM's server, the reply then has neither calls nor
    text, and ``finish_reason`` "length" says why)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return []
    calls = (required_tool_call(item, i) for i, item in enumerate(items))
    return [call for call in calls if call is not None]


class RequiredCallsStream:
    """A required choice's output as it streams: each call once its JSON object is complete.

    One pass over the text, keeping only the element being read: an array element (an object the
    grammar guarantees) ends where its braces balance outside strings, and only then is it
    parsed, once. Re-parsing the text so far at every delta would cost quadratic time on the
    router's event loop, which every stream of the replica shares."""

    def __init__(self) -> None:
        self._opened = False  # past the array's '['
        self._depth = 0  # of the element being read (0: between elements)
        self._in_string = False
        self._escaped = False
        self._element: list[str] = []  # its text so far
        self.calls = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        out = []
        start = 0  # where the element being read starts in this delta
        for i, ch in enumerate(delta):
            if not self._opened:
                self._opened = ch == "["
            elif self._depth == 0:  # whitespace, ',' and ']' between elements
                if ch == "{":
                    self._depth, start = 1, i
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._element.append(delta[start : i + 1])
                    call = required_tool_call("".join(self._element), self.calls)
                    self._element = []
                    if call is not None:
                        out.append(call)
                        self.calls += 1
        if self._depth > 0:
            self._element.append(delta[start:])
        return out


def template_tools(request: Any) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (vLLM's server passes the same dicts)."""
    return None if request.tools is None else [tool.model_dump() for tool in request.tools]  # [] stays [] (templates test `is none`)


def template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` as templates read them: each call's ``arguments``, a
    JSON string over the API, as an object (as vLLM's server passes them; a string that is not
    a JSON object becomes an empty one, so one bad turn in a conversation's history does not
    fail every later request)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", param=f"messages.{i}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        call = call.model_dump() if hasattr(call, "model_dump") else call
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" or not isinstance(function.get("name"), str):
            raise bad_request(
                f"messages[{i}].tool_calls[{j}] must be a function call with a name", param=f"messages.{i}.tool_calls.{j}"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except (ValueError, RecursionError):
                arguments = {}
        out.append({**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}})
    return out
