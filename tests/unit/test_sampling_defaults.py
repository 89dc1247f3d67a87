"""The model's sampling defaults, read as vLLM's OpenAI server reads them and applied to what a
request leaves out."""

from __future__ import annotations

import json

import pytest

from serve_app.router.parsing import ModelContext, parse_request
from serve_app.router.sampling_defaults import model_sampling_defaults

TINY_MODEL = ".cache/tiny-llama"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100, "eos_token_id": 2, "do_sample": True})
    )
    return str(tmp_path)


def test_the_models_generation_config_gives_the_defaults_and_the_engine_arguments_steer_it(model_dir):
    assert model_sampling_defaults(model_dir, {}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    # vLLM's own engine arguments: its neutral defaults, or overrides on top of the model's.
    assert model_sampling_defaults(model_dir, {"generation_config": "vllm"}) == {}
    assert model_sampling_defaults(model_dir, {"generation_config": "vllm", "override_generation_config": {"temperature": 0.2}}) == {
        "temperature": 0.2
    }
    assert model_sampling_defaults(model_dir, {"override_generation_config": {"top_k": 5}})["top_k"] == 5
    # A directory of its own; a model without one (the tiny model) has no defaults.
    assert model_sampling_defaults(TINY_MODEL, {"generation_config": model_dir})["temperature"] == 0.6
    assert model_sampling_defaults(TINY_MODEL, {}) == {}


def test_a_request_takes_the_defaults_only_for_what_it_leaves_out(tiny_tokenizer):
    ctx = ModelContext(
        name="m",
        aliases=frozenset(),
        max_model_len=256,
        vocab_size=1024,
        tokenizer=tiny_tokenizer,
        sampling_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 7},
    )
    plain = parse_request("chat", {"messages": [{"role": "user", "content": "Hi"}]}, ctx)
    assert (plain.sampling_params.temperature, plain.sampling_params.top_k, plain.max_tokens) == (0.6, 20, 7)
    # Completions has OpenAI's own default of 16 tokens, which vLLM keeps too.
    assert parse_request("completions", {"prompt": "Hi"}, ctx).max_tokens == 16
    own = parse_request("chat", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.3, "max_tokens": 30}, ctx)
    assert (own.sampling_params.temperature, own.sampling_params.top_k, own.max_tokens) == (0.3, 20, 30)
    # The default max_tokens never passes the room the context leaves.
    long = parse_request("chat", {"messages": [{"role": "user", "content": "Hi " * 82}]}, ctx)
    assert long.max_tokens == 256 - len(long.prompt_token_ids) < 7
