"""API keys on the router's HTTP routes (router/client_keys.py), as vLLM's ``--api-key``: over
the router's own HTTP app on the in-process app (mock engines)."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import pytest

from serve_app.config.settings import load_config
from serve_app.router.client_keys import ClientKeys
from tests.support.inprocess import MOCK_ARGS, App, engine_calls, recording_router_metrics
from tests.support.inprocess import run_http as run

KEYS = ["token-abc123", "second-key-of-two"]
OPERATOR = "operator-token-0123456789"
COMPLETION = {"prompt": [11, 12, 13], "max_tokens": 2}
GUARDED = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/v1/models", None),
    ("GET", "/pd/engines", None),
]


async def call(client: httpx.AsyncClient, method: str, path: str, body: Any, authorization: str | None = None) -> httpx.Response:
    headers = {} if authorization is None else {"authorization": authorization}
    return await client.request(method, path, json=body, headers=headers)


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == 401 and error["type"] == "invalid_request_error" and "API key" in error["message"]


def test_with_keys_every_route_but_health_needs_one_and_a_refused_request_reaches_no_engine(tiny_tokenizer):
    metrics = recording_router_metrics()
    wrong = [None, "Bearer nope", "Basic token-abc123", "token-abc123", "Bearer token-abc12", "Bearer token-abc1234", "Bearer "]

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        for method, path, request in GUARDED:
            for authorization in wrong:
                assert_refused(await call(client, method, path, request, authorization))
        assert calls == []
        # A refused body is never read: a client without a key cannot make the router hold 4 MB.
        huge = await client.post("/v1/completions", content=b"x" * (8 << 20), headers={"content-type": "application/json"})
        assert_refused(huge)
        assert (await client.get("/health")).status_code == 200  # probes carry no key
        for method, path, request in GUARDED:
            for authorization in ("Bearer token-abc123", "bearer second-key-of-two", "Bearer  token-abc123"):
                response = await call(client, method, path, request, authorization)
                assert response.status_code == 200, (path, authorization, response.text)
        assert len(calls) == 3 * 2 * 2  # each admitted completion (3 keys, 2 routes): prefill and decode
        engines = (await call(client, "GET", "/pd/engines", None, f"Bearer {OPERATOR}")).json()
        assert all("call_endpoint" in engine for engine in engines["engines"].values())  # the operator's full view
        public = (await call(client, "GET", "/pd/engines", None, "Bearer token-abc123")).json()
        assert not any("call_endpoint" in engine for engine in public["engines"].values())
        assert_refused(await call(client, "POST", "/v1/completions", COMPLETION, f"Bearer {OPERATOR}"))  # not a client key

    run(body, tiny_tokenizer, metrics, api_keys=KEYS, operator_token=OPERATOR)
    refused = len(wrong) * len(GUARDED) + 2
    assert sum(value for key, value in metrics.requests.values.items() if ("status", "401") in key) == refused
    assert metrics.requests.value(route="completions", status="401") == len(wrong) + 2
    assert metrics.errors.value(kind="unauthorized") == refused


def test_without_keys_nothing_is_asked_for(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        for method, path, request in GUARDED:
            assert (await call(client, method, path, request)).status_code == 200, path
            assert (await call(client, method, path, request, "Bearer anything")).status_code == 200, path

    run(body, tiny_tokenizer)


@pytest.mark.parametrize(
    "configured,environ,admitted,refused",
    [
        (None, {"VLLM_API_KEY": "from-the-env"}, "from-the-env", "other"),  # as vLLM's server reads it
        (["from-config"], {"VLLM_API_KEY": "from-the-env"}, "from-config", "from-the-env"),  # the config wins
        ([], {"VLLM_API_KEY": "from-the-env"}, None, None),  # turned off explicitly
        (None, {"VLLM_API_KEY": ""}, None, None),
    ],
)
def test_the_keys_come_from_the_config_else_vllms_environment_variable(tiny_tokenizer, configured, environ, admitted, refused):
    router = {} if configured is None else {"api_keys": configured}

    async def body(app: App, client: httpx.AsyncClient) -> None:
        assert app.service.client_keys.required == (admitted is not None)
        if admitted is None:
            assert (await client.get("/v1/models")).status_code == 200
            return
        assert (await client.get("/v1/models", headers={"authorization": f"Bearer {admitted}"})).status_code == 200
        assert_refused(await client.get("/v1/models", headers={"authorization": f"Bearer {refused}"}))

    run(body, tiny_tokenizer, environ=environ, **router)


def test_a_key_must_not_be_empty():
    args = copy.deepcopy(MOCK_ARGS)
    args["router"]["api_keys"] = ["ok-key", ""]
    with pytest.raises(ValueError, match="api_keys"):
        load_config(args)


def test_a_refusal_compares_the_presented_key_with_every_key():
    """No early exit on the first match or mismatch: each refusal costs the same whatever key was
    presented, so its time says nothing of the keys."""
    keys = ClientKeys(["a" * 20, "b" * 20, "c" * 20])
    with mock.patch("serve_app.router.client_keys.secrets.compare_digest", wraps=__import__("secrets").compare_digest) as compare:
        assert keys.admit("Bearer " + "a" * 20)
        assert compare.call_count == 3
        assert not keys.admit("Bearer " + "z" * 20)
        assert compare.call_count == 6
    assert ClientKeys(["", ""]).required is False and ClientKeys(["", ""]).admit(None)


SECRET_REASON = "DEPLOY_FAILED: FileNotFoundError: /srv/models/internal-llm-70b/config.json"


def engines_down(app: App) -> None:
    """Every decode engine down, and Serve's reason naming a private path."""
    for load in app.service.pool.of_role("decode"):
        load.healthy = False

    async def why() -> dict[str, str]:
        return {"decode": SECRET_REASON}

    async def stay_down() -> None:
        return None

    app.service.engine_status = why
    app.service.pool.refresh = stay_down


