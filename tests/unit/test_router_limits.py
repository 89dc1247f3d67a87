"""What a client cannot do to a router (issue 31): every hostile input is a 4xx with an OpenAI
error body, never a 500, a stalled event loop or a held connection, and nothing stays held.

Through the router's own HTTP app (router/direct_http.py) over the in-process app with mock
engines; the server-level limits (header deadline, connection limit) on a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.router.direct_http import read_body
from serve_app.router.errors import CLIENT_CLOSED, OpenAIError
from serve_app.runtime.http_server import InReplicaServer, listening_socket
from tests.support.inprocess import App, recording_router_metrics
from tests.support.inprocess import router_args as app_args
from tests.support.inprocess import run_http as run

BIG = 2**64 + 5
PROMPT = [11, 12, 13]
OPERATOR_TOKEN = "operator-token-0123456789"




def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    return error


NESTED_SCHEMA = json.loads('{"type": "array", "items": ' * 65 + "{}" + "}" * 65)  # 66 levels
HOSTILE = {
    "top_k": ({"top_k": BIG}, "top_k"),
    "stop_token_ids": ({"stop_token_ids": [BIG]}, "stop_token_ids"),
    "allowed_token_ids": ({"allowed_token_ids": [BIG]}, "allowed_token_ids"),
    "logit_bias key": ({"logit_bias": {str(BIG): 1.0}}, "logit_bias"),
    "negative top_k": ({"top_k": -BIG}, "top_k"),  # vLLM's own check refuses it first
    "seed": ({"seed": BIG}, "seed"),
    "negative seed": ({"seed": -BIG}, "seed"),
    "max_tokens": ({"max_tokens": BIG}, "max_tokens"),
    "min_tokens": ({"min_tokens": BIG}, "min_tokens"),
    "vllm_xargs value": ({"vllm_xargs": {"my_arg": BIG}}, "vllm_xargs"),
    "negative stop_token_ids": ({"stop_token_ids": [-BIG]}, "stop_token_ids"),
    "surrogate prompt": ({"prompt": "hi \ud800 there"}, "prompt"),
    "surrogate model": ({"model": "\ud800"}, "model"),
    "surrogate stop": ({"stop": ["\ud800"]}, "stop.0"),
    "ec_transfer_params": ({"ec_transfer_params": {"x": 1}}, "ec_transfer_params"),
    "vllm_xargs ec_transfer_params": ({"vllm_xargs": {"ec_transfer_params": "x"}}, "vllm_xargs.ec_transfer_params"),
    # Fields of the wrong shape that vLLM's validators read before their types are checked.
    "structured_outputs of the wrong shape": ({"structured_outputs": []}, "structured_outputs"),  # found by the fast fuzzer
    "response_format of the wrong shape": ({"response_format": "json"}, "response_format"),
    "prompt_logprobs of the wrong type": ({"prompt_logprobs": "all"}, "prompt_logprobs"),
    # A schema as a string escapes the body's nesting bound; converting it costs steeply more with
    # depth (vLLM 0.23, on Ascend, does not bound it).
    "structured_outputs.json nested in a string": (
        {"structured_outputs": {"json": '{"type": "array", "items": ' * 65 + "{}" + "}" * 65}},
        "structured_outputs.json",
    ),
    # As an object too: a body is bounded only by Python's recursion limit (about 1,000 levels).
    "structured_outputs.json nested as an object": ({"structured_outputs": {"json": NESTED_SCHEMA}}, "structured_outputs.json"),
    "response_format's schema nested": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": NESTED_SCHEMA}}},
        "structured_outputs.json",
    ),
    "structured_outputs.json nested past Python's recursion limit": (
        {"structured_outputs": {"json": "[" * 100_000 + "]" * 100_000}},
        "structured_outputs.json",
    ),
    "empty cache_salt": ({"cache_salt": ""}, "cache_salt"),
    # Checked by the engine core after every token, for each pattern length up to the size.
    "repetition_detection over the bound": (
        {"repetition_detection": {"max_pattern_size": 100_000, "min_count": 2}},
        "repetition_detection.max_pattern_size",
    ),
    # vLLM's fields the router does not implement: refused, never accepted and dropped.
    "truncate_prompt_tokens over the context": ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    "truncate_prompt_tokens to nothing": ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    "priority": ({"priority": 1}, "priority"),
    "logprob_token_ids": ({"logprob_token_ids": [5]}, "logprob_token_ids"),
    "return_token_offsets": ({"return_token_offsets": True}, "return_token_offsets"),
    # Inside msgpack's range but outside the vocabulary: vLLM's own checks, before any engine.
    "logit_bias key outside the vocabulary": ({"logit_bias": {"1000000": 1.0}}, "logit_bias"),
    "negative logit_bias key": ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    "allowed_token_ids outside the vocabulary": ({"allowed_token_ids": [5, 1000000]}, "allowed_token_ids"),
    "negative allowed_token_ids": ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    "stop_token_ids outside the vocabulary": ({"stop_token_ids": [-1]}, "stop_token_ids"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_fields_are_a_400_naming_them(tiny_tokenizer, case, stream):
    fields, param = HOSTILE[case]

    async def body(app: App, client: httpx.AsyncClient) -> None:
        raw = json.dumps({"prompt": PROMPT, "max_tokens": 4, "stream": stream, **fields})  # ascii: \\ud800 stays an escape
        with mock.patch.object(app.service, "_session", side_effect=AssertionError("an engine was asked")):
            response = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(response, 400, param)

    run(body, tiny_tokenizer)


def test_surrogates_in_chat_messages_and_through_the_handle_api(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        raw = json.dumps({"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 3})
        response = await client.post("/v1/chat/completions", content=raw)
        assert_openai_error(response, 400, "messages.0.content")
        final = await app.service.complete({"prompt": "x\udfff", "max_tokens": 3})
        assert final["error"]["code"] == 400 and final["error"]["param"] == "prompt"
        events = [e async for e in app.service.generate({"messages": [{"role": "\ud800", "content": "hi"}]})]
        assert len(events) == 1 and events[0]["error"]["code"] == 400
        # A surrogate in a key the error's param quotes (found by the fuzzer): escaped, else the
        # error body itself could not be written (a 500).
        raw = json.dumps({"messages": [], "max_tokens": 1, "add_generation_prompt": {"\ud800": "\ud800"}})
        response = await client.post("/v1/chat/completions", content=raw)
        assert_openai_error(response, 400, "add_generation_prompt.\\ud800")

    run(body, tiny_tokenizer)


def test_deeply_nested_or_broken_json_is_a_400(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        for raw in (b"[" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"prompt": "unterminated', b"\xff\xfe"):
            assert_openai_error(await client.post("/v1/completions", content=raw), 400)
        nested: Any = "x"
        for _ in range(200):
            nested = {"a": nested}
        final = await app.service.complete({"prompt": "hi", "max_tokens": 2, "vllm_xargs": nested})
        assert final["error"]["code"] == 400

    run(body, tiny_tokenizer)


def test_a_client_chat_template_is_refused_unless_the_operator_trusts_clients(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    smuggled = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 'x' * 100000000 }}"}}
    direct = {"messages": messages, "max_tokens": 2, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}

    async def refused(app: App, client: httpx.AsyncClient) -> None:
        error = assert_openai_error(await client.post("/v1/chat/completions", json=smuggled), 400, "chat_template_kwargs")
        assert "trust_request_chat_template" in error["message"]
        assert_openai_error(await client.post("/v1/chat/completions", json=direct), 400, "chat_template")
        for key in ("tokenize", "return_dict", "tokenizer_kwargs", "conversations", "documents"):
            bad = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {key: True}}
            assert_openai_error(await client.post("/v1/chat/completions", json=bad), 400, f"chat_template_kwargs.{key}")
        # Template variables still pass.
        fine = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
        assert (await client.post("/v1/chat/completions", json=fine)).status_code == 200

    run(refused, tiny_tokenizer)

    async def trusted(app: App, client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/chat/completions", json=direct)).status_code == 200
        # Trusted, but what it renders is still bounded by what the model can take (checked here
        # apart from the time bound, which a slow host could reach first: 10^8 characters).
        app.service.ctx.client_template_timeout_s = 600.0
        assert_openai_error(await client.post("/v1/chat/completions", json=smuggled), 400, "messages")

    run(trusted, tiny_tokenizer, trust_request_chat_template=True)


def test_a_trusted_client_template_is_stopped_at_its_time_bound(tiny_tokenizer):
    """A client's template runs in a worker thread, which nothing could cancel: a template that
    loops (nearly) without end is stopped inside the thread at the bound, a 400 naming it, and
    the thread is free again. Bound 0: even a trivial client template is stopped, so the bound
    is shown to apply whatever the host's speed; the server's own template never is."""
    messages = [{"role": "user", "content": "hi"}]
    looping = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"
    trivial = "{% for m in messages %}{{ m.content }}{% endfor %}"

    async def body(app: App, client: httpx.AsyncClient) -> None:
        async def chat(**sent: Any) -> httpx.Response:
            return await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **sent})

        app.service.ctx.client_template_timeout_s = 0.0
        for sent, param in (
            ({"chat_template": trivial}, "chat_template"),
            ({"chat_template_kwargs": {"chat_template": trivial}}, "chat_template_kwargs.chat_template"),
        ):
            assert "did not finish" in assert_openai_error(await chat(**sent), 400, param)["message"]
        assert (await chat()).status_code == 200
        app.service.ctx.client_template_timeout_s = 0.2
        assert_openai_error(await chat(chat_template=looping), 400, "chat_template")
        app.service.ctx.client_template_timeout_s = 30.0
        assert (await chat(chat_template=trivial)).status_code == 200

    run(body, tiny_tokenizer, trust_request_chat_template=True)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        too_long = "a" * (app.service.ctx.max_prompt_chars + 1)
        with mock.patch.object(app.service.ctx, "encode", side_effect=AssertionError("tokenized")):
            assert_openai_error(await client.post("/v1/completions", json={"prompt": too_long, "max_tokens": 2}), 400, "prompt")

    run(body, tiny_tokenizer)


@contextlib.contextmanager
def parse_threads() -> Iterator[list[str]]:
    """The name of the thread each request is parsed in, in order."""
    import serve_app.router.service as service_module

    threads: list[str] = []
    real = service_module.parse_request

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    with mock.patch.object(service_module, "parse_request", recording):
        yield threads


def test_large_bodies_are_parsed_off_the_event_loop(tiny_tokenizer):
    import serve_app.router.service as service_module

    async def body(app: App, client: httpx.AsyncClient) -> None:
        with parse_threads() as threads:
            assert (await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).status_code == 200
            padding = " " * (service_module.OFFLOAD_BYTES + 1)  # JSON whitespace: the same request, a large body
            raw = json.dumps({"prompt": PROMPT, "max_tokens": 2}).replace(",", "," + padding, 1)
            assert (await client.post("/v1/completions", content=raw)).status_code == 200
            many = [{"role": "user", "content": ""}] * (service_module.OFFLOAD_MESSAGES + 1)  # a small body all the same
            assert (await client.post("/v1/chat/completions", json={"messages": many, "max_tokens": 2})).status_code == 200
        main = threading.main_thread().name
        assert threads[0] == main and threads[1] != main and threads[2] != main

    run(body, tiny_tokenizer)


def test_large_handle_api_requests_are_parsed_off_the_event_loop(tiny_tokenizer):
    """The handle API has no body size to go by: the size its body would have as JSON decides,
    with the same threshold as the HTTP API's."""
    import serve_app.router.service as service_module

    async def body(app: App, client: httpx.AsyncClient) -> None:
        large = {"prompt": PROMPT, "max_tokens": 2, "user": "u" * (service_module.OFFLOAD_BYTES + 1)}
        with parse_threads() as threads:
            assert "error" not in await app.service.complete({"prompt": PROMPT, "max_tokens": 2})
            assert "error" not in await app.service.complete(large)
            assert [e async for e in app.service.generate(large)][-1]["choices"][0]["finish_reason"] == "length"
        main = threading.main_thread().name
        assert threads[0] == main and threads[1] != main and threads[2] != main

    run(body, tiny_tokenizer)


