"""Sampling parameters on their way from the router to an engine.

The router builds a vLLM ``SamplingParams`` (with vLLM's own request models) and sends it to the
engines msgpack-encoded, as vLLM's own engine core protocol does: plain bytes travel in the
``EngineRequest`` (over the engine's HTTP endpoint or a Serve handle), a vLLM engine decodes them
back into ``SamplingParams``, and the mock engine reads the few fields it needs without importing
vLLM (or torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

# The ``extra_args`` key the router sets on a resumed attempt: how many of its prompt's last tokens
# are output of the request's earlier attempts (vllm_plugins/resumed_output.py and seeded_sampling.py read it).
RESUMED_OUTPUT_TOKENS = "pd_resumed_output_tokens"


def resumed_output_tokens(params: Any) -> int:
    """How many of a request's prompt tokens an earlier attempt produced (0: a first attempt), from
    a vLLM ``SamplingParams``."""
    value = (params.extra_args or {}).get(RESUMED_OUTPUT_TOKENS, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"extra_args.{RESUMED_OUTPUT_TOKENS} must be a non-negative integer, got {value!r}")
    return value


def earlier_output(prompt_token_ids: Sequence[int], count: int) -> list[int]:
    """A resumed attempt's earlier output: the last ``count`` tokens of its prompt (none where the
    mark is more than the prompt holds)."""
    if not count or count > len(prompt_token_ids):
        return []
    return list(prompt_token_ids[len(prompt_token_ids) - count :])


def encode_sampling(params: Any) -> bytes:
    return msgspec.msgpack.encode(params)


def decode_sampling(raw: bytes) -> Any:
    from vllm import SamplingParams

    return msgspec.msgpack.decode(raw, type=SamplingParams)


def sampling_fields(raw: bytes) -> dict[str, Any]:
    """The encoded parameters' fields that differ from vLLM's defaults, as a plain dict."""
    fields = msgspec.msgpack.decode(raw)
    return fields if isinstance(fields, dict) else {}
