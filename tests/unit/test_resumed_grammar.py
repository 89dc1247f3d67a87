"""Structured output across a recompute (vllm_plugins/resumed_grammar.py), against vLLM's own
xgrammar backend on the tiny model's tokenizer: a resumed attempt's matcher, advanced by the
earlier output, allows exactly what the uninterrupted request's matcher allows at that point.
test_cdcp.py runs structured output through disaggregated engines; test_recompute_e2e.py through
a recompute."""

from __future__ import annotations

import json
import logging
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputOptions
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

from serve_app.vllm_plugins import resumed_grammar
from serve_app.vllm_plugins.resumed_grammar import advancing_by_earlier_output, earlier_output, in_engine_core, install
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}}},
    "required": ["name", "tags"],
}
DOCUMENT = '{"name": "river boat", "tags": [12, 7, 409]}'
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def backend(tiny_tokenizer):
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False), model_config=None, speculative_config=None
    )
    return XgrammarBackend(config, tokenizer=tiny_tokenizer, vocab_size=len(tiny_tokenizer))


class Manager:
    """The part of ``StructuredOutputManager`` the patched method sees."""

    def __init__(self, backend, reasoner_cls=None, enable_in_reasoning=False, reasoner=None):
        self.backend = backend
        self.reasoner_cls = reasoner_cls
        self.enable_in_reasoning = enable_in_reasoning
        self.reasoner = reasoner

    def _get_reasoner(self, request):
        if isinstance(self.reasoner, Exception):
            raise self.reasoner
        return self.reasoner

    def _create_grammar(self, request):
        return self.backend.compile_grammar(StructuredOutputOptions.JSON, json.dumps(SCHEMA))


def request(prompt: list[int], mark=None, reasoning_ended=None) -> SimpleNamespace:
    extra_args = None if mark is None else {RESUMED_OUTPUT_TOKENS: mark}
    return SimpleNamespace(
        request_id="r-1",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(extra_args=extra_args),
        structured_output_request=SimpleNamespace(reasoning_ended=reasoning_ended),
    )


def allowed(grammar, vocab_size: int) -> torch.Tensor:
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


@pytest.fixture(scope="module")
def output(tiny_tokenizer, backend) -> list[int]:
    """The document as the request's output tokens, which the schema's matcher accepts one by one."""
    tokens = tiny_tokenizer.encode(DOCUMENT, add_special_tokens=False)
    grammar = Manager(backend)._create_grammar(None)
    assert grammar.accept_tokens("r-1", tokens) and len(tokens) > 8
    return tokens


def test_a_resumed_matcher_allows_what_the_uninterrupted_one_allows(backend, output):
    create = advancing_by_earlier_output(Manager._create_grammar)
    manager = Manager(backend)
    for k in range(1, len(output)):
        uninterrupted = manager._create_grammar(None)
        assert uninterrupted.accept_tokens("r-1", output[:k])
        resumed = create(manager, request(PROMPT + output[:k], mark=k))
        assert torch.equal(allowed(resumed, backend.vocab_size), allowed(uninterrupted, backend.vocab_size)), k
        # ... and takes the rest of the document, which then ends as it does uninterrupted.
        assert resumed.accept_tokens("r-1", output[k:]) and uninterrupted.accept_tokens("r-1", output[k:])
        assert torch.equal(allowed(resumed, backend.vocab_size), allowed(uninterrupted, backend.vocab_size)), k


def test_without_the_plugin_a_resumed_matcher_starts_over(backend, output):
    """The premise: vLLM's own matcher for the resumed attempt allows other tokens (a new document)."""
    manager = Manager(backend)
    uninterrupted = manager._create_grammar(None)
    assert uninterrupted.accept_tokens("r-1", output[:5])
    fresh = manager._create_grammar(request(PROMPT + output[:5], mark=5))
    assert not torch.equal(allowed(fresh, backend.vocab_size), allowed(uninterrupted, backend.vocab_size))


def test_first_attempts_and_bad_marks_get_the_matcher_as_compiled(backend, output, caplog):
    create = advancing_by_earlier_output(Manager._create_grammar)
    start = allowed(Manager(backend)._create_grammar(None), backend.vocab_size)
    caplog.set_level(logging.WARNING, logger="pd_serve.engine")
    for mark in (None, 0, -1, "3", True, len(PROMPT) + len(output) + 1):
        grammar = create(Manager(backend), request(PROMPT + output[:3], mark=mark))
        assert torch.equal(allowed(grammar, backend.vocab_size), start), mark
    assert "malformed resumed-attempt mark" in caplog.text
    assert earlier_output(SimpleNamespace(request_id="r", sampling_params=None, prompt_token_ids=PROMPT)) == []


def test_earlier_output_the_grammar_refuses_is_logged_not_raised(backend, output, caplog):
    """Raising would end a vLLM 0.23 engine core; a refusal means a bug, and the log names the request."""
    create = advancing_by_earlier_output(Manager._create_grammar)
    closing_brace = output[-1]
    grammar = create(Manager(backend), request(PROMPT + [closing_brace], mark=1))
    assert grammar is not None
    assert "r-1's grammar refused earlier output token 0 of 1" in caplog.text


