"""A client's name for its request (``X-Request-Id``, the body's ``request_id``) names the
response, as on vLLM's server (``cmpl-<id>``), and its engine requests, which stay unique."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.support.inprocess import App, engine_calls
from tests.support.inprocess import run_http as run

PROMPT = [11, 12, 13]
COMPLETION = {"prompt": PROMPT, "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def stream_ids(response: httpx.Response) -> set[str]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return {json.loads(line)["id"] for line in lines}


def test_the_header_or_the_body_names_the_response_and_its_engine_requests(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        out = await client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": trace})
        assert out.json()["id"] == f"cmpl-{trace}"
        assert {call["request_id"].startswith(f"cmpl-{trace}-") for call in calls} == {True}  # searchable in the logs
        chat = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "gw:7/a+b="})
        assert stream_ids(chat) == {"chatcmpl-gw:7/a+b="}
        assert (await client.post("/v1/completions", json={**COMPLETION, "request_id": "from-body"})).json()["id"] == "cmpl-from-body"
        both = await client.post("/v1/completions", json={**COMPLETION, "request_id": "from-body"}, headers={"x-request-id": "hdr"})
        assert both.json()["id"] == "cmpl-hdr"  # the header first, as vLLM's server
        plain = (await client.post("/v1/completions", json=COMPLETION)).json()["id"]
        assert plain.startswith("cmpl-") and len(plain) == len("cmpl-") + 32  # none given: a random one
        final = await app.service.complete({**CHAT, "request_id": "handle-1"})  # the handle API: the body's
        assert final["id"] == "chatcmpl-handle-1"

    run(body, tiny_tokenizer)


def test_clients_reusing_an_id_get_engine_requests_of_their_own(tiny_tokenizer):
    """Two requests of one name at once, and a request's several choices: every engine request
    has a name of its own (two of one name would be one request to an engine)."""

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        headers = {"x-request-id": "same"}
        first, second, third = await asyncio.gather(
            client.post("/v1/completions", json={**COMPLETION, "max_tokens": 20}, headers=headers),
            client.post("/v1/completions", json={**COMPLETION, "max_tokens": 20}, headers=headers),
            client.post("/v1/completions", json={**COMPLETION, "max_tokens": 20, "n": 2}, headers=headers),
        )
        assert first.json()["id"] == second.json()["id"] == third.json()["id"] == "cmpl-same"
        assert len(third.json()["choices"]) == 2
        decode_ids = [call["request_id"] for call in calls if call["engine"].startswith("decode")]
        assert len(decode_ids) == 4 and len(set(decode_ids)) == 4, decode_ids

    run(body, tiny_tokenizer)


@pytest.mark.parametrize(
    "headers,extra",
    [
        ({"x-request-id": "has space"}, {}),
        ({"x-request-id": "x" * 129}, {}),
        ({"x-request-id": ""}, {}),
        ({"x-request-id": "naïve".encode()}, {}),
        ({}, {"request_id": "line\nbreak"}),
        ({}, {"request_id": "a" * 200}),
    ],
)
def test_an_id_outside_the_bound_is_a_400_before_any_engine(tiny_tokenizer, headers, extra):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        for path, request in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            response = await client.post(path, json={**request, **extra}, headers=headers)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "request_id"
        assert calls == []

    run(body, tiny_tokenizer)
