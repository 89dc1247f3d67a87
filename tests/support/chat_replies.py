"""Chat requests with tools, and replies framed without an engine, for the framing's tests
(tests/unit/test_tools.py, test_reasoning.py)."""

from __future__ import annotations

from typing import Any

from serve_app.router.framing import ResponseFramer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
# One call of get_weather in hermes' format (vLLM's hermes tool-call parser).
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def reply(parsed: Any, text: str, finish: str = "stop") -> dict[str, Any]:
    """The non-streamed choice for a reply of this text."""
    framer = ResponseFramer(parsed, str)
    return framer.final(text=text, token_ids=[7] * 3, logprobs=None, finish_reason=finish, stop_reason=None, prompt_tokens=3)["choices"][0]
