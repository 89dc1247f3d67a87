"""The fuzz tests' strategies against the in-process app (mock engines), so the router's parsing
and refusals are fuzzed in ``make test-fast`` too: every answer is a 2xx or an OpenAI 4xx,
streams carry no 5xx event, and after each test nothing is held anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from serve_app.router.direct_http import openai_app
from tests.support.fuzz_strategies import CHAT_ONLY, CLIENT_ERRORS, COMPLETIONS_ONLY, bodies, messages, oversized, prompts, raw_bodies
from tests.support.inprocess import MOCK_ARGS, App

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

fuzz = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


class Harness:
    """The app and an HTTP client to its router, on one event loop that outlives the examples."""

    def __init__(self, tokenizer: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.app: App = self.loop.run_until_complete(App.start(MOCK_ARGS, tokenizer))
        transport = httpx.ASGITransport(app=openai_app(self.app.service))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://router", timeout=30)

    def post(self, path: str, raw: bytes) -> int:
        """The answer's status, once it is checked."""
        return self.loop.run_until_complete(asyncio.wait_for(self._post(path, raw), 30))

    async def _post(self, path: str, raw: bytes) -> int:
        response = await self.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code < 300 or response.status_code in CLIENT_ERRORS, (
            f"{response.status_code} for {raw[:300]!r}: {response.text[:300]}"
        )
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] and error["code"] == response.status_code, error
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event or event["error"]["code"] in CLIENT_ERRORS, event
        else:
            assert "choices" in response.json()
        return response.status_code

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.app.idle())  # nothing held after the examples
        finally:
            self.loop.run_until_complete(self.client.aclose())
            self.loop.run_until_complete(self.app.stop())
            self.loop.close()


@pytest.fixture
def harness(tiny_tokenizer) -> Iterator[Harness]:
    h = Harness(tiny_tokenizer)
    try:
        yield h
    finally:
        h.close()


ROUTES = {
    "/v1/completions": bodies("prompt", prompts, COMPLETIONS_ONLY),
    "/v1/chat/completions": bodies("messages", messages, CHAT_ONLY),
}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_fuzzed_requests(harness, path):
    @fuzz
    @given(body=ROUTES[path])
    def fuzzed(body: Any) -> None:
        harness.post(path, json.dumps(body, allow_nan=True).encode())

    fuzzed()


def test_raw_and_oversized_bodies(harness):
    @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(raw=raw_bodies)
    def fuzzed(raw: bytes) -> None:
        harness.post("/v1/completions", raw)
        harness.post("/v1/chat/completions", raw)

    fuzzed()
    limit = harness.app.service.config.router.http.max_body_bytes
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert harness.post(path, oversized(limit)) == 413
        assert harness.post(path, oversized(limit - 1)) < 500  # one byte less is read and parsed
