"""No secret and no internal address reaches a client or a log line (issue 31, point 5).

The engine call's token travels in a header of every router-engine call; aiohttp's errors carry
the request's headers in their repr and the endpoint's URL in their text. A transport error that
ends a response (every attempt failed) used to reach the client whole, and every attempt's
failure was logged with it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any
from unittest import mock

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tests.support.inprocess import PROMPT, App, args, completion
from tests.support.log_capture import RecordList

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def http_args() -> dict[str, Any]:
    return args(router={"engine_transport": "http", "max_attempts": 2})


def leaky_error(url: str, token: str) -> aiohttp.ClientResponseError:
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {token}"}))
    info = aiohttp.RequestInfo(URL(url), "POST", headers, URL(url))
    return aiohttp.ClientResponseError(info, (), status=502, message=f"bad gateway at {url}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_transport_error_leaks_neither_the_token_nor_the_url(tiny_tokenizer, stream):
    logs = RecordList()
    router_log = logging.getLogger("pd_serve")
    router_log.addHandler(logs)

    async def main() -> None:
        app = await App.start(http_args(), tiny_tokenizer)
        try:
            endpoints = [e.call_server.endpoint for e in app.engines.values() if e.call_server is not None]
            assert endpoints and all(e.token for e in endpoints)
            token, url = endpoints[0].token, endpoints[0].url
            assert token in repr(leaky_error(url, token))  # what the old code put in its reason

            def failing_post(target: str, **kwargs: Any) -> Any:
                raise leaky_error(target, kwargs["headers"]["Authorization"].split()[-1])

            session = app.service.pool.client._http()
            with mock.patch.object(session, "post", failing_post):
                body = json.dumps({"prompt": [11, 12, 13], "max_tokens": 4, "stream": stream}).encode()
                response = await app.service.http("completions", body)
                if hasattr(response, "body_iterator"):
                    seen = "".join([chunk async for chunk in response.body_iterator])
                else:
                    seen = response.body.decode()
            assert "error" in seen and '"code":502' in seen.replace(" ", "")
            # Formatted as a log handler writes them, tracebacks included.
            lines = [logging.Formatter().format(r) for r in logs.records]
            failures = "\n".join(line for line in lines if "attempt" in line or "gave up" in line)
            assert "failed" in failures  # the failures were logged...
            for secret in [e.token for e in endpoints]:
                assert secret not in seen and secret not in "\n".join(lines)  # ... no token anywhere ...
            for address in [e.url for e in endpoints] + ["127.0.0.1:"]:
                # ... and no address in what the client saw or in the failures' lines (an engine's
                # start-up line names its endpoint for the operator, on purpose).
                assert address not in seen and address not in failures, address
            # The client reads the kind of failure, not which replica failed nor the transport's
            # exception; the log keeps both for the operator.
            assert "could not be reached" in seen and "ClientResponseError" not in seen, seen
            for name in app.engines:
                assert name not in seen, (name, seen)
            assert any(f"on {name}" in failures for name in app.engines) and "ClientResponseError" in failures, failures
            await app.idle()
        finally:
            await app.stop()

    try:
        asyncio.run(main())
    finally:
        router_log.removeHandler(logs)


def test_a_kv_ready_for_another_engine_names_no_kv_address_to_the_client(tiny_tokenizer):
    """The router refuses a KVReady whose KV host or port is not its decode engine's; why (both
    addresses) is the operator's to read in the log, not the client's."""
    logs = RecordList()
    router_log = logging.getLogger("pd_serve")
    router_log.addHandler(logs)

    async def main() -> None:
        app = await App.start(args(router={"max_attempts": 2}), tiny_tokenizer)
        try:
            for name, engine in app.engines.items():
                if name.startswith("decode"):
                    real = engine.runner.endpoint
                    engine.runner.endpoint = type(real)(engine_id=real.engine_id, host=real.host, port=54321)
            status, data = await completion(app, PROMPT)
            message = data["error"]["message"]
            assert status == 502 and "KVReady for another engine" in message, data
            assert "54321" not in message and "remote_port" not in message and "decode-" not in message, message
            lines = "\n".join(r.getMessage() for r in logs.records)
            assert "54321" in lines  # the operator still reads why
            await app.idle()
        finally:
            await app.stop()

    try:
        asyncio.run(main())
    finally:
        router_log.removeHandler(logs)


def test_the_metaserver_relay_refuses_hostile_bodies_in_one_line(caplog):
    """Whoever holds a waiting request's relay URL (the decode engine core) posts JSON; a body
    nested past Python's recursion limit, broken or not a mapping is a 400 with no traceback
    logged, and the request can still be answered."""
    from serve_app.engines.metaserver import MetaserverRelay

    async def main() -> None:
        relay = MetaserverRelay()
        await relay.start()
        try:
            future, url = relay.expect("req-1")
            async with aiohttp.ClientSession() as session:
                for body in (b"[" * 100_000, b"{" * 50_000, b'{"request_id": "\\ud800', b"[1, 2]", b"\xff\xfe"):
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                        assert response.status == 400, (body[:20], response.status)
                assert not future.done()
                async with session.post(url, json={"request_id": "req-1", "remote_port": 1}) as response:
                    assert response.status == 200
            assert (await future)["remote_port"] == 1
        finally:
            await relay.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_an_engine_exception_is_the_operators_not_the_clients(tiny_tokenizer):
    """An engine replica's exception crosses the call endpoint as text (its class and message:
    paths, addresses, whatever the engine's code put there). The client reads only that the
    decode engine's call failed; the router's log keeps the text, as one line (a line break in
    it cannot forge a log line of its own)."""
    logs = RecordList()
    router_log = logging.getLogger("pd_serve")
    router_log.addHandler(logs)
    secret_text = "state under /opt/engine-secret/cache"

    async def broken(request: Any) -> Any:
        raise RuntimeError(f"{secret_text}\nWARNING pd_serve forged line")
        yield  # an async generator, as the runner's generate is

    async def main() -> None:
        app = await App.start(http_args(), tiny_tokenizer)
        try:
            with contextlib.ExitStack() as patches:
                for name, engine in app.engines.items():
                    if name.startswith("decode"):
                        patches.enter_context(mock.patch.object(engine.runner, "generate", broken))
                body = json.dumps({"prompt": [11, 12, 13], "max_tokens": 4}).encode()
                response = await app.service.http("completions", body)
            data = json.loads(response.body)
            message = data["error"]["message"]
            assert response.status_code == 502 and "the decode engine's call failed" in message, data
            assert secret_text not in message and "RuntimeError" not in message and "forged" not in message, message
            failures = [r.getMessage() for r in logs.records if " failed on decode-" in r.getMessage()]
            assert failures and all(secret_text in line for line in failures), failures
            assert not any("\n" in r.getMessage() for r in logs.records), [r.getMessage() for r in logs.records]
            await app.idle()
        finally:
            await app.stop()

    try:
        asyncio.run(main())
    finally:
        router_log.removeHandler(logs)


def test_the_mock_engines_kv_port_refuses_hostile_lines_in_one_line(tiny_tokenizer, caplog):
    """The mock engine's KV side channel takes one JSON line per push from whoever connects. A
    line nested past Python's recursion limit, or longer than the reader's line limit, is refused
    ("no", or the connection closed) without a traceback in the log, and the engine still serves."""

    async def main() -> None:
        app = await App.start(args(), tiny_tokenizer)
        try:
            endpoint = next(e.runner.endpoint for name, e in app.engines.items() if name.startswith("decode"))
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
            writer.write(b"[" * 50_000 + b"\n")  # within the line limit, past the recursion limit
            assert await reader.readline() == b"no\n"
            writer.write(b'{"transfer": "t", "secret": "s"}\n')  # the connection still answers
            assert await reader.readline() == b"no\n"
            writer.write(b"[" * 200_000 + b"\n")  # past the line limit: the connection is closed
            try:
                rest = await reader.read()
            except ConnectionResetError:  # closed with the line's rest unread: a reset
                rest = b""
            assert rest == b""
            writer.close()
            status, data = await completion(app, PROMPT)
            assert status == 200, data
            await app.idle()
        finally:
            await app.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
