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

from serve_app.runtime.http_server import InReplicaServer, listening_socket


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


class _RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default=None):
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def test_writes_of_one_loop_iteration_leave_in_one_write_and_close_sends_them_first():
    from serve_app.runtime.http_server import CoalescingTransport

    async def scenario() -> _RecordingTransport:
        raw = _RecordingTransport()
        transport = CoalescingTransport(raw)  # type: ignore[arg-type]
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"")
        transport.write(memoryview(b"first"))
        assert raw.writes == [] and transport.get_write_buffer_size() == 24  # held for this iteration only
        await asyncio.sleep(0)
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nfirst"]
        transport.write(b"second")
        await asyncio.sleep(0)
        transport.writelines([b"last", b"0\r\n\r\n"])
        transport.close()  # uvicorn closes right after a response's last write when not kept alive
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nfirst", b"second", b"last0\r\n\r\n"] and raw.closed
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's
        transport2 = CoalescingTransport(raw)  # type: ignore[arg-type]
        transport2.write(b"never")
        transport2.abort()
        await asyncio.sleep(0)
        assert raw.aborted and raw.writes[-1] == b"last0\r\n\r\n"
        return raw

    asyncio.run(scenario())


def test_a_stream_through_the_server_arrives_whole_on_a_kept_alive_connection():
    from starlette.responses import StreamingResponse

    async def stream(request: Request) -> StreamingResponse:
        async def parts():
            yield b"one,"
            yield b"two,"
            await asyncio.sleep(0.01)
            yield b"three"

        return StreamingResponse(parts(), media_type="text/plain")

    async def scenario() -> list[bytes]:
        server = InReplicaServer(Starlette(routes=[Route("/", stream)]), listening_socket("127.0.0.1", 0))
        port = server.address[1]

        def get_twice() -> list[bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                bodies = []
                for _ in range(2):
                    conn.request("GET", "/")
                    bodies.append(conn.getresponse().read())
                return bodies
            finally:
                conn.close()

        try:
            return await asyncio.to_thread(get_twice)
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == [b"one,two,three", b"one,two,three"]
