"""Both engines behind a replica, vLLM's (engines/vllm_runner.py) and the mock (engines/mock_runner.py), have
the methods of the runner Protocol (engines/runner.py) with its parameters, and the kind of each
(coroutine, async generator, plain): a runner that drifts from the seam fails here."""

from __future__ import annotations

import inspect

import pytest

from serve_app.engines.mock_runner import MockEngine
from serve_app.engines.runner import EngineRunner
from serve_app.engines.vllm_runner import VLLMRunner

METHODS = [name for name, member in vars(EngineRunner).items() if callable(member) and not name.startswith("_")]


def kind(function: object) -> str:
    if inspect.isasyncgenfunction(function):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(function) else "plain"


@pytest.mark.parametrize("runner", [VLLMRunner, MockEngine], ids=lambda c: c.__name__)
def test_a_runner_has_every_method_of_the_protocol_with_its_parameters(runner):
    assert set(METHODS) == {"start", "generate", "abort", "held", "check_health", "stats", "transfers", "transfer_record", "shutdown"}
    for name in METHODS:
        want, got = getattr(EngineRunner, name), getattr(runner, name)
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
        if name != "generate":  # the Protocol declares the iterator it returns; runners write async generators
            assert kind(got) == kind(want), name
    assert kind(runner.generate) == "async generator"
