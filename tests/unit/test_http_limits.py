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
from starlette.responses import JSONResponse, StreamingResponse
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


def _against(handler, client, method: str = "POST", **limits) -> object:
    """``client(port)``, run in a thread against an httptools server of ``handler`` at ``/``
    with ``limits``; returns what it returned."""

    async def main() -> object:
        app = Starlette(routes=[Route("/", handler, methods=[method])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), http="httptools", **limits)
        try:
            return await asyncio.to_thread(client, server.address[1])
        finally:
            await server.stop()

    return asyncio.run(main())


async def _unauthorized(request: Request) -> JSONResponse:
    return JSONResponse({"error": "no key"}, status_code=401)  # answered without reading the body


@pytest.mark.parametrize("reads_body", [False, True])
def test_a_chunked_bodys_endless_trailers_are_cut_off_at_the_header_bound(reads_body):
    """httptools hands a chunked body's trailers to uvicorn as headers, which keeps them all in
    memory: a client needing no key (answered 401 at once) could send gigabytes of them within
    the header deadline, or until the body deadline where the app reads the body."""

    def send_trailers(port: int) -> int:
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n")
            line = b"X-Trailer: " + b"t" * 1000 + b"\r\n"
            try:
                while sent < 32 << 20:
                    sock.sendall(line * 64)
                    sent += len(line) * 64
            except (BrokenPipeError, ConnectionResetError):  # refused and closed (not a send timing out)
                pass
        return sent

    sent = _against(_size if reads_body else _unauthorized, send_trailers, max_header_bytes=64 * 1024)
    assert sent < 8 << 20, f"{sent} bytes of trailers taken in"


