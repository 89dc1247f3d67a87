"""The in-replica uvicorn server (router's OpenAI API, engines' call endpoints, metaserver relay)."""

from __future__ import annotations

import asyncio
import http.client
import socket
import sys
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


# ---------------------------------------------------------------------------- stopping
async def _hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def _run_on(loop_kind: str, main):
    if loop_kind == "uvloop":
        return pytest.importorskip("uvloop").run(main())
    return asyncio.run(main())


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="SO_REUSEPORT")
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_listener_that_shares_its_port_stops_without_resetting_a_new_connection(loop_kind):
    """Router replicas share router.http's port (SO_REUSEPORT) and a redeploy stops the old ones
    while their replacements serve. Closing a listener resets the connections the kernel queued
    on it, its share of the port's new connections: a stopping one first leaves new connections
    to the others and accepts what was queued. Clients connecting all along see no error."""

    async def main() -> tuple[int, list[str]]:
        app = Starlette(routes=[Route("/", _hello)])
        first = listening_socket("127.0.0.1", 0, reuse_port=True)
        port = first.getsockname()[1]
        servers = [InReplicaServer(app, first)]
        stop, errors, answered = threading.Event(), [], [0]

        def client() -> None:
            while not stop.is_set():
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    conn.request("GET", "/")
                    response = conn.getresponse()
                    assert response.read() == b'{"ok":true}'
                    answered[0] += 1
                except Exception as exc:
                    errors.append(repr(exc))
                finally:
                    conn.close()

        clients = [asyncio.create_task(asyncio.to_thread(client)) for _ in range(6)]
        try:
            for _ in range(3):  # a replacement starts, then the replica it replaces stops
                servers.append(InReplicaServer(app, listening_socket("127.0.0.1", port, reuse_port=True)))
                await asyncio.sleep(0.3)
                await servers.pop(0).stop()
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            await asyncio.gather(*clients)
            await servers[0].stop()
        return answered[0], errors

    answered, errors = _run_on(loop_kind, main)
    assert answered and not errors, errors


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")
def test_a_listener_that_drops_new_connections_keeps_serving_the_ones_under_way():
    from serve_app.runtime.http_server import drop_new_connections, queued_connections

    with listening_socket("127.0.0.1", 0) as listener:
        address = listener.getsockname()
        with socket.create_connection(address, timeout=5) as before:
            assert queued_connections(listener)
            assert drop_new_connections(listener)
            with pytest.raises(TimeoutError):  # its SYN is dropped: no answer, not refused
                socket.create_connection(address, timeout=0.3)
            accepted, _ = listener.accept()  # the connection queued before is still there
            with accepted:
                before.sendall(b"ping")
                assert accepted.recv(4) == b"ping"
                accepted.sendall(b"pong")
                assert before.recv(4) == b"pong"
            assert not queued_connections(listener)


@pytest.mark.parametrize("implementation", ["httptools", "h11"])
def test_a_stopping_server_answers_a_request_still_arriving_and_closes_idle_connections(implementation):
    """uvicorn's graceful shutdown closes every connection between responses, a new one whose
    request is on its way included: its client would see a reset. Here it gets its answer, then
    the connection closes; a kept-alive connection with nothing pending closes at once."""

    async def main() -> tuple[bytes, bytes]:
        server = InReplicaServer(Starlette(routes=[Route("/", _hello)]), listening_socket("127.0.0.1", 0), http=implementation)
        connections = server._server.server_state.connections
        idle = socket.create_connection(server.address, timeout=10)
        idle.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await asyncio.to_thread(idle.recv, 65536)
        assert b"200 OK" in first and b'{"ok":true}' in first
        arriving = socket.create_connection(server.address, timeout=10)
        while len(connections) < 2:  # both accepted
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(server.stop())
        while server.sock.fileno() != -1:  # uvicorn's shutdown has begun: connections were told
            await asyncio.sleep(0.01)
        arriving.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while chunk := await asyncio.to_thread(arriving.recv, 65536):  # until the server closes it
            answer += chunk
        idle_after = await asyncio.to_thread(idle.recv, 65536)
        await stopping
        idle.close()
        arriving.close()
        return answer, idle_after

    answer, idle_after = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"ok":true}')  # then closed
    assert idle_after == b""