def test_bodies_over_the_limit_are_a_413_without_being_read_whole(tiny_tokenizer):
    limit = 16 * 1024  # the least that holds a prompt of the app's max_model_len (2048) as token ids

    async def body(app: App, client: httpx.AsyncClient) -> None:
        declared = await client.post("/v1/completions", content=b"x" * (limit + 1))
        assert_openai_error(declared, 413)

        async def chunks():  # no Content-Length: counted while read
            for _ in range(100):
                yield b"y" * 1024

        assert_openai_error(await client.post("/v1/completions", content=chunks()), 413)
        fine = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
        assert (await client.post("/v1/completions", content=fine)).status_code == 200

    run(body, tiny_tokenizer, http={"max_body_bytes": limit})


def test_read_body_stops_reading_at_the_limit_and_gives_a_slow_body_a_deadline():
    received: list[int] = []

    def request(chunks: list[bytes], stall: bool = False, headers: list[tuple[bytes, bytes]] | None = None) -> Request:
        queue = list(chunks)

        async def receive() -> dict[str, Any]:
            if queue:
                received.append(1)
                return {"type": "http.request", "body": queue.pop(0), "more_body": bool(queue) or stall}
            await asyncio.sleep(3600)  # a client that stopped sending
            return {}

        return Request({"type": "http", "method": "POST", "headers": headers or []}, receive)

    async def main() -> None:
        with pytest.raises(OpenAIError) as too_big:
            await read_body(request([b"a" * 600] * 50), limit=1000, timeout_s=5)
        assert too_big.value.status == 413 and len(received) == 2  # stopped at the chunk that crossed it
        with pytest.raises(OpenAIError) as slow:
            await read_body(request([b"{"], stall=True), limit=1000, timeout_s=0.2)
        assert slow.value.status == 408
        assert await read_body(request([b"ab", b"cd"]), limit=1000, timeout_s=5) == b"abcd"
        for length in (b"9" * 5000, b"0" * 5000 + b"1001"):  # more digits than Python converts
            with pytest.raises(OpenAIError) as declared:
                await read_body(request([b"a"], headers=[(b"content-length", length)]), limit=1000, timeout_s=5)
            assert declared.value.status == 413
        assert await read_body(request([b"ab"], headers=[(b"content-length", b"0" * 5000 + b"2")]), limit=1000, timeout_s=5) == b"ab"

    asyncio.run(main())