def test_a_grammar_that_fails_on_the_earlier_output_is_logged_not_raised(backend, output, caplog):
    class Failing(Manager):
        def _create_grammar(self, request):
            grammar = super()._create_grammar(request)
            grammar.accept_tokens = lambda *args: 1 / 0
            return grammar

    grammar = advancing_by_earlier_output(Failing._create_grammar)(Failing(backend), request(PROMPT + output[:3], mark=3))
    assert grammar is not None and "r-1's grammar failed on its earlier output" in caplog.text


def test_earlier_output_past_the_grammars_end_is_no_bug(backend, output, caplog):
    """Under ignore_eos a request samples on past its grammar's end; vLLM 0.23's matcher then
    refuses more tokens, and the state is right: nothing to warn about."""
    create = advancing_by_earlier_output(Manager._create_grammar)
    eos = backend.tokenizer.eos_token_id
    grammar = create(Manager(backend), request(PROMPT + output + [eos, output[0]], mark=len(output) + 2))
    assert grammar.is_terminated() and "refused" not in caplog.text


@pytest.fixture(scope="module")
def qwen3(tiny_tokenizer):
    """vLLM's own qwen3 reasoning parser, on the tiny tokenizer with its <think> tokens added (it
    has none), and the end token's id."""
    from transformers import AutoTokenizer
    from vllm.reasoning import ReasoningParserManager

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    end = tokenizer.convert_tokens_to_ids("</think>")
    assert end >= len(tiny_tokenizer)
    return ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer), end


def test_with_a_reasoning_parser_only_the_output_after_the_thinking_advances_the_grammar(backend, output, qwen3, caplog):
    """The grammar held from the end of thinking: the request's reasoning parser finds it in the
    earlier output, and what followed advances the new matcher; where the thinking had not
    ended, the matcher starts where this attempt's thinking will end, as in the uninterrupted run."""
    reasoner, end = qwen3
    create = advancing_by_earlier_output(Manager._create_grammar)
    start = allowed(Manager(backend)._create_grammar(None), backend.vocab_size)
    thought = [40, 41, 42, 43]
    manager = Manager(backend, reasoner_cls=object, reasoner=reasoner)
    for k in (1, 3, len(output) - 1):
        earlier = thought + [end] + output[:k]
        resumed = create(manager, request(PROMPT + earlier, mark=len(earlier)))
        uninterrupted = Manager(backend)._create_grammar(None)
        assert uninterrupted.accept_tokens("r-1", output[:k])
        assert torch.equal(allowed(resumed, backend.vocab_size), allowed(uninterrupted, backend.vocab_size)), k
    # Still thinking when the attempt ended: the grammar has seen nothing yet.
    still = create(manager, request(PROMPT + thought, mark=len(thought)))
    assert torch.equal(allowed(still, backend.vocab_size), start)
    assert "starts over" not in caplog.text and "refused" not in caplog.text
    # A parser that fails: the grammar starts over, and the log says so.
    broken = Manager(backend, reasoner_cls=object, reasoner=RuntimeError("no"))
    grammar = create(broken, request(PROMPT + thought + [end] + output[:3], mark=8))
    assert torch.equal(allowed(grammar, backend.vocab_size), start)
    assert "starts over (its reasoning parser failed)" in caplog.text
    # With the grammar applied during reasoning too, all the earlier output is the grammar's.
    grammar = create(Manager(backend, reasoner_cls=object, enable_in_reasoning=True), request(PROMPT + output[:3], mark=3))
    assert not torch.equal(allowed(grammar, backend.vocab_size), start)
    # With the thinking over before the first token (the client hid it: reasoning_ended), too.
    resumed = create(Manager(backend, reasoner_cls=object), request(PROMPT + output[:3], mark=3, reasoning_ended=True))
    uninterrupted = Manager(backend)._create_grammar(None)
    assert uninterrupted.accept_tokens("r-1", output[:3])
    assert torch.equal(allowed(resumed, backend.vocab_size), allowed(uninterrupted, backend.vocab_size))
    assert not torch.equal(allowed(resumed, backend.vocab_size), start)


def test_install_patches_only_in_the_engine_core_and_once(monkeypatch):
    original = StructuredOutputManager._create_grammar
    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", original)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    for name in ("MainProcess", "VllmWorker-0"):  # the replica and the workers: no scheduler there
        monkeypatch.setattr(multiprocessing.current_process(), "name", name)
        install()
        assert StructuredOutputManager._create_grammar is original
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # ... unless vLLM runs the engine in-process
    assert in_engine_core()
    install()
    assert StructuredOutputManager._create_grammar is not original
    monkeypatch.setattr(StructuredOutputManager, "_create_grammar", original)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP0")
    install()
    patched = StructuredOutputManager._create_grammar
    assert patched is not original and patched._pd_serve_patched
    install()
    assert StructuredOutputManager._create_grammar is patched


def test_the_plugin_is_registered_with_vllm():
    from importlib.metadata import entry_points

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "pd_serve_resumed_grammar"]
    assert entry.load() is resumed_grammar.install
