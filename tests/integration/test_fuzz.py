"""Property-based fuzzing of the OpenAI routes on the app of configs/serve.yaml (real engines).

Hypothesis builds request bodies from every field the two routes know, each drawn from sensible,
borderline and hostile values (wrong types, out-of-range numbers, nested junk, token ids outside
the vocabulary, fields pd-serve refuses). Whatever comes in, the answer is a 2xx or a 4xx with an
OpenAI error body, within a bound time; never a 5xx, a traceback or a hang; a stream never
carries an error event with a 5xx code; and afterwards nothing is left in flight anywhere.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import deploy, serve_yaml_app, wait_idle

pytestmark = pytest.mark.engine

EXAMPLES = 80  # per route: enough to reach the engines with odd but valid requests, bounded in time
REQUEST_TIMEOUT_S = 60

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=6
)
token_ids = st.lists(st.integers(min_value=-3, max_value=1100), max_size=16)
small_float = st.floats(min_value=-2, max_value=3, allow_nan=False)
penalty = st.floats(min_value=-3, max_value=3, allow_nan=False)

# Each field with values of the right type, in range and just out of it (a token id outside the
# vocabulary, a negative temperature): what a real, careless client sends.
PLAUSIBLE: dict[str, Any] = {
    "model": st.sampled_from(["tiny-llama", "gpt-4", ""]),
    "temperature": small_float,
    "top_p": st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
    "top_k": st.integers(min_value=-3, max_value=2000),
    "min_p": small_float,
    "seed": st.integers(min_value=-(2**64), max_value=2**64),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": token_ids,
    "n": st.integers(min_value=-1, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": penalty,
    "frequency_penalty": penalty,
    "repetition_penalty": st.floats(min_value=-1, max_value=3, allow_nan=False),
    "min_tokens": st.integers(min_value=-2, max_value=30),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(-5, 1100).map(str), st.floats(-200, 200, allow_nan=False), max_size=3),
    "allowed_token_ids": token_ids,
    "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "truncate_prompt_tokens": st.one_of(st.integers(min_value=1, max_value=40), st.integers(min_value=-2, max_value=3000)),
    "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "user": st.text(max_size=8),
    "vllm_xargs": st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.integers(), st.text(max_size=4)), max_size=2),
}
COMPLETIONS_ONLY: dict[str, Any] = {
    "logprobs": st.integers(min_value=-2, max_value=30),
    "echo": st.booleans(),
    "suffix": st.text(max_size=5),
    "best_of": st.integers(min_value=-1, max_value=3),
    "prompt_logprobs": st.integers(min_value=-1, max_value=3),
    "max_tokens": st.integers(min_value=-2, max_value=24),
}
CHAT_ONLY: dict[str, Any] = {
    "max_completion_tokens": st.integers(min_value=-2, max_value=24),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=-2, max_value=30),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=5), scalars, max_size=2),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
    "response_format": st.just({"type": "json_object"}),
}
# Fields a client may not set at all: always refused.
REFUSED: dict[str, Any] = {
    "kv_transfer_params": st.just({"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/x"}),
    "vllm_xargs": st.just({"kv_transfer_params": "x"}),
}

valid_ids = st.lists(st.integers(min_value=0, max_value=1023), min_size=1, max_size=40)
prompts = st.one_of(
    st.text(min_size=1, max_size=60),
    st.text(min_size=1, max_size=60),
    valid_ids,
    valid_ids,
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=1),
    st.text(max_size=60),
    token_ids,
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(token_ids, max_size=2),
)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": st.text(max_size=40)}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2
            ),
        }
    ),
)
messages = st.lists(message, max_size=3)


def some_of(fields: dict[str, Any], most: int) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with up to ``most`` of these fields."""
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks}))


def bodies(main: str, main_values: Any, route_fields: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible requests (the main field, a small max_tokens, a few other fields), then a
    plausible request with one field of junk or one refused field, then junk altogether."""
    fields = {**PLAUSIBLE, **route_fields}
    base = st.fixed_dictionaries({main: main_values, "max_tokens": st.integers(min_value=1, max_value=16)})
    plausible = st.tuples(base, some_of(fields, 4)).map(lambda t: {**t[0], **t[1]})
    one_junk = st.tuples(plausible, st.sampled_from(sorted({*fields, main})), junk).map(lambda t: {**t[0], t[1]: t[2]})
    refused = st.tuples(plausible, some_of(REFUSED, 1)).map(lambda t: {**t[0], **t[1]})
    kinds = {"plausible": plausible, "one_junk": one_junk, "refused": refused, "junk": junk}
    return st.sampled_from(["plausible"] * 6 + ["one_junk", "one_junk", "refused", "junk"]).flatmap(kinds.__getitem__)


@pytest.fixture(scope="module")
def app(cluster):
    from ray import serve

    spec = serve_yaml_app()
    deployed = deploy(cluster, "fuzz", "/fuzz", {**spec["args"], "kv_port_base": 38000})
    yield deployed
    serve.delete(deployed.name)


def check(app, path: str, body: Any) -> None:
    raw = json.dumps(body, allow_nan=True)
    response = requests.post(
        app.base_url + path, data=raw, headers={"content-type": "application/json"}, stream=True, timeout=REQUEST_TIMEOUT_S
    )
    with response:
        assert response.status_code < 500, f"{response.status_code} for {raw}: {response.text[:500]}"
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], raw
            assert error["type"] and error["code"] == response.status_code, (raw, error)
            return
        assert 200 <= response.status_code < 300
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event or event["error"]["code"] < 500, (raw, event)
        else:
            assert "choices" in response.json(), raw


fuzz = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


# The @example bodies are requests only the engine can judge (vLLM checks them against the
# model's vocabulary when the request is added): always tried, whatever hypothesis draws.
@fuzz
@given(body=bodies("prompt", prompts, COMPLETIONS_ONLY))
@example(body={"prompt": "The river", "max_tokens": 4, "logit_bias": {"1050": 5.0}})
@example(body={"prompt": "The river", "max_tokens": 4, "allowed_token_ids": [5, 4000]})
@example(body={"prompt": "The river", "max_tokens": 4, "stop_token_ids": [99999]})
@example(body={"prompt": "The river", "max_tokens": 4, "bad_words": ["zzzz qqqq"]})
@example(body={"prompt": [1, 2, 3], "max_tokens": 4, "truncate_prompt_tokens": 2})
def test_fuzzed_completions_get_2xx_or_an_openai_4xx(app, body):
    check(app, "/v1/completions", body)


@fuzz
@given(body=bodies("messages", messages, CHAT_ONLY))
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"2000": -5.0}})
def test_fuzzed_chat_completions_get_2xx_or_an_openai_4xx(app, body):
    check(app, "/v1/chat/completions", body)


def test_nothing_is_left_in_flight_after_fuzzing(app):
    wait_idle(app)
