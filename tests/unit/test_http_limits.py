"""The in-replica server's header bounds never touch a request's body (a regression: the header
size bound counted the whole first read, so a body over 64 KiB sent with its header got a 431)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.runtime.http_server import InReplicaServer, listening_socket


def _post_in_one_write(port: int, size: int) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size
        sock.sendall(head + b"x" * size)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


async def _size(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_large_body_is_not_counted_as_header(http):
    async def main() -> None:
        app = Starlette(routes=[Route("/", _size, methods=["POST"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), max_header_bytes=4096, http=http)
        try:
            port = server.address[1]
            for size in (100, 70_000, 1_000_000):
                # Header and body in one send, so the server's first read holds both.
                status, body = await asyncio.to_thread(_post_in_one_write, port, size)
                assert status == 200 and body == b'{"size":%d}' % size
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                # The header bound itself still holds: a header over several reads is refused.
                try:
                    too_long = await client.post("/", headers={"x-long": "y" * 2_000_000}, content=b"x")
                    refused = too_long.status_code in (400, 431)
                except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                    refused = True  # answered and closed while the client was still sending
                assert refused
        finally:
            await server.stop()

    asyncio.run(main())


async def _not_found(request: Request) -> JSONResponse:
    return JSONResponse({"error": "no"}, status_code=404)  # answered without reading the body


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_body_trickled_after_an_early_answer_does_not_hold_the_connection(http):
    """A request answered before its body came (a 404 here; the router's 413 on Content-Length)
    whose body keeps coming a byte now and then: each byte stopped uvicorn's keep-alive timer,
    so the connection was held forever. The header deadline bounds it."""

    def trickle(port: int) -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc")
            assert b" 404 " in sock.recv(65536)
            started = time.monotonic()
            try:
                while time.monotonic() - started < 10:
                    sock.sendall(b"x")
                    time.sleep(0.1)
            except OSError:  # closed by the server
                pass
            return time.monotonic() - started

    async def main() -> None:
        app = Starlette(routes=[Route("/nope", _not_found, methods=["POST"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), header_timeout_s=0.5, keep_alive_s=1.0, http=http)
        try:
            held = await asyncio.to_thread(trickle, server.address[1])
            assert held < 5, f"the connection was held {held:.1f} s"
        finally:
            await server.stop()

    asyncio.run(main())


async def _ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_connections_that_send_nothing_cannot_fill_the_server(http, monkeypatch):
    """A stranger needs no token to open connections and send nothing: within the header
    deadline as many as ``max_connections`` made uvicorn answer every request 503, those on a
    caller's kept-alive connection too. Past half of it, the connections that waited longest
    for their header (longer than a burst's) are closed."""
    from serve_app.runtime import http_server

    monkeypatch.setattr(http_server, "PENDING_MIN_AGE_S", 0.2)

    async def main() -> None:
        app = Starlette(routes=[Route("/", _ok, methods=["GET"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), max_connections=16, http=http)
        port = server.address[1]
        strangers: list[socket.socket] = []
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                assert (await client.get("/")).status_code == 200  # a caller's kept-alive connection
                for _ in range(40):
                    strangers.append(socket.create_connection(("127.0.0.1", port)))
                await asyncio.sleep(1.0)  # older than a burst's, with room for a slow loop
                assert (await client.get("/")).status_code == 200  # on its kept-alive connection
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                assert (await client.get("/")).status_code == 200  # and on a new one
            open_strangers = 0
            for sock in strangers:
                sock.setblocking(False)
                try:
                    open_strangers += sock.recv(1) != b""
                except BlockingIOError:
                    open_strangers += 1  # nothing to read: still open
            assert open_strangers <= 8, open_strangers
        finally:
            for sock in strangers:
                sock.close()
            await server.stop()

    asyncio.run(main())
