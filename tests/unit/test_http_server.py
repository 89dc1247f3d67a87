"""The in-replica uvicorn server (router's OpenAI API, engines' call endpoints, metaserver relay)."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.http_server import InReplicaServer, listening_socket


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse(await request.json())


async def _accepted_nodelay() -> list[int]:
    server = InReplicaServer(Starlette(routes=[Route("/", _echo, methods=["POST"])]), listening_socket("127.0.0.1", 0))
    port = server.address[1]

    posted, inspected = threading.Event(), threading.Event()

    def post_twice() -> list[bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            bodies = []
            for i in range(2):  # the second one reuses the kept-alive connection
                conn.request("POST", "/", body=b'{"n": %d}' % i, headers={"content-type": "application/json"})
                bodies.append(conn.getresponse().read())
            posted.set()
            inspected.wait(10)  # keep the connection open until the server side was looked at
            return bodies
        finally:
            conn.close()

    try:
        task = asyncio.create_task(asyncio.to_thread(post_twice))
        while not posted.is_set() and not task.done():
            await asyncio.sleep(0.01)
        flags = [
            p.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for p in server._server.server_state.connections
        ]
        inspected.set()
        assert await task == [b'{"n":0}', b'{"n":1}']
        return flags
    finally:
        await server.stop()


def test_accepted_connections_send_small_writes_at_once_on_asyncios_own_loop():
    """asyncio's loop (not uvloop, which Ray's workers run unless RAY_USE_UVLOOP=0) sets
    TCP_NODELAY only on sockets made with the TCP protocol number; without it a kept-alive
    response written in two parts waits out the client's delayed acknowledgement."""
    loop = asyncio.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
        flags = loop.run_until_complete(_accepted_nodelay())
    finally:
        loop.close()
    assert flags and all(flags)


def test_accepted_connections_send_small_writes_at_once_on_uvloop():
    """Ray's workers run uvloop, the loop the app's servers run on: it must set it too."""
    uvloop = pytest.importorskip("uvloop")
    flags = uvloop.run(_accepted_nodelay())
    assert flags and all(flags)