def test_a_client_gone_before_its_body_ended_is_counted_not_an_application_error():
    """Starlette raises ClientDisconnect; uvicorn would log it as an error with a traceback."""
    parts: list[dict[str, Any]] = [{"type": "http.request", "body": b'{"prompt": "', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return parts.pop(0)

    async def main() -> None:
        with pytest.raises(OpenAIError) as gone:
            await read_body(Request({"type": "http", "method": "POST", "headers": []}, receive), limit=1000, timeout_s=5)
        assert gone.value.status == CLIENT_CLOSED

    asyncio.run(main())


def test_raw_surrogates_and_non_utf8_bodies_are_a_400(tiny_tokenizer):
    """JSON's ``json.loads`` of bytes lets encoded lone surrogates through (``surrogatepass``) and
    takes UTF-16 bodies, whose escapes the surrogate check did not see: each was a 500."""
    surrogate = "\ud800".encode("utf-8", "surrogatepass")  # b"\xed\xa0\x80"
    bodies = {
        "/v1/completions": [
            b'{"prompt": "hi ' + surrogate + b' there", "max_tokens": 2}',
            b'{"prompt": "x", "max_tokens": 2, "vllm_xargs": {"a": "' + surrogate + b'"}}',
            '{"prompt": "hi \\ud800", "max_tokens": 2}'.encode("utf-16"),
        ],
        "/v1/chat/completions": [b'{"messages": [{"role": "user", "content": "a' + surrogate + b'"}], "max_tokens": 2}'],
    }

    async def body(app: App, client: httpx.AsyncClient) -> None:
        with mock.patch.object(app.service, "_session", side_effect=AssertionError("an engine was asked")):
            for path, raws in bodies.items():
                for raw in raws:
                    assert_openai_error(await client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        # A BOM before UTF-8 JSON is still read (RFC 8259 lets a parser ignore it), and the
        # server answers a wrong method as a client's error, not an internal one.
        ok = await client.post("/v1/completions", content=b"\xef\xbb\xbf" + json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode())
        assert ok.status_code == 200, ok.text
        assert assert_openai_error(await client.get("/v1/completions"), 405)["type"] == "invalid_request_error"

    run(body, tiny_tokenizer)


def test_pd_engines_shows_addresses_to_the_operator_only(tiny_tokenizer):
    private = {"kv_endpoint", "call_endpoint", "extra", "kv_capacity_tokens"}

    async def body(app: App, client: httpx.AsyncClient) -> None:
        full = (await app.service.engine_snapshot())["engines"]["decode-0"]
        assert private <= full.keys()  # the handle API (inside the cluster) keeps the whole view
        anyone = (await client.get("/pd/engines")).json()["engines"]["decode-0"]
        wrong = (await client.get("/pd/engines", headers={"Authorization": "Bearer nope"})).json()["engines"]["decode-0"]
        for view in (anyone, wrong):
            assert not private & view.keys() and view["role"] == "decode" and "healthy" in view
        operator = await client.get("/pd/engines", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
        assert private <= operator.json()["engines"]["decode-0"].keys()

    run(body, tiny_tokenizer, operator_token=OPERATOR_TOKEN)


# ---------------------------------------------------------------------------- on a real socket
async def _hello(request: Request) -> JSONResponse:
    await asyncio.sleep(float(request.query_params.get("hold", "0")))
    return JSONResponse({"ok": True})


def _server(**limits: Any) -> InReplicaServer:
    app = Starlette(routes=[Route("/", _hello)])
    return InReplicaServer(app, listening_socket("127.0.0.1", 0), **limits)


def _closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:  # closed while the client was still sending
        return True
    except TimeoutError:
        return False


def test_a_half_sent_header_is_closed_at_the_deadline_and_whole_requests_are_served():
    async def main() -> None:
        server = _server(header_timeout_s=0.3)
        port = server.address[1]
        try:
            idle = socket.create_connection(("127.0.0.1", port))
            half = socket.create_connection(("127.0.0.1", port))
            half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            closed = await asyncio.gather(*(asyncio.to_thread(_closed_by_server, s, 10) for s in (idle, half)))
            assert closed == [True, True]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(3):  # kept alive past the deadline: it applies to a header only
                    assert (await client.get("/")).json() == {"ok": True}
                    await asyncio.sleep(0.4)
            for sock in (idle, half):
                sock.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_header_without_end_is_refused_at_the_size_bound_not_held_whole():
    """httptools keeps a URL or header value of any size until the header ends; the protocol
    counts a header's bytes and answers 431 past the bound, then closes."""

    async def main() -> None:
        server = _server(max_header_bytes=8192)
        port = server.address[1]

        def send_huge_url() -> bytes:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.settimeout(10)
                try:
                    sock.sendall(b"GET /" + b"a" * (4 << 20))  # the request line never ends
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return sock.recv(1024)

        try:
            assert (await asyncio.to_thread(send_huge_url)).startswith(b"HTTP/1.1 431")
            assert all(len(p.url) <= 8192 + (1 << 20) for p in server._server.server_state.connections)
            fresh = httpx.Limits(max_keepalive_connections=0)  # a header counts from its connection's or request's first read
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=fresh) as client:
                assert (await client.get("/", headers={"x-pad": "p" * 4000})).json() == {"ok": True}
                assert (await client.get("/", headers={"x-pad": "p" * 9000})).status_code == 431
        finally:
            await server.stop()

    asyncio.run(main())


def test_the_header_deadline_holds_on_h11_too():
    """Where httptools is not installed uvicorn runs h11, which has no parser callbacks: the
    deadline follows h11's own state instead."""

    async def main() -> None:
        server = _server(header_timeout_s=0.3, http="h11")
        port = server.address[1]
        try:
            half = socket.create_connection(("127.0.0.1", port))
            half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            assert await asyncio.to_thread(_closed_by_server, half, 10)
            half.close()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(2):  # a whole request, kept alive past the deadline, still served
                    assert (await client.get("/")).json() == {"ok": True}
                    await asyncio.sleep(0.4)
        finally:
            await server.stop()

    asyncio.run(main())


def test_connections_beyond_the_limit_get_a_503():
    async def main() -> None:
        server = _server(max_connections=3)  # uvicorn refuses when connections reach the limit: two served
        port = server.address[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=httpx.Limits(max_keepalive_connections=0)) as c:
                held = [asyncio.create_task(c.get("/", params={"hold": "1"})) for _ in range(2)]
                await asyncio.sleep(0.3)
                refused = await c.get("/")
                assert_openai_error(refused, 503)  # not uvicorn's plain text
                assert refused.headers["connection"] == "close"
                assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
                assert (await c.get("/")).status_code == 200
        finally:
            await server.stop()

    asyncio.run(main())


def test_idle_and_slow_connections_leave_real_requests_served(tiny_tokenizer):
    """32 connections that send nothing and 32 that trickle a header byte by byte, against the
    router's own server (the in-process app behind it): real requests are served meanwhile and
    the strangers are closed at the header deadline."""
    from serve_app.router.direct_http import serve_openai

    async def main() -> None:
        args = app_args(http={"host": "127.0.0.1", "port": 1, "header_timeout_s": 1.0})
        app = await App.start(args, tiny_tokenizer)
        server = serve_openai(app.service, "127.0.0.1", 0)
        port = server.address[1]
        stop = asyncio.Event()
        try:
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
            slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]

            async def trickle() -> None:
                header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                for i in range(len(header)):
                    if stop.is_set():
                        return
                    for sock in slow:
                        try:
                            sock.send(header[i : i + 1])
                        except OSError:
                            pass
                    await asyncio.sleep(0.2)

            trickling = asyncio.create_task(trickle())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for _ in range(5):
                    response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
                    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
            closed = await asyncio.gather(*(asyncio.to_thread(_closed_by_server, s, 10) for s in idle + slow))
            assert all(closed), f"{closed.count(False)} strangers still connected"
            stop.set()
            await trickling
            for sock in idle + slow:
                sock.close()
            await app.idle()
        finally:
            stop.set()
            await server.stop()
            await app.stop()

    asyncio.run(main())


def test_a_kept_alive_client_connection_stays_open_for_keep_alive_s_then_closes(tiny_tokenizer):
    """router.http.keep_alive_s: idle between requests, a client's connection stays open (so the
    client, whose own idle timeout is shorter, closes it first), and closes once past it."""
    from serve_app.router.direct_http import serve_openai

    async def main() -> None:
        app = await App.start(app_args(http={"host": "127.0.0.1", "port": 1, "keep_alive_s": 1.5}), tiny_tokenizer)
        server = serve_openai(app.service, "127.0.0.1", 0)
        try:
            sock = socket.create_connection(("127.0.0.1", server.address[1]))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200 OK" in await asyncio.to_thread(sock.recv, 4096)
            assert not await asyncio.to_thread(_closed_by_server, sock, 0.75)  # idle, still open
            assert await asyncio.to_thread(_closed_by_server, sock, 3.0)  # closed past keep_alive_s
            sock.close()
        finally:
            await server.stop()
            await app.stop()

    asyncio.run(main())


def test_paths_and_methods_no_route_serves_are_counted_like_other_refusals(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        assert_openai_error(await client.get("/v1/completions"), 405)
        assert_openai_error(await client.post("/v1/nothing-here", json={}), 404)
        errors = app.service.metrics.errors.values
        assert errors[(("kind", "method_not_allowed"),)] == 1 and errors[(("kind", "not_found"),)] == 1, errors
        requests = app.service.metrics.requests.values
        assert requests[(("route", "other"), ("status", "405"))] == 1 and requests[(("route", "other"), ("status", "404"))] == 1

    run(body, tiny_tokenizer, recording_router_metrics())


def test_over_serves_proxy_too_paths_and_methods_no_route_serves_are_counted(tiny_tokenizer):
    """The Router deployment's own FastAPI app (router.http.port 0: Serve's proxy in front)."""
    from serve_app.router.deployment import http_app

    async def body(app: App, client: httpx.AsyncClient) -> None:
        http_app.state.service = app.service
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app), base_url="http://router") as proxy:
                assert_openai_error(await proxy.get("/v1/completions"), 405)
                assert_openai_error(await proxy.post("/v1/nothing-here", json={}), 404)
        finally:
            del http_app.state.service
        requests = app.service.metrics.requests.values
        assert requests[(("route", "other"), ("status", "405"))] == 1 and requests[(("route", "other"), ("status", "404"))] == 1

    run(body, tiny_tokenizer, recording_router_metrics())


def test_no_output_is_refused_but_for_a_completions_echo(tiny_tokenizer):
    """max_tokens 0 is a 400 (as on vLLM's server), but for a completion's echo of the prompt
    alone, which test_echo.py serves."""

    async def body(app: App, client: httpx.AsyncClient) -> None:
        with mock.patch.object(app.service, "_session", side_effect=AssertionError("an engine was asked")):
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "echo": True}
            assert_openai_error(await client.post("/v1/chat/completions", json=chat), 400, "max_tokens")
            completion = {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1}
            assert_openai_error(await client.post("/v1/completions", json=completion), 400, "max_tokens")

    run(body, tiny_tokenizer)


