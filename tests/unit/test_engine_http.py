"""Router-engine calls over the engines' own HTTP endpoints (``router.engine_transport: http``):
the wire format, the endpoint's refusals, and the whole app in this process (mock engines, real
loopback HTTP between the router's client and each replica's endpoint), with the checks of
test_orchestration: tokens exact, and nothing held anywhere after each test. The tests the two
transports share are in test_orchestration.py (the ``transport`` fixture); these are HTTP's own."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from serve_app.engines.call_server import GENERATE_PATH, RUN_PATH
from serve_app.router.cdcp import engine_gone
from serve_app.router.engine_client import EngineCallFailed, EngineUnreachable
from serve_app.wire.frames import CallError, FrameReader, WireError, decode_request, encode_frame, encode_request
from serve_app.wire.protocol import EngineRejected, EngineRequest, KVReady, PrefillResult, TokenDelta, TokenLogprob
from tests.support.inprocess import PROMPT, App, args, completion, expected, leased, run, tokens_of, wait_until
from tests.support.local_http import serving

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def http_args(**changes):
    out = args(**changes)
    out["router"] = {**out["router"], "engine_transport": "http"}
    return out


# ---------------------------------------------------------------------------- the wire
MESSAGES = [
    KVReady({"remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 36000, "do_remote_prefill": True}),
    TokenDelta([5, 6], [TokenLogprob(5, -0.1, ((5, -0.1), (7, -2.5)))], None, None, 8),
    TokenDelta([9], finish_reason="stop", stop_reason="recomputed"),
    TokenDelta([9], finish_reason="stop", stop_reason=13),
    EngineRejected("token id 5000 is out of vocabulary"),
    PrefillResult("a-1", 8, "length", {"outcome": "done", "bytes_pushed": 4096, "first_layer_sent_at": 1.5}),
    CallError("PrefillFailed: the push broke"),
]


def test_every_message_survives_the_wire_whatever_the_reads():
    data = b"".join(encode_frame(m) for m in MESSAGES)
    for size in (1, 3, 7, 64, len(data)):
        reader = FrameReader()
        got = [m for i in range(0, len(data), size) for m in reader.feed(data[i : i + size])]
        assert got == MESSAGES and reader.pending == 0, size
    request = EngineRequest("a-1", [1, 2, 3], b"\x81\xa1x\x01", {"do_remote_prefill": True, "request_id": "a-1"})
    assert decode_request(encode_request(request)) == request


def test_bytes_that_are_not_our_messages_are_refused():
    with pytest.raises(WireError):
        decode_request(b"\x93not a request")
    with pytest.raises(WireError):
        FrameReader().feed((1 << 30).to_bytes(4, "big"))  # a length no frame of ours has
    with pytest.raises(WireError):
        FrameReader().feed(b"\x00\x00\x00\x03abc")
    cut = encode_frame(MESSAGES[1])[:-2]
    reader = FrameReader()
    assert reader.feed(cut) == [] and reader.pending == len(cut)


# ---------------------------------------------------------------------------- the endpoint
def test_the_endpoint_takes_calls_only_with_its_token(tiny_tokenizer):
    async def body(app: App) -> None:
        decode = app.engines["decode-0"]
        endpoint = decode.call_server.endpoint
        request = encode_request(EngineRequest("x-1", PROMPT, b"", None))
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": endpoint.token}):
                async with session.post(endpoint.url + GENERATE_PATH, data=request, headers=headers) as response:
                    assert response.status == 401
                    # and the connection is not kept for a stranger (it would hold a slot of
                    # the server's limit_concurrency)
                    assert response.headers.get("Connection", "").lower() == "close"
            good = {"Authorization": f"Bearer {endpoint.token}"}
            async with session.post(endpoint.url + GENERATE_PATH, data=b"\x00garbage", headers=good) as response:
                assert response.status == 400
            async with session.post(endpoint.url + RUN_PATH, data=request, headers=good) as response:
                assert response.status == 404  # a decode replica takes no prefill calls
            async with session.get(endpoint.url + GENERATE_PATH, headers=good) as response:
                assert response.status == 404
        assert len(decode.runner.requests) == 0  # nothing reached the engine
        # Each replica has its own token, and the stats the router polls carry it.
        tokens = {e.call_server.endpoint.token for e in app.engines.values()}
        assert len(tokens) == len(app.engines)
        assert (await decode.stats()).call_endpoint == endpoint

    run(body, http_args(), tiny_tokenizer)


def test_a_stream_ends_when_its_client_leaves_even_if_the_cancellation_is_lost():
    """Engine code may swallow the cancellation that tells a stream its client left (Python
    3.11's ``asyncio.wait_for`` drops one that meets a result); the endpoint still closes the
    stream, which is what aborts the engine's request."""
    from serve_app.engines.call_server import EngineCallServer

    class Deaf:
        def __init__(self) -> None:
            self.closed = asyncio.Event()
            self.ran_out = False

        async def generate(self, request):
            try:
                for i in range(600):  # 3 s: a failing run ends soon after its check
                    try:
                        await asyncio.sleep(0.005)
                    except asyncio.CancelledError:
                        pass  # lost
                    yield TokenDelta([i])
                self.ran_out = True  # ended by itself: nobody closed it
            finally:
                self.closed.set()

    async def main() -> None:
        replica = Deaf()
        server = EngineCallServer("127.0.0.1", replica)
        try:
            headers = {"Authorization": f"Bearer {server.token}"}
            async with aiohttp.ClientSession() as session:
                response = await session.post(
                    server.endpoint.url + GENERATE_PATH, data=encode_request(EngineRequest("d-1", [1], b"")), headers=headers
                )
                assert response.status == 200
                assert await response.content.readany()  # it streams
                response.close()  # the client leaves
            await asyncio.wait_for(replica.closed.wait(), 2)
            assert not replica.ran_out
        finally:
            await server.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------------- the app over HTTP
def test_concurrent_streams_share_kept_alive_connections(tiny_tokenizer):
    async def body(app: App) -> None:
        prompts = [[30 + i] * 9 for i in range(12)]
        results = await asyncio.gather(*(completion(app, p, max_tokens=20, stream=bool(i % 2)) for i, p in enumerate(prompts)))
        for i, (status, data) in enumerate(results):
            assert status == 200
            assert (tokens_of(data) if i % 2 else data["choices"][0]["token_ids"]) == expected(prompts[i], 20)
        await asyncio.sleep(0.1)  # finished streams hand their connections back
        connector = app.service.pool.client._http().connector
        kept = sum(len(c) for c in connector._conns.values())
        assert 1 <= kept <= 12  # kept for reuse, at most one per stream in flight at once

    # Colocated: streams only; a finished one hands its connection back once its body has ended.
    run(body, http_args(router={"mode": "colocated"}), tiny_tokenizer)


def kill(call_server) -> None:
    """What a replica's death does to its endpoint: every connection cut, no new one taken.
    (uvicorn's own shutdown would let a streaming response finish first.)"""
    server = call_server._server._server
    for connection in list(server.server_state.connections):
        connection.transport.abort()
    call_server.close()


def test_a_decode_endpoint_that_is_gone_is_skipped_and_the_other_serves(tiny_tokenizer):
    async def body(app: App) -> None:
        kill(app.engines["decode-0"].call_server)  # the replica's process is gone
        await asyncio.sleep(0.2)
        for i in range(4):
            status, data = await completion(app, [40 + i] * 8, max_tokens=6)
            assert status == 200 and data["choices"][0]["token_ids"] == expected([40 + i] * 8, 6)
        assert len(app.engines["decode-0"].runner.requests) == 0
        assert len(app.engines["decode-1"].runner.requests) >= 4

    run(body, http_args(), tiny_tokenizer)


def test_a_decode_stream_cut_mid_way_is_resumed_token_exact(tiny_tokenizer):
    """The replica's connection breaks after some tokens (its process died): the attempt fails
    as the engine's loss, and the next attempt resumes the response where it stopped."""

    async def body(app: App) -> None:
        server = app.engines["decode-0"].call_server
        broken = []

        async def cut_after_some_tokens() -> None:
            await wait_until(lambda: len(app.engines["decode-0"].runner.requests) > 0 and leased(app, "decode"))
            await asyncio.sleep(0.02)
            broken.append(True)
            kill(server)

        cutter = asyncio.ensure_future(cut_after_some_tokens())
        app.service.pool.loads["decode-1"].healthy = False  # decode-0 first
        status, events = await completion(app, PROMPT, max_tokens=300, stream=True)
        await cutter
        app.service.pool.loads["decode-1"].healthy = True
        assert broken
        assert status == 200 and tokens_of(events) == expected(PROMPT, 300)
        cut = [r["output_tokens"] for r in app.engines["decode-0"].runner.requests.values()]
        assert len(cut) == 1 and 0 < cut[0] < 300, cut  # cut mid-way, the rest decoded elsewhere

    run(body, http_args(router={"max_attempts": 4}), tiny_tokenizer)


def test_transport_errors_name_the_engine_as_gone_only_when_it_is():
    assert engine_gone(EngineUnreachable("connection refused"))
    assert not engine_gone(EngineCallFailed("RuntimeError: prefill exploded"))


def test_the_router_closes_idle_connections_before_the_engine_does():
    from serve_app.engines.call_server import SERVER_KEEP_ALIVE_S
    from serve_app.router.engine_client import CLIENT_KEEP_ALIVE_S

    assert CLIENT_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S


def test_a_call_with_a_stale_token_reads_as_the_engine_gone(tiny_tokenizer):
    """Another replica at the address the router knew (ours restarted on the same port): the
    attempt fails as that engine's loss and resumes on the other, and the stats refresh names
    the new endpoint."""
    import dataclasses

    async def body(app: App) -> None:
        pool = app.service.pool
        stale = pool.reported["decode-0"]
        pool.reported["decode-0"] = dataclasses.replace(
            stale, call_endpoint=dataclasses.replace(stale.call_endpoint, token="an-older-replicas-token")
        )
        pool.loads["decode-1"].healthy = False  # decode-0 first
        status, data = await completion(app, PROMPT, max_tokens=6)
        assert status == 200 and data["choices"][0]["token_ids"] == expected(PROMPT, 6)
        assert len(app.engines["decode-0"].runner.requests) == 0  # refused before the engine
        assert len(app.engines["decode-1"].runner.requests) == 1
        assert pool.reported["decode-0"].call_endpoint == app.engines["decode-0"].call_server.endpoint

    run(body, http_args(), tiny_tokenizer)


# ---------------------------------------------------------------------------- no secrets, no tracebacks
def test_a_body_nested_too_deep_is_a_400_without_a_traceback(caplog):
    """msgspec answers a body nested past its depth (the sampling and KV parameters are open
    maps) with a RecursionError, not a DecodeError: the endpoint refused the call with a logged
    traceback and a 500, one per call. It is a bad body like any other."""
    import logging

    from serve_app.engines.call_server import EngineCallServer

    class Idle:
        async def generate(self, request):
            yield TokenDelta([1], finish_reason="stop")

    body = encode_request(EngineRequest("n-1", [1], b"", None))
    # kv_transfer_params (None, before the fields that follow it) replaced by 10,000 nested
    # one-key maps (msgspec stops near 1,000).
    last = b"\xaacache_salt\xc0\xa8priority\x00\xafreasoning_ended\xc0\xb7reasoning_parser_kwargs\xc0"
    assert body.endswith(b"\xc0" + last)
    deep = body[: -len(last) - 1] + b"\x81\xa1a" * 10_000 + b"\x01" + last

    async def main() -> None:
        server = EngineCallServer("127.0.0.1", Idle())
        try:
            headers = {"Authorization": f"Bearer {server.token}"}
            async with aiohttp.ClientSession() as session:
                async with session.post(server.endpoint.url + GENERATE_PATH, data=deep, headers=headers) as response:
                    assert response.status == 400, response.status
                    assert "nested too deep" in await response.text()
                # The same endpoint still serves a good call.
                async with session.post(server.endpoint.url + GENERATE_PATH, data=body, headers=headers) as response:
                    assert response.status == 200 and await response.read()
        finally:
            await server.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_a_websocket_upgrade_is_refused_without_an_error_log(caplog):
    """uvicorn hands an Upgrade: websocket request to the app as a websocket; returning without
    closing it had uvicorn log an ERROR per request, from anyone who reaches the port."""
    import logging
    import socket

    from serve_app.engines.call_server import EngineCallServer

    def upgrade(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"GET /generate HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            return sock.recv(4096)

    async def main() -> None:
        server = EngineCallServer("127.0.0.1", object())
        try:
            answer = await asyncio.to_thread(upgrade, int(server.endpoint.url.rsplit(":", 1)[1]))
            assert answer.startswith(b"HTTP/1.1 403"), answer[:64]
        finally:
            await server.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_an_unreachable_engine_is_described_without_its_address_or_token():
    """A real refused connection: aiohttp's error text names the host and port, the OS error's
    text the address again; the engine client's error keeps the class and the errno's name."""
    from serve_app.router.engine_client import EngineClient
    from serve_app.runtime.ports import free_port
    from serve_app.wire.protocol import EngineCallEndpoint

    port = free_port()  # nothing listens there
    endpoint = EngineCallEndpoint(url=f"http://127.0.0.1:{port}", token="a-secret-token")

    async def main() -> str:
        client = EngineClient()
        try:
            with pytest.raises(EngineUnreachable) as caught:
                await anext(client.stream(endpoint, EngineRequest("u-1", [1], b"")))
            return str(caught.value)
        finally:
            await client.close()

    text = asyncio.run(main())
    assert "ClientConnectorError" in text and "ECONNREFUSED" in text, text
    for leak in (str(port), "127.0.0.1", "a-secret-token"):
        assert leak not in text, (leak, text)


def test_an_answer_nested_too_deep_fails_the_call_not_the_router():
    """A frame nested past msgspec's depth from an engine's endpoint is a broken answer
    (EngineCallFailed, the attempt retried elsewhere), not a RecursionError out of the client."""
    from aiohttp import web

    from serve_app.router.engine_client import EngineClient
    from serve_app.wire.frames import LENGTH_BYTES
    from serve_app.wire.protocol import EngineCallEndpoint

    payload = b"\x92\xa2kv\x81\xa6params" + b"\x81\xa1a" * 100_000 + b"\x01"  # ("kv", KVReady(params={"a": {"a": ...}}))
    frame = len(payload).to_bytes(LENGTH_BYTES, "big") + payload

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=frame)

    async def main() -> str:
        async with serving(GENERATE_PATH, answer) as port:
            client = EngineClient()
            try:
                endpoint = EngineCallEndpoint(url=f"http://127.0.0.1:{port}", token="t")
                with pytest.raises(EngineCallFailed) as caught:
                    await anext(client.stream(endpoint, EngineRequest("r-1", [1], b"")))
                return str(caught.value)
            finally:
                await client.close()

    assert "nested too deep" in asyncio.run(main())


def test_an_error_answer_whose_body_never_ends_fails_the_call_at_once():
    """Whatever answers at a gone replica's address (another process may have its port) need not
    end its error body: the call read it whole, and so waited for its phase's deadline."""
    from aiohttp import web

    from serve_app.router.engine_client import EngineClient
    from serve_app.wire.protocol import EngineCallEndpoint

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=500)
        await response.prepare(request)
        await response.write(b"the engine broke")
        while True:  # never ends
            await asyncio.sleep(0.05)
            await response.write(b" and on")

    async def main() -> str:
        async with serving(GENERATE_PATH, answer) as port:
            client = EngineClient()
            try:
                endpoint = EngineCallEndpoint(url=f"http://127.0.0.1:{port}", token="t")
                started = time.monotonic()
                with pytest.raises(EngineCallFailed) as caught:
                    await asyncio.wait_for(anext(client.stream(endpoint, EngineRequest("r-1", [1], b""))), 10)
                # Its body read for DRAIN_TIMEOUT_S (1 s) at most, not until the phase's deadline.
                assert time.monotonic() - started < 5
                return str(caught.value)
            finally:
                await client.close()

    assert "answered 500: the engine broke" in asyncio.run(main())


