"""Structured output across a recompute: a resumed attempt's grammar goes on from the earlier output.

A request with a grammar (``response_format``, ``structured_outputs``) gets a grammar matcher in
the engine core, compiled when the request arrives (``StructuredOutputManager._create_grammar``)
and advanced by each token the request samples. A resumed attempt's prompt ends with the output
of the request's earlier attempts (``wire.sampling.RESUMED_OUTPUT_TOKENS`` says how many tokens),
which vLLM takes for prompt: its matcher would start at the grammar's beginning, and the response
would be the earlier output followed by a second document, not one that matches the grammar.

``install`` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point) that acts
in the engine core, where the scheduler and its structured-output manager live (the ``EngineCore``
process, or the engine's own process where vLLM runs it in-process). It advances a resumed
attempt's freshly compiled matcher by the earlier output, through the backend's own
``accept_tokens``, so the attempt samples under the state one uninterrupted run would have
reached. It is backend-neutral (xgrammar, guidance, outlines, lm-format-enforcer) and has no switch:
it reads only the router's mark, which clients cannot send (``router.parsing.RESERVED_EXTRA_ARGS``).
Ascend engines load it too (vllm-ascend keeps vLLM's scheduler side).

With a reasoning parser in the engine (``structured_outputs_config.reasoning_parser``), the
grammar held only from the end of thinking, so only the earlier output after that end (found by
the request's own reasoning parser) advances it; where the thinking had not ended, the grammar
starts where it ends in this attempt, as in the uninterrupted run. Where the thinking was over
before the first token (``reasoning_ended``: the client hid it, or the template turned it off),
all the earlier output is the grammar's.
"""

from __future__ import annotations

import logging
from typing import Any

from serve_app.runtime.private_symbols import patch_once
from serve_app.vllm_plugins.processes import in_engine_core
from serve_app.wire.sampling import earlier_output as marked_tail
from serve_app.wire.sampling import resumed_output_tokens

logger = logging.getLogger("pd_serve.engine")

_MANAGER = "vllm.v1.structured_output.StructuredOutputManager"
SYMBOLS = (
    f"{_MANAGER}._create_grammar",
    f"{_MANAGER}.reasoner_cls",
    f"{_MANAGER}._get_reasoner",
    "vllm.reasoning.abs_reasoning_parsers.ReasoningParser.is_reasoning_end",
    "vllm.reasoning.abs_reasoning_parsers.ReasoningParser.extract_content_ids",
    "vllm.v1.request.Request.structured_output_request",
    "vllm.v1.structured_output.request.StructuredOutputRequest.reasoning_ended",
    "vllm.v1.structured_output.backend_types.StructuredOutputGrammar.accept_tokens",
    "vllm.v1.structured_output.backend_types.StructuredOutputGrammar.is_terminated",
)


def install() -> None:
    if not in_engine_core():
        return
    try:
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError:  # a vLLM without the V1 engine: nothing to do
        return
    without = "structured output that goes on across a recompute"
    patch_once(StructuredOutputManager, "_create_grammar", advancing_by_earlier_output, SYMBOLS, logger, without)


def earlier_output(request: Any) -> list[int]:
    """A resumed attempt's earlier output: the last tokens of its prompt the router marked. Never
    raises (this runs in the engine core); a malformed mark counts as none."""
    params = request.sampling_params
    if params is None:
        return []
    try:
        count = resumed_output_tokens(params)
    except ValueError:
        logger.warning("structured output: request %s's malformed resumed-attempt mark was ignored", request.request_id)
        return []
    return marked_tail(request.prompt_token_ids or (), count)


def _thinking_over(request: Any) -> bool:
    """Whether the request's thinking was over before its first output token (vLLM's
    ``reasoning_ended``, which the router sets where the client hides the thinking, as vLLM's
    server does): then its grammar held from that token, and all earlier output is the grammar's."""
    structured = getattr(request, "structured_output_request", None)
    return getattr(structured, "reasoning_ended", None) is True


def _after_thinking(manager: Any, request: Any, earlier: list[int]) -> list[int]:
    """The part of the earlier output the grammar saw: what followed the end of thinking, found
    by the request's own reasoning parser (the engine's gate finds that end in the resumed prompt
    and holds the grammar from the attempt's first token). None of it where the thinking had not
    ended: the grammar then holds from its end in this attempt, as in the uninterrupted run."""
    try:
        reasoner = manager._get_reasoner(request)
        if reasoner is None or not reasoner.is_reasoning_end(earlier):
            return []
        return list(reasoner.extract_content_ids(earlier))
    except Exception:
        logger.exception(
            "structured output: request %s resumes with a grammar that starts over (its reasoning parser failed)", request.request_id
        )
        return []


def advancing_by_earlier_output(create_grammar: Any) -> Any:
    """``StructuredOutputManager._create_grammar``, then the new matcher advanced by a resumed
    attempt's earlier output."""

    def _create_grammar(self: Any, request: Any) -> Any:
        grammar = create_grammar(self, request)
        earlier = earlier_output(request)
        if not earlier:
            return grammar
        if self.reasoner_cls is not None and not getattr(self, "enable_in_reasoning", False) and not _thinking_over(request):
            earlier = _after_thinking(self, request, earlier)
            if not earlier:
                return grammar
        # Raising here would end the engine core on vLLM 0.23 (its scheduler reads the compiled
        # grammar's future unguarded), so nothing does. The earlier tokens were sampled under this
        # grammar, one by one, and so are they taken: once it has ended (``ignore_eos`` samples on
        # past its end), the rest is not the grammar's, as in the uninterrupted run.
        try:
            for taken, token in enumerate(earlier):
                if grammar.is_terminated():
                    break
                if not grammar.accept_tokens(request.request_id, [token]):
                    logger.warning(
                        "structured output: request %s's grammar refused earlier output token %d of %d; it goes on from there",
                        request.request_id,
                        taken,
                        len(earlier),
                    )
                    break
        except Exception:
            logger.exception("structured output: request %s's grammar failed on its earlier output", request.request_id)
        return grammar

    return _create_grammar
