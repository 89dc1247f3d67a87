"""Property-based fuzzing of the OpenAI routes on the app of configs/serve.yaml (real engines).

Hypothesis builds request bodies from every field the two routes know (tests/support/fuzz_strategies.py:
sensible, borderline and hostile values, unbounded integers, lone surrogates, client templates,
fields pd-serve refuses), and raw bodies that are not JSON, nested past any parser's limit or
just over the router's size limit. Whatever comes in, the answer is a 2xx or a 4xx with an
OpenAI error body, within a bound time; never a 5xx, a traceback or a hang; a stream never
carries an error event with a 5xx code; and after each test nothing is left in flight anywhere
(each test checks its own requests, whatever ran before it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings

from tests.support.cluster import wait_idle
from tests.support.fuzz_strategies import CHAT_ONLY, CLIENT_ERRORS, COMPLETIONS_ONLY, bodies, messages, oversized, prompts, raw_bodies

pytestmark = pytest.mark.engine

EXAMPLES = 80  # per route: enough to reach the engines with odd but valid requests, bounded in time
REQUEST_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def own_requests(app) -> Iterator[None]:
    """Every test's leak check, covering its own requests only: the app must be idle before the test
    starts (else the setup errors, naming what an earlier test left), and idle again after it
    (else this test fails). Without the first check a test's last check read whatever the tests
    before it left, and passed or failed by the order the tests ran in."""
    try:
        wait_idle(app)
    except AssertionError as exc:
        raise RuntimeError(f"held before this test began (left by an earlier test): {exc}") from None
    yield
    wait_idle(app)


def check(app, path: str, body: Any) -> None:
    check_raw(app, path, json.dumps(body, allow_nan=True).encode())


def check_raw(app, path: str, raw: bytes) -> None:
    response = requests.post(
        app.base_url + path, data=raw, headers={"content-type": "application/json"}, stream=True, timeout=REQUEST_TIMEOUT_S
    )
    with response:
        assert response.status_code < 300 or response.status_code in CLIENT_ERRORS, (
            f"{response.status_code} for {raw[:300]!r}: {response.text[:500]}"
        )
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
                    assert "error" not in event or event["error"]["code"] in CLIENT_ERRORS, (raw[:300], event)
        else:
            assert "choices" in response.json(), raw


fuzz = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


# The @example bodies are requests only the engine can judge (vLLM checks them against the
# model's vocabulary when the request is added): always tried, whatever hypothesis draws.
# Each test runs its examples; the own_requests fixture (autouse) then checks that nothing they
# started is still held.
def test_fuzzed_completions_get_2xx_or_an_openai_4xx(app):
    @fuzz
    @given(body=bodies("prompt", prompts, COMPLETIONS_ONLY))
    @example(body={"prompt": "The river", "max_tokens": 4, "logit_bias": {"1050": 5.0}})
    @example(body={"prompt": "The river", "max_tokens": 4, "allowed_token_ids": [5, 4000]})
    @example(body={"prompt": "The river", "max_tokens": 4, "stop_token_ids": [99999]})
    @example(body={"prompt": "The river", "max_tokens": 4, "bad_words": ["zzzz qqqq"]})
    @example(body={"prompt": [1, 2, 3], "max_tokens": 4, "truncate_prompt_tokens": 2})
    @example(body={"prompt": "The river", "max_tokens": 4, "top_k": 2**64 + 1})
    @example(body={"prompt": "The \ud800 river", "max_tokens": 4})
    @example(body={"prompt": "The river", "max_tokens": 4, "logit_bias": {str(2**70): 1.0}, "stop_token_ids": [-(2**65)]})
    @example(body={"prompt": "The river", "max_tokens": 4, "vllm_xargs": {"a": 2**64, "b": "\udfff"}})
    @example(body={"prompt": "The river", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
    @example(body={"prompt": "The river", "max_tokens": 4, "structured_outputs": []})
    def fuzzed(body: Any) -> None:
        check(app, "/v1/completions", body)

    fuzzed()


def test_fuzzed_chat_completions_get_2xx_or_an_openai_4xx(app):
    @fuzz
    @given(body=bodies("messages", messages, CHAT_ONLY))
    @example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"2000": -5.0}})
    @example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    @example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "chat_template_kwargs": {"tokenize": True}})
    @example(body={"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4})
    def fuzzed(body: Any) -> None:
        check(app, "/v1/chat/completions", body)

    fuzzed()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_and_oversized_bodies_get_an_openai_4xx(app, path):
    @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(raw=raw_bodies)
    def fuzzed(raw: bytes) -> None:
        check_raw(app, path, raw)

    fuzzed()
    from serve_app.config.settings import load_config

    limit = load_config(app.args).router.http.max_body_bytes
    response = requests.post(app.base_url + path, data=oversized(limit), headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