def test_a_chunked_body_of_many_small_chunks_and_a_short_trailer_is_served():
    async def main() -> None:
        app = Starlette(routes=[Route("/", _size, methods=["POST"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), max_header_bytes=4096, http="httptools")
        try:
            chunks = b"".join(b"1;ext=a\r\nx\r\n" for _ in range(20_000))  # framing 12x the data
            request = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"

            def post() -> bytes:
                with socket.create_connection(("127.0.0.1", server.address[1]), timeout=30) as sock:
                    sock.sendall(request + chunks + b"0\r\nX-Checksum: abc\r\n\r\n")
                    data = b""
                    while chunk := sock.recv(65536):
                        data += chunk
                return data

            reply = await asyncio.to_thread(post)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"size":20000}')
        finally:
            await server.stop()

    asyncio.run(main())


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_line_ends_between_kept_alive_requests_get_the_header_deadline():
    """httptools skips bare CRLFs between requests without beginning one, while each read stops
    uvicorn's keep-alive timer: a CRLF after a response held the connection forever."""

    async def main() -> None:
        app = Starlette(routes=[Route("/", _ok, methods=["GET"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), header_timeout_s=0.5, keep_alive_s=1.0, http="httptools")
        try:

            def crlf_after_a_response() -> bool:
                with socket.create_connection(("127.0.0.1", server.address[1]), timeout=10) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert b'{"ok":true}' in sock.recv(65536)
                    sock.sendall(b"\r\n")
                    return _closed_within(sock, 5.0)

            assert await asyncio.to_thread(crlf_after_a_response)
        finally:
            await server.stop()

    asyncio.run(main())


class _Endless:
    """A streamed response that never ends by itself; records whether its request ended."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    async def handle(self, request: Request) -> StreamingResponse:
        async def body():
            try:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0)
            finally:
                self.ended.set()

        return StreamingResponse(body())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_reads_nothing_is_cut_off_and_its_request_ends(http):
    """uvicorn waits for room to write without a bound: a client that stops reading held its
    request (its engine work, its load) and its connection for good."""

    async def main() -> None:
        endless = _Endless()
        app = Starlette(routes=[Route("/", endless.handle, methods=["GET"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), write_stall_s=0.5, http=http)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(server.address)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads
            await asyncio.wait_for(endless.ended.wait(), 20)
            for _ in range(200):
                if not server._server.server_state.connections:
                    break
                await asyncio.sleep(0.05)
            assert not server._server.server_state.connections
        finally:
            sock.close()
            await server.stop()

    asyncio.run(main())


def test_a_close_whose_data_the_client_never_reads_is_aborted():
    """A close waits for the transport's buffer to drain: with a client that reads nothing, for
    good (uvicorn closes a kept-alive connection this way, holding its place in the limit)."""
    from serve_app.runtime.http_server import CoalescingTransport

    class Stuck:
        aborted = False

        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 1000

        def close(self) -> None:
            pass

        def abort(self) -> None:
            self.aborted = True

    async def main() -> None:
        stuck = Stuck()
        CoalescingTransport(stuck, write_stall_s=0.1).close()
        await asyncio.sleep(0.5)
        assert stuck.aborted

    asyncio.run(main())


def test_a_client_gone_while_a_request_waits_behind_its_running_one_ends_the_running_one():
    """With a request pipelined behind a running one, uvicorn (httptools) tells only the waiting
    one that the client closed: the running one (a generation) went on to its end."""

    async def main() -> None:
        ended = asyncio.Event()

        async def slow(request: Request) -> StreamingResponse:
            async def body():
                try:
                    while True:
                        yield b"data: x\n\n"
                        await asyncio.sleep(0.05)
                finally:
                    ended.set()

            return StreamingResponse(body())

        app = Starlette(routes=[Route("/slow", slow, methods=["GET"]), Route("/", _ok, methods=["GET"])])
        server = InReplicaServer(app, listening_socket("127.0.0.1", 0), http="httptools")
        try:
            with socket.create_connection(server.address) as sock:
                sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await asyncio.to_thread(sock.recv, 1024)  # the stream is running
            await asyncio.wait_for(ended.wait(), 5)
        finally:
            await server.stop()

    asyncio.run(main())


def test_small_chunks_earn_no_credit_for_trailers():
    """Each chunk header is allowed some framing bytes: a run of tiny chunks left the unused
    allowance as credit, which later trailers then spent past the bound."""

    def tiny_chunks_then_trailers(port: int) -> int:
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(200):  # 200,000 chunks of one byte: 11 MB of unused allowance
                sock.sendall(b"1\r\nx\r\n" * 1000)
            sock.sendall(b"0\r\n")
            try:
                for _ in range(512):  # 8 MiB of trailers (more than the sockets' buffers), against a 64 KiB bound
                    sock.sendall(b"X-T: " + b"t" * (16 * 1024 - 7) + b"\r\n")
                    sent += 16 * 1024
            except (BrokenPipeError, ConnectionResetError):
                pass
        return sent

    sent = _against(_unauthorized, tiny_chunks_then_trailers, max_header_bytes=64 * 1024)
    assert sent < 8 << 20, "every trailer was taken in"


def test_a_client_that_reads_slowly_is_not_cut_off():
    """The write deadline is for a client that reads nothing: one that reads, however slowly,
    gets another interval each time its waiting data shrank."""
    chunks, size = 64, 16 * 1024

    async def stream(request: Request) -> StreamingResponse:
        async def body():
            for _ in range(chunks):
                yield b"x" * size
                await asyncio.sleep(0)

        return StreamingResponse(body())

    def read_slowly(port: int) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        with sock:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got = b""
            while chunk := sock.recv(size):
                got += chunk
                time.sleep(0.05)  # about 300 KB/s: the server's writes wait on it throughout
        return len(got.split(b"\r\n\r\n", 1)[1])

    async def main() -> None:
        app = Starlette(routes=[Route("/", stream, methods=["GET"])])
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        server = InReplicaServer(app, listener, write_stall_s=0.3)
        try:
            received = await asyncio.to_thread(read_slowly, server.address[1])
            assert received >= chunks * size  # the whole body (and its chunked framing), not cut off
        finally:
            await server.stop()

    asyncio.run(main())


def test_trailers_on_the_read_that_ends_the_body_count_too():
    """The bound was checked only while the body was still arriving: trailers on the read that
    ended it (after small chunks' allowance, in the same read) were kept whatever their size."""

    def one_write(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            request = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            sock.sendall(request)
            time.sleep(0.2)  # the header read on its own: the body's reads are counted
            trailers = b"".join(b"X-T%d: %s\r\n" % (i, b"t" * 1000) for i in range(100))  # 100 KB
            sock.sendall(b"1\r\nx\r\n" * 2000 + b"0\r\n" + trailers + b"\r\n")
            reply = b""
            try:
                while chunk := sock.recv(65536):
                    reply += chunk
            except ConnectionResetError:
                pass
        return reply

    reply = _against(_size, one_write, max_header_bytes=64 * 1024)
    assert not reply.startswith(b"HTTP/1.1 200"), reply[:200]  # a 431, or reset: not served