def test_a_prefill_result_that_cannot_be_sent_is_an_error_the_router_reads():
    """The 200 went out before the result was encoded: a result msgpack cannot carry left the
    answer cut short, which the router reads as an unreachable engine, and the cause was lost."""
    from serve_app.engines.call_server import EngineCallServer

    class Unsendable:
        async def run(self, request):
            return PrefillResult(request.request_id, 8, "length", {"outcome": object()})

    async def main() -> list:
        server = EngineCallServer("127.0.0.1", Unsendable())
        try:
            headers = {"Authorization": f"Bearer {server.token}"}
            async with aiohttp.ClientSession() as session:
                body = encode_request(EngineRequest("p-1", [1, 2], b""))
                async with session.post(server.endpoint.url + RUN_PATH, data=body, headers=headers) as response:
                    return FrameReader().feed(await response.read())
        finally:
            await server.stop()

    (message,) = asyncio.run(main())
    assert isinstance(message, CallError) and "object" in message.message


def test_a_long_prompt_is_called_on_a_fresh_connection():
    """A call whose body is larger than a request header may be (64 KiB) on a connection's first
    request: aiohttp sends the header and the body in one write, so the server's first read holds
    both. The header bound must count the header, not the body read with it (a 431 here made
    every prompt of some 20,000 tokens fail on the http transport before cac22c3)."""
    from serve_app.engines.call_server import EngineCallServer

    class Echo:
        async def generate(self, request):
            yield TokenDelta([len(request.prompt_token_ids)], finish_reason="stop")

    prompt = [1000 + i % 20000 for i in range(40_000)]  # 3 bytes an id: a body of about 120 KB

    async def main() -> None:
        server = EngineCallServer("127.0.0.1", Echo())
        try:
            body = encode_request(EngineRequest("long-1", prompt, b""))
            assert len(body) > 100_000
            headers = {"Authorization": f"Bearer {server.token}"}
            async with aiohttp.ClientSession() as session:  # a fresh connection
                async with session.post(server.endpoint.url + GENERATE_PATH, data=body, headers=headers) as response:
                    assert response.status == 200, response.status
                    assert FrameReader().feed(await response.read()) == [TokenDelta([len(prompt)], finish_reason="stop")]
        finally:
            await server.stop()

    asyncio.run(main())