def assert_health(response: Any, told: bool) -> None:
    assert response.status_code == 503
    message = json.loads(response.body)["error"]["message"]
    assert (SECRET_REASON in message) is told and message.startswith("no healthy decode engine"), message


def test_with_keys_a_health_probe_without_one_is_not_told_why_the_engines_are_down(tiny_tokenizer):
    """A 503 for everyone (probes carry no key); Serve's reasons (paths, the model, addresses)
    only for a caller with an API key or the operator token."""

    async def body(app: App, client: httpx.AsyncClient) -> None:
        assert (await client.get("/health")).status_code == 200
        engines_down(app)
        for authorization, told in ((None, False), ("Bearer nope", False), ("Bearer token-abc123", True), (f"Bearer {OPERATOR}", True)):
            response = await call(client, "GET", "/health", None, authorization)
            assert_health(SimpleNamespace(status_code=response.status_code, body=response.content), told)

    run(body, tiny_tokenizer, api_keys=KEYS, operator_token=OPERATOR)


# Python's own finalizer calls the wrapper's async __del__ too when the test drops the replica.
@pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited:RuntimeWarning")
def test_over_serves_proxy_the_ingress_routes_ask_for_a_key_too(tiny_tokenizer):
    """The Router deployment's own routes (Serve's proxy in front), called as Serve calls them."""
    from starlette.requests import Request

    from serve_app.router.deployment import Router

    def request(path: str, method: str, authorization: str | None) -> Request:
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]

        sent = []

        async def receive() -> dict[str, Any]:
            if sent:  # the body once, then a client that stays
                await asyncio.Event().wait()
            sent.append(True)
            return {"type": "http.request", "body": b"{}", "more_body": False}

        return Request({"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}, receive)

    async def body(app: App, client: httpx.AsyncClient) -> None:
        replica = object.__new__(Router.func_or_class)  # the class Serve instantiates
        replica.service = app.service
        routes = {
            "completions": ("/v1/completions", "POST"),
            "chat_completions": ("/v1/chat/completions", "POST"),
            "tokenize_route": ("/tokenize", "POST"),
            "detokenize_route": ("/detokenize", "POST"),
            "models": ("/v1/models", "GET"),
            "engines": ("/pd/engines", "GET"),
        }
        for name, (path, method) in routes.items():
            for authorization in (None, "Bearer nope", f"Bearer {OPERATOR}" if name != "engines" else "Bearer nope"):
                refused = await getattr(replica, name)(request(path, method, authorization))
                assert refused.status_code == 401, name
        assert (await replica.models(request("/v1/models", "GET", "Bearer token-abc123")))["data"][0]["id"] == "tiny-llama"
        assert "engines" in await replica.engines(request("/pd/engines", "GET", f"Bearer {OPERATOR}"))
        served = await replica.tokenize_route(request("/tokenize", "POST", "Bearer token-abc123"))
        assert served.status_code == 400  # admitted: the empty body's own error
        engines_down(app)
        for authorization, told in ((None, False), ("Bearer nope", False), ("Bearer token-abc123", True), (f"Bearer {OPERATOR}", True)):
            assert_health(await replica.health(request("/health", "GET", authorization)), told)

    run(body, tiny_tokenizer, api_keys=KEYS, operator_token=OPERATOR)
