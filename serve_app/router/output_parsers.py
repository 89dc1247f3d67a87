"""vLLM's parsers of a model's reply format, loaded once per router replica: the tool-call parser
that ``tool_choice: "auto"`` needs (``router.tool_call_parser``; it reads a named or required
choice's calls too where its format is not vLLM's JSON: router/tools.py), and the reasoning parser that
splits a reasoning model's thinking from its answer (the decode engines' ``reasoning_parser``).

Both are vLLM's own classes, composed by vLLM's ``ParserManager`` into one ``Parser`` as vLLM's
server composes them, and called as it calls them (``adjust_request``, then ``parse_delta`` per
streamed step or ``parse`` on the whole reply). The router runs them on the text of the whole
client response, one parser per response, so what they read never shows an attempt boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def cached_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as vLLM's server gives its parsers: its vocabulary and special tokens read
    once, not at every parser's construction."""
    from vllm.tokenizers.hf import get_cached_tokenizer

    return get_cached_tokenizer(tokenizer)


def load_parser(
    tokenizer: Any,
    *,
    tool: str | None = None,
    tool_plugin: str | None = None,
    reasoning: str | None = None,
    reasoning_plugin: str | None = None,
    model_name: str | None = None,
) -> Any:
    """The vLLM ``Parser`` class for these parsers (None for neither), checked against the
    tokenizer at start: a parser whose format needs tokens the tokenizer lacks fails here, once,
    not on a client's request."""
    if not tool and not reasoning:
        return None
    from vllm.parser import ParserManager

    if tool_plugin:
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.import_tool_parser(tool_plugin)
    if reasoning_plugin:
        from vllm.reasoning import ReasoningParserManager

        ReasoningParserManager.import_reasoning_parser(reasoning_plugin)
    check_known(tool, reasoning)
    parser_cls = ParserManager.get_parser(
        tool_parser_name=tool, reasoning_parser_name=reasoning, enable_auto_tools=bool(tool), model_name=model_name
    )
    try:
        parser_cls(tokenizer, [])
    except Exception as exc:
        which = " and ".join(f"the {name!r} parser" for name in (tool, reasoning) if name)
        raise ValueError(f"{which} does not fit the served model's tokenizer: {exc}") from None
    return parser_cls


def check_known(tool: str | None = None, reasoning: str | None = None) -> None:
    """ValueError, naming the parsers vLLM has, for a parser name it does not have."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for setting, kind, name, manager in (
        ("router.tool_call_parser", "tool", tool, ToolParserManager),
        ("the decode engines' reasoning_parser", "reasoning", reasoning, ReasoningParserManager),
    ):
        if name and name not in manager.list_registered():
            raise ValueError(f"{setting}: vLLM has no {kind} parser named {name!r} (it has: {', '.join(manager.list_registered())})")


@dataclass(frozen=True)
class ParserUse:
    """One request's use of a vLLM ``Parser`` class: what it is built with, once per response (a
    parser keeps the stream's state)."""

    parser_cls: Any  # a vllm.parser Parser class (load_parser)
    request: Any  # the vLLM request model the parser reads: tools, tool_choice, include_reasoning
    tokenizer: Any
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # what the chat template got (e.g. enable_thinking)

    def new_parser(self) -> Any:
        return self.parser_cls(self.tokenizer, self.request.tools, chat_template_kwargs=self.template_kwargs)


@dataclass(frozen=True)
class ReasoningSplit(ParserUse):
    """A chat reply of a reasoning model: vLLM's reasoning parser takes the thinking out of the
    text (``reasoning``, sent only if the request's ``include_reasoning``), and what is left is
    the reply the rest of the framing sees (text, or a named or required choice's calls)."""

    include: bool = True