def test_what_a_trusted_template_renders_to_truncate_is_bounded_before_it_is_tokenized(tiny_tokenizer):
    """With truncate_prompt_tokens (or on /tokenize) a rendered prompt may be longer than the
    context: it was not bounded at all, and one string repeat of a client's template (which its
    time limit cannot interrupt) had the tokenizer spend seconds on millions of characters."""
    from serve_app.router.parsing import ModelContext, parse_request

    ctx = ModelContext(
        name="tiny", aliases=frozenset(), max_model_len=64, vocab_size=1024, tokenizer=tiny_tokenizer,
        trust_request_chat_template=True, max_body_bytes=4096,
    )  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    repeat = ctx.max_render_chars // 3 + 1
    with mock.patch.object(ctx, "encode", side_effect=AssertionError("tokenized")), pytest.raises(OpenAIError) as err:
        parse_request("chat", {"messages": messages, "chat_template": f"{{{{ 'ab ' * {repeat} }}}}", "truncate_prompt_tokens": 8}, ctx)
    assert err.value.status == 400 and err.value.param == "messages" and "tokenizes at most" in str(err.value)
    # Within the bound, longer than the context: truncated as asked.
    fits = ctx.max_prompt_chars // 3 + 10
    parsed = parse_request("chat", {"messages": messages, "chat_template": f"{{{{ 'ab ' * {fits} }}}}", "truncate_prompt_tokens": 8}, ctx)
    assert len(parsed.prompt_token_ids) == 8
