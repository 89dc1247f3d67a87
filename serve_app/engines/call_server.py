"""An engine replica's own HTTP endpoint for the router's calls (``router.engine_transport: http``).

Why: at a few concurrent requests the hand-off from router to decode engine to prefill engine
and back is Serve messages queueing in busy processes, and each Serve message crosses several
threads on both ends (Serve's gRPC transport: gRPC's I/O threads, its completion-queue poller,
the replica's event loop). Here a call is one HTTP/1.1 request on a kept-alive loopback
connection, read and written by the event loops themselves (uvicorn with httptools in the
replica, aiohttp in the router), which leaves every replica more CPU for its own work
(docs/performance.md, "What made the difference"). Serve still deploys, restarts, health-checks
and scales the replicas, and its handles still carry the stats polls, and the calls themselves
until the router has heard of this endpoint.

Two routes, one per call the router makes: ``POST /generate`` streams ``Decode.generate``'s
events, ``POST /run`` answers ``Prefill.run``. Bodies are wire/frames.py's frames. Each replica
makes its own random token at start and reports it, with the URL, in its replica metadata and
its stats (both over Serve, to the routers only); a request without it is refused before its
body is read, so nothing else on the host or network can make an engine run anything. The call
runs only while its client listens: a closed connection cancels it, and with it the engine's
request (its KV blocks), as a cancelled Serve call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from serve_app.runtime.http_server import InReplicaServer, listening_socket
from serve_app.wire.frames import CONTENT_TYPE, GENERATE_PATH, RUN_PATH, CallError, WireError, decode_request, encode_frame
from serve_app.wire.protocol import EngineCallEndpoint, EngineRequest, PrefillResult

logger = logging.getLogger("pd_serve.engine")

# An EngineRequest is a prompt's token ids and a few small fields: 32 MiB holds any context
# length a model has with room to spare, and bounds what an authorised but broken caller sends.
MAX_BODY_BYTES = 32 << 20
# An idle kept-alive connection is closed by the router's client first (after its own, shorter,
# keep-alive): a server that closed it first could do so just as the client sent a call on it,
# which the router would read as this engine lost.
SERVER_KEEP_ALIVE_S = 300.0


class EngineCallServer:
    """Serves ``replica.generate`` (a decode replica's) and ``replica.run`` (a prefill
    replica's), looked up at each call, on ``host`` (a free port)."""

    def __init__(self, host: str, replica: Any) -> None:
        self._replica = replica
        self.token = secrets.token_urlsafe(32)
        self._authorization = f"Bearer {self.token}".encode()
        # No write deadline: a router reads a stream as fast as its own client does, and bounds
        # its calls itself (its client's own server cuts off a client that stops reading).
        self._server = InReplicaServer(
            self, listening_socket(host, 0, backlog=1024), keep_alive_s=SERVER_KEEP_ALIVE_S, write_stall_s=None
        )
        bound_host, port = self._server.address[:2]
        self.endpoint = EngineCallEndpoint(url=f"http://{bound_host}:{port}", token=self.token)
        logger.info("engine call endpoint at %s", self.endpoint.url)

    @property
    def serving(self) -> bool:
        return self._server.serving

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            # Refused before any token check; returning without closing it would have uvicorn
            # log an error for every such request, whoever sends it.
            await send({"type": "websocket.close"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "POST" or scope["path"] not in (GENERATE_PATH, RUN_PATH):
            await _plain(send, 404, "no such engine call")
            return
        headers = dict(scope["headers"])
        if not secrets.compare_digest(headers.get(b"authorization", b""), self._authorization):
            await _plain(send, 401, "missing or wrong engine call token")
            return
        body = await _body(receive)
        if body is None:  # the client left before its request was whole
            return
        if body is _TOO_LARGE:
            await _plain(send, 413, f"body over {MAX_BODY_BYTES} bytes")
            return
        try:
            request = decode_request(body)
        except WireError as exc:
            await _plain(send, 400, str(exc))
            return
        except RecursionError:
            # msgspec's answer to a body nested past its depth (the sampling parameters and KV
            # parameters are open maps): a bad body like any other, not an error of this server
            # (uvicorn would log its traceback, one per such call).
            await _plain(send, 400, "not an engine request: nested too deep")
            return
        if scope["path"] == GENERATE_PATH and hasattr(self._replica, "generate"):
            await _while_connected(lambda gone: self._stream(request, send, gone), receive)
        elif scope["path"] == RUN_PATH and hasattr(self._replica, "run"):
            await _while_connected(lambda gone: self._call(request, send), receive)
        else:
            await _plain(send, 404, "this engine does not take that call")

    async def _stream(self, request: EngineRequest, send: Any, gone: asyncio.Event) -> None:
        await _start(send)
        try:
            async with aclosing(self._replica.generate(request)) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": encode_frame(event), "more_body": True})
                    if gone.is_set():
                        # The client left, and the cancellation that says so was lost on the way
                        # (an engine's code swallowed it): closing the stream still aborts.
                        return
        except Exception as exc:  # the router fails the attempt with this message, as with Serve
            await send({"type": "http.response.body", "body": encode_frame(_error(exc)), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _call(self, request: EngineRequest, send: Any) -> None:
        try:
            result: PrefillResult | CallError = await self._replica.run(request)
        except Exception as exc:
            result = _error(exc)
        try:  # before the 200 goes out: a result that cannot be sent is an error the router reads
            body = encode_frame(result)
        except Exception as exc:
            body = encode_frame(_error(exc))
        await _start(send)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def close(self) -> None:
        self._server.close()

    async def stop(self) -> None:
        await self._server.stop()


def _error(exc: BaseException) -> CallError:
    return CallError(f"{type(exc).__name__}: {exc}")


async def _while_connected(work: Callable[[asyncio.Event], Awaitable[None]], receive: Any) -> None:
    """Run ``work``; if the client goes away first, cancel it (and what it holds in the engine).
    ``work`` also gets the event that says the client is gone: a cancellation can be lost inside
    code it calls (Python 3.11's ``asyncio.wait_for`` drops one that meets a result), and
    uvicorn quietly drops what is sent to a closed connection, so a stream checks it itself."""
    gone = asyncio.Event()
    task = asyncio.ensure_future(work(gone))
    disconnect = asyncio.ensure_future(_disconnected(receive, gone))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (task, disconnect):
            future.cancel()
        for future in (task, disconnect):
            with contextlib.suppress(BaseException):
                await future
        if task.done() and not task.cancelled() and task.exception() is not None:
            # Its answer is cut short (the router sees the engine as unreachable): say why here.
            logger.warning("an engine call ended in an error: %s", _error(task.exception()).message)


async def _disconnected(receive: Any, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


_TOO_LARGE = b"<too large>"


async def _body(receive: Any) -> bytes | None:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _start(send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", CONTENT_TYPE.encode())]})


async def _plain(send: Any, status: int, message: str) -> None:
    """A refusal. One of a caller that is not the router (no token, a path no router calls) or
    whose body is left unread also closes the connection: a stranger cannot keep connections
    alive to fill the server's ``limit_concurrency``."""
    headers = [(b"content-type", b"text/plain")]
    if status in (401, 404, 413):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": message.encode(), "more_body": False})
