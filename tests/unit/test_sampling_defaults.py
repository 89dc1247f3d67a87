"""The model's sampling defaults, read as vLLM's OpenAI server reads them and applied to what a
request leaves out."""

from __future__ import annotations

import json

import pytest

from serve_app.router.parsing import ModelContext, parse_request
from serve_app.router.sampling_defaults import max_tokens_cap, model_sampling_defaults

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


def test_a_generation_config_the_router_cannot_read_leaves_no_defaults_not_a_dead_router(caplog):
    """A directory only the engines' nodes have, or a repository while offline: vLLM raises a
    ValueError there, which would have failed every router replica's start."""
    assert model_sampling_defaults(TINY_MODEL, {"generation_config": "/nowhere/at/all"}) == {}
    assert "could not be read" in caplog.text


def test_max_tokens_is_capped_as_vllms_server_caps_it(model_dir, tiny_tokenizer):
    """vLLM's server bounds every request's max_tokens, the client's too: by
    override_generation_config's max_new_tokens, or by the defaults' when generation_config
    names a directory (a model's own generation_config.json, 'auto', sets only a default)."""
    assert max_tokens_cap({"override_generation_config": {"max_new_tokens": 5}}, {"max_tokens": 5}) == 5
    assert max_tokens_cap({"generation_config": model_dir}, {"max_tokens": 100}) == 100
    assert max_tokens_cap({}, {"max_tokens": 100}) is None
    ctx = ModelContext(name="m", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer, max_tokens_cap=5)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30}
    assert parse_request("chat", chat, ctx).max_tokens == 5
    assert parse_request("completions", {"prompt": "Hi"}, ctx).max_tokens == 5  # under OpenAI's 16
