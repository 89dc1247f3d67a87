"""vLLM's /tokenize and /detokenize on the router (router/tokenization.py).

The oracle is vLLM's own ``ServingTokenization``, built in-process on the tiny model's config as
vLLM's server builds it (renderer, model registry, no engine): each request goes to it and to the
router's HTTP app (the in-process app, mock engines), and the bodies must be equal. The ids must
also be those a completion of the same prompt sends to its engine.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any
from unittest import mock

import httpx
import pytest

from serve_app.router import service as service_module
from tests.support import vllm_renderer
from tests.support.inprocess import MOCK_ARGS, App, engine_calls, recording_router_metrics
from tests.support.inprocess import run_http as run

MODEL = MOCK_ARGS["served_model_name"]
MAX_MODEL_LEN = MOCK_ARGS["max_model_len"]
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Où est la gare ? 東京"},
    {"role": "assistant", "content": "Tout droit."},
    {"role": "user", "content": [{"type": "text", "text": "Et après"}, {"type": "text", "text": "?"}]},
]
TOOL_TURNS = [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},  # noqa: E501
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather", "parameters": {"type": "object"}}}

TOKENIZE = [
    {"prompt": "The river ran past the old mill"},
    {"prompt": "The river ran past the old mill", "add_special_tokens": False, "return_token_strs": True},
    {"prompt": "naïve café 東京 🙂 <s> </s>", "return_token_strs": True, "model": MODEL},
    {"prompt": ""},
    {"prompt": "the river " * 1500},  # longer than the context: counted, not refused (as vLLM)
    {"messages": CHAT},
    {"messages": CHAT, "return_token_strs": True, "add_generation_prompt": False},
    {"messages": CHAT[:3], "add_generation_prompt": False, "continue_final_message": True},
    {"messages": CHAT[:2], "add_special_tokens": True},
    {"messages": CHAT[:2], "tools": [TOOL]},
    {"messages": CHAT[:2], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": CHAT[:2], "tools": []},
    {"messages": [{"role": "developer", "content": "Be brief."}, *CHAT[1:]], "model": ""},  # "" is any model, as there
    {"messages": [CHAT[1], *TOOL_TURNS]},  # an agent's history: a call (content null) and its result
]
DETOKENIZE = [
    {"tokens": [1, 766, 428, 304]},
    {"tokens": [1, 2, 3, 4, 5, 6, 205]},  # special tokens are spelled out
    {"tokens": []},
    {"tokens": [255, 256, 257], "model": MODEL},  # byte pieces
]


@pytest.fixture(scope="module")
def vllm_tokenization():
    """vLLM's server's tokenization handler for the tiny model, as its api_server builds it."""
    pytest.importorskip("vllm.renderers.online_renderer", reason="vLLM 0.23 builds its handler over an engine client")
    return vllm_renderer.tokenization(MODEL, MAX_MODEL_LEN)


async def vllm_answer(handler: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

    raw = mock.Mock(headers={}, state=None)
    if path == "/detokenize":
        return (await handler.create_detokenize(DetokenizeRequest(**body), raw)).model_dump()
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return (await handler.create_tokenize(model(**body), raw)).model_dump()


def test_every_answer_is_vllms_own_over_http_and_the_handle_api(tiny_tokenizer, vllm_tokenization):
    cases = [("/tokenize", body) for body in TOKENIZE] + [("/detokenize", body) for body in DETOKENIZE]

    async def body(app: App, client: httpx.AsyncClient) -> None:
        for path, request in cases:
            expected = await vllm_answer(vllm_tokenization, path, request)
            response = await client.post(path, json=request)
            assert response.status_code == 200, response.text
            assert response.json() == expected, (path, request)
            status, handled = await app.service.tokenizer_route(path.lstrip("/"), request)  # the handle API's path
            assert (status, handled) == (200, expected)
        long = (await client.post("/tokenize", json=TOKENIZE[4])).json()
        assert long["count"] > long["max_model_len"] == MAX_MODEL_LEN

    run(body, tiny_tokenizer)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_ids_are_those_a_completion_sends_to_its_engine(tiny_tokenizer, route):
    request = {"prompt": "The river ran past the old mill"} if route == "completions" else {"messages": CHAT, "tools": [TOOL]}
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        tokens = (await client.post("/tokenize", json=request)).json()["tokens"]
        assert calls == []  # answered by the router alone
        extra = {"tool_choice": "none"} if route == "chat" else {}  # (the template still gets the tools, as on vLLM's server)
        response = await client.post(path, json={**request, **extra, "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(tokens)
        assert {call["engine"].split("-")[0] for call in calls} == {"prefill", "decode"}  # disaggregated: both got it
        assert all(call["prompt"] == tokens for call in calls), calls

    run(body, tiny_tokenizer)


REFUSED = [
    ("/tokenize", b"{not json", 400, None),
    ("/tokenize", b"[1, 2]", 400, None),
    ("/tokenize", json.dumps({}), 400, "prompt"),
    ("/tokenize", json.dumps({"prompt": 12}), 400, "prompt"),
    ("/tokenize", json.dumps({"prompt": "hi", "model": "no-such-model"}), 404, "model"),
    ("/tokenize", json.dumps({"messages": "hi"}), 400, "messages"),
    ("/tokenize", json.dumps({"messages": []}), 400, "messages"),  # as vLLM's server
    ("/tokenize", json.dumps({"messages": CHAT, "continue_final_message": True}), 400, None),
    ("/tokenize", json.dumps({"messages": CHAT, "chat_template": "{{ 'x' }}"}), 400, "chat_template"),
    ("/tokenize", json.dumps({"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}), 400, "chat_template_kwargs"),
    ("/tokenize", json.dumps({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}), 400, "chat_template_kwargs.tokenize"),
    ("/tokenize", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "messages.0.content"),
    ("/tokenize", json.dumps({"prompt": "\\ud800"}).replace("\\\\", "\\"), 400, None),
    ("/detokenize", json.dumps({}), 400, "tokens"),
    ("/detokenize", json.dumps({"tokens": [1, -1]}), 400, "tokens.1"),
    ("/detokenize", json.dumps({"tokens": [1, 2**63]}), 400, "tokens.1"),
    ("/detokenize", json.dumps({"tokens": [1, 5, 999999]}), 400, "tokens"),
    ("/detokenize", json.dumps({"tokens": [1] * (MAX_MODEL_LEN + 1)}), 400, "tokens"),  # more than a context
    ("/detokenize", json.dumps({"tokens": "1 2"}), 400, "tokens"),
    ("/detokenize", json.dumps({"tokens": [1], "model": "no-such-model"}), 404, "model"),
]


def test_bad_requests_get_openai_errors_and_are_counted(tiny_tokenizer):
    metrics = recording_router_metrics()

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        for path, request, status, param in REFUSED:
            response = await client.post(path, content=request, headers={"content-type": "application/json"})
            assert response.status_code == status, (path, request, response.text)
            error = response.json()["error"]
            assert error["code"] == status and error["message"] and error["type"] == "invalid_request_error", error
            if param is not None:
                assert error["param"] == param, (request, error)
        assert "out of range [0, " in (await client.post("/detokenize", json={"tokens": [999999]})).json()["error"]["message"]
        assert calls == []  # nothing reached an engine
        # The handle API: an error body, never an exception; a lone surrogate is named.
        status, handled = await app.service.tokenizer_route("tokenize", {"prompt": "\ud800"})
        assert status == 400 and handled["error"]["type"] == "invalid_request_error"

    run(body, tiny_tokenizer, metrics)
    counted = Counter((path.lstrip("/"), str(status)) for path, _, status, _ in REFUSED)
    counted["tokenize", "400"] += 1  # the handle API's
    counted["detokenize", "400"] += 1  # the id out of the vocabulary's range
    for (route, status), times in counted.items():
        assert metrics.requests.value(route=route, status=status) == times, (route, status)


def test_a_client_template_is_rendered_only_when_the_operator_trusts_clients(tiny_tokenizer):
    template = "{{ documents or '' }}{{ reasoning_effort or '' }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    # vLLM's /tokenize request has neither documents nor reasoning_effort: they are ignored, as there.
    request = {"messages": CHAT[:2], "chat_template": template, "documents": [{"title": "t", "text": "x"}], "reasoning_effort": "low"}

    async def body(app: App, client: httpx.AsyncClient) -> None:
        response = await client.post("/tokenize", json=request)
        assert response.status_code == 200, response.text
        text = "[system] Answer briefly.\n[user] Où est la gare ? 東京\n"
        assert response.json()["tokens"] == tiny_tokenizer.encode(text, add_special_tokens=False)

        # A template that renders more than a body can hold is refused, where a completion's
        # would be refused for its length: counting it would hold a worker thread for a minute.
        amplified = {"messages": CHAT[:1], "chat_template": "{% for i in range(300) %}{{ 'a b ' * 5000 }}{% endfor %}"}
        refused = await client.post("/tokenize", json=amplified)
        assert refused.status_code == 400 and "tokenizes at most" in refused.json()["error"]["message"], refused.text

    run(body, tiny_tokenizer, trust_request_chat_template=True)


def test_large_bodies_are_answered_off_the_event_loop(tiny_tokenizer):
    """A long prompt's tokenizing, and its long reply's encoding, must not stall the replica's
    streams: past the same size as a completion's, the work goes to a worker thread."""
    big = {"prompt": "the river " * (service_module.OFFLOAD_BYTES // 8)}

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = []
        real = asyncio.to_thread

        async def counting(fn, *args, **kwargs):
            calls.append(getattr(fn, "__name__", fn))
            return await real(fn, *args, **kwargs)

        with mock.patch.object(service_module.asyncio, "to_thread", counting):
            assert (await client.post("/tokenize", json={"prompt": "short"})).status_code == 200
            assert (await client.post("/detokenize", json={"tokens": [i % 500 for i in range(MAX_MODEL_LEN)]})).status_code == 200
            assert calls == []
            response = await client.post("/tokenize", json=big)
            assert response.status_code == 200 and response.json()["count"] > service_module.LARGE_REPLY_TOKENS
            assert calls == ["work", "JSONResponse"]  # tokenized, then encoded, in worker threads
            status, _ = await app.service.tokenizer_route("tokenize", big)  # the handle API: the same bound
            assert status == 200 and calls[2:] == ["work"]

    run(body, tiny_tokenizer)
