"""A uvicorn server inside a Serve replica, on the replica's own event loop.

Used by the decode replicas' metaserver relay and by the router replicas when they serve the
OpenAI API themselves (``router.http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import select
import socket
import struct
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import uvicorn

from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve")

_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"
_H11 = "uvicorn.protocols.http.h11_impl.H11Protocol"
# What CoalescingHttpProtocol overrides and reads of the protocol it extends.
PROTOCOL_SYMBOLS = {
    "HttpToolsProtocol": tuple(
        f"{_HTTPTOOLS}.{name}"
        for name in (
            "connection_made",
            "data_received",
            "connection_lost",
            "on_message_begin",
            "on_header",
            "on_headers_complete",
            "on_body",
            "on_message_complete",
            "pause_writing",
            "resume_writing",
            "shutdown",
            "transport",
            "cycle",
            "connections",
        )
    ),
    "H11Protocol": tuple(
        f"{_H11}.{name}"
        for name in (
            "connection_made",
            "data_received",
            "connection_lost",
            "pause_writing",
            "resume_writing",
            "shutdown",
            "transport",
            "conn",
            "cycle",
            "connections",
        )
    ),
}
SERVER_STATE = ("uvicorn.server.ServerState.connections", "uvicorn.server.ServerState.tasks")  # the limit's counts
# A connection waiting for its header this long is a candidate for closing when too many wait
# (``max_pending``): younger ones may just not have been read yet (a burst, accepted in one turn
# of the loop), and those the server's limit answers with a 503 as before.
PENDING_MIN_AGE_S = 1.0
# A response's writes may wait this long for a client that reads nothing of them (the transport's
# buffer past its high-water mark, or left unsent at a close) before the connection is aborted:
# without it a client that stops reading holds its request, its engine's work and its place in
# ``limit_concurrency`` for good (uvicorn awaits room to write without a bound, and a close
# waits for the buffer to drain). A client that reads, however slowly, gets another interval.
WRITE_STALL_S = 30.0
# Bytes of a chunked body that are not its data (chunk headers, their extensions, trailers), per
# chunk: a chunk header is a few bytes, so only trailers or extensions pass this. httptools keeps
# trailers as headers in memory, with no bound of their own.
CHUNK_FRAMING_BYTES = 64
SERVER_SHUTDOWN = "uvicorn.server.Server.shutdown"  # calls each connection's ``shutdown``
CAPTURE_SIGNALS = "uvicorn.server.Server.capture_signals"


class _QuietServer(uvicorn.Server):
    """uvicorn inside a Serve replica: the replica's process owns the signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int, reuse_port: bool = False, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket whose accepted connections get ``TCP_NODELAY`` on any event loop.

    uvloop sets it on every TCP connection; asyncio's own loop only on sockets whose protocol
    number says TCP, and a socket made without one carries 0. Without it a kept-alive connection
    stalls: a response written in two parts (headers, then body or a stream's next frame) holds
    the second until the client acknowledges the first, which it delays by up to 40 ms. Ray's
    workers run uvloop unless ``RAY_USE_UVLOOP=0``; the in-process tests run asyncio's loop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        # Several router replicas on one host share the port; the kernel spreads connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


class CoalescingTransport:
    """A transport whose writes within one event-loop iteration leave in one ``write``.

    uvicorn writes a response's headers when the app sends ``http.response.start`` and each body
    part when it is sent, one syscall each. On a loopback connection every write that wakes the
    reader costs the writer tens of microseconds of CPU, and a streamed response's headers and
    first chunk are sent in the same iteration: one write instead of two, per response. Data is
    held only until the loop's next round of callbacks, never across an await that waits."""

    def __init__(self, transport: asyncio.Transport, write_stall_s: float | None = WRITE_STALL_S) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._write_stall_s = write_stall_s
        self._close_check: asyncio.TimerHandle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()
        left = self._transport.get_write_buffer_size()
        if self._write_stall_s is not None and self._close_check is None and left:
            # A close waits for the buffer to drain: a client that reads nothing gets it aborted.
            self._watch_close(left)

    def _watch_close(self, left: int) -> None:
        assert self._write_stall_s is not None
        self._close_check = asyncio.get_running_loop().call_later(self._write_stall_s, self._close_stalled, left)

    def _close_stalled(self, left: int) -> None:
        self._close_check = None
        now = self._transport.get_write_buffer_size()
        if now and now < left:
            self._watch_close(now)  # read from, slowly: another interval
        elif now:
            self._transport.abort()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# A request's line and headers, at most (uvicorn's h11 default is 16 KiB; nginx's largest is
# 4 x 8 KiB): an operator token or a long URL fits many times over. httptools has no such bound:
# without it a client holds a URL or header of any size in memory until the header deadline.
MAX_HEADER_BYTES = 64 * 1024


def coalescing_http_protocol(
    header_timeout_s: float | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    implementation: str = "auto",
    max_pending: int | None = None,
    write_stall_s: float | None = WRITE_STALL_S,
) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn's ``http="auto"`` picks (httptools, else h11; or the one named),
    on a ``CoalescingTransport``, with bounds on a request's header that uvicorn lacks:

    * a connection that has not sent a whole request header within ``header_timeout_s`` of
      connecting (or of its request's first byte) is closed. uvicorn bounds only the idle time
      between kept-alive requests: a client that sends half a header, a byte at a time, would
      hold its connection and its place in ``limit_concurrency`` forever;
    * at most ``max_pending`` connections of the server wait for their request's header at once:
      past it, those that have waited longest (at least ``PENDING_MIN_AGE_S``) are closed. A peer
      that opens connections and sends nothing (no token needed) would otherwise fill
      ``limit_concurrency`` within the header deadline, again and again, and uvicorn then answers
      every request 503, those on the routers' kept-alive connections too; a real client sends
      its header as it connects;
    * with httptools, a header larger than ``max_header_bytes`` is answered 431 and the
      connection closed (h11 has its own bound, ``h11_max_incomplete_event_size``). Bytes are
      counted per read from a connection's first read, or from the read in which a kept-alive
      connection's next request began (the read after it, for a request pipelined behind a
      response): exact but for a pipelined request, which gets at most one read (256 KiB) more,
      never a header of any size. A chunked body's trailers and chunk extensions, which
      httptools keeps in memory as headers, count against the same bound;
    * a kept-alive connection that sends bare line ends between requests (httptools skips them
      without beginning a request; they stop uvicorn's keep-alive timer) gets the header deadline.

    Bounds on the way back, which uvicorn lacks too: a response whose writes wait more than
    ``write_stall_s`` for a client that reads nothing aborts the connection (its request then
    ends as a disconnect), and so does a close whose unsent data waits as long. And a client that
    closes while a request is pipelined behind its running one (httptools) is seen as gone by the
    running one too (uvicorn tells only the latest).

    And one change to uvicorn's graceful shutdown, which closes every connection that is between
    responses: a connection whose request has not arrived whole (a new one, its request on the
    way, or a kept-alive one whose next request has begun) is answered, then closed, instead of
    closed with its request unread, which its client sees as a reset. A kept-alive connection
    with nothing of a next request closes at once, as uvicorn does."""
    base = _protocol_base(implementation)
    h11_based = base.__name__ == "H11Protocol"
    without = f"write coalescing and the request-header bounds on uvicorn's {base.__name__}"
    if not unchanged((*PROTOCOL_SYMBOLS[base.__name__], SERVER_SHUTDOWN, *SERVER_STATE), logger, without):
        return base

    class CoalescingHttpProtocol(base):  # type: ignore[valid-type, misc]
        # This server's connections waiting for a request header, longest-waiting first.
        _pending: OrderedDict[Any, float] = OrderedDict()  # -> when it began waiting (loop time)
        _header_deadline: asyncio.TimerHandle | None = None
        _in_header = False
        _header_bytes = 0
        _header_tail = b""
        _answer_then_close = False  # shut down while its request was arriving
        _write_deadline: asyncio.TimerHandle | None = None
        _write_left = 0  # bytes waiting to be written when the deadline was set
        # httptools: the requests of this connection whose responses are not complete (one
        # running, any pipelined behind it), and the bytes of a chunked body that were not data.
        _open_cycles: tuple[Any, ...] = ()
        _in_body = False
        _framing_bytes = 0
        _trailer_bytes = 0  # of the trailer fields parsed (httptools hands them to uvicorn as headers)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport, write_stall_s))  # type: ignore[arg-type]
            self._header_begun()

        def data_received(self, data: bytes) -> None:
            if not self._in_header and self._between_requests():
                # A kept-alive connection's next request begins (or, with httptools, bare line
                # ends it skips): in line before the parser reads it (and uvicorn checks its
                # limit), as httptools' on_message_begin puts it.
                self._header_begun()
            if self._in_body:
                self._framing_bytes += len(data)  # less the data and chunk headers, as parsed
            if self._in_header and not h11_based:
                # Count the header's own bytes only: a read that ends the header also carries the
                # start of the body. The end is the first blank line (its CRLFs may straddle reads).
                seen = self._header_tail + data
                end = seen.find(b"\r\n\r\n")
                part = len(data) if end < 0 else max(0, end + 4 - len(self._header_tail))
                if self._header_bytes + part > max_header_bytes:
                    self._refuse_header()
                    return
                self._header_bytes += part
                self._header_tail = seen[-3:]
            was_in_body = self._in_body
            super().data_received(data)
            if was_in_body and (self._framing_bytes > max_header_bytes or self._trailer_bytes > max_header_bytes):
                # Trailers (or chunk extensions) past the header bound, checked on the read that
                # ended the body too: the framing count bounds a field still arriving (httptools
                # holds it whole), the trailer count the fields uvicorn keeps.
                self._refuse_header()
                return
            if self._in_body:
                # A read's small chunks (less framing than allowed) earn no credit for later ones.
                self._framing_bytes = max(self._framing_bytes, 0)
            if h11_based:  # h11 has no parser callbacks: its state says where the request is
                self._follow_h11_state()
                if self._answer_then_close and self.cycle is not None:
                    self.cycle.keep_alive = False
            self._bound_unread_body()

        # httptools' parser callbacks
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_begun()

        def on_headers_complete(self) -> None:
            self._header_done()
            super().on_headers_complete()
            if self._answer_then_close:
                self.cycle.keep_alive = False
            self._open_cycles = (*(c for c in self._open_cycles if not c.response_complete), self.cycle)
            self._in_body, self._framing_bytes, self._trailer_bytes = True, 0, 0

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            if not self._in_header:  # after the header: a chunked body's trailer
                self._trailer_bytes += len(name) + len(value) + 4

        def on_body(self, body: bytes) -> None:
            self._framing_bytes -= len(body)
            super().on_body(body)

        def on_chunk_header(self) -> None:
            self._framing_bytes -= CHUNK_FRAMING_BYTES

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_deadline is None:
                self._arm_write_deadline()

        def _arm_write_deadline(self) -> None:
            if write_stall_s is not None:
                self._write_left = self.transport.get_write_buffer_size()
                self._write_deadline = asyncio.get_running_loop().call_later(write_stall_s, self._write_stalled)

        def resume_writing(self) -> None:
            self._write_done()
            super().resume_writing()

        def _write_stalled(self) -> None:
            self._write_deadline = None
            if self.transport.get_write_buffer_size() < self._write_left:
                self._arm_write_deadline()  # the client reads, slowly: another interval
                return
            self.transport.abort()  # uvicorn then tells the request its client is gone

        def _write_done(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def shutdown(self) -> None:
            if not self._in_header:
                super().shutdown()
                return
            # Its request is arriving: answered, then closed (still bounded by the header
            # deadline). Pipelined behind a response in progress: that response is the last.
            self._answer_then_close = True
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_done()
            self._write_done()
            self._in_body = False
            super().connection_lost(exc)
            for cycle in self._open_cycles:  # uvicorn tells only the latest (self.cycle)
                if not cycle.response_complete:
                    cycle.disconnected = True
                cycle.message_event.set()
            self._open_cycles = ()

        def _between_requests(self) -> bool:
            if not h11_based:
                cycle = self.cycle
                return cycle is None or (cycle.response_complete and not cycle.more_body)
            import h11

            return self.conn.their_state is h11.IDLE

        def _follow_h11_state(self) -> None:
            import h11

            if self.conn.their_state is h11.IDLE:
                self._header_begun()  # data came, no whole request header yet
            elif not self._answered_early():
                self._header_done()

        def _bound_unread_body(self) -> None:
            """A request answered before its body arrived (a 404, a 413 on its Content-Length)
            whose body keeps coming: uvicorn drops those bytes, and each one stops its keep-alive
            timer, which restarts only with the next response; so a peer sending a byte now and
            then would hold the connection, and a place in ``limit_concurrency``, forever. The
            rest of that body, and the next request's header, get the header deadline."""
            if self._answered_early():
                self._start_header_deadline()

        def _answered_early(self) -> bool:
            cycle = self.cycle
            return cycle is not None and cycle.response_complete and cycle.more_body

        def _header_begun(self) -> None:
            if not self._in_header:
                self._in_header, self._header_bytes, self._header_tail = True, 0, b""
                self._wait_in_line()
            self._start_header_deadline()

        def _wait_in_line(self) -> None:
            pending = self._pending
            now = asyncio.get_running_loop().time()
            pending[self] = now
            if max_pending is None:
                return
            while len(pending) > max_pending:
                oldest, since = next(iter(pending.items()))
                if now - since < PENDING_MIN_AGE_S:
                    break
                oldest._header_done()
                # Out of the limit's count at once, not when the loop gets to its connection_lost:
                # the request that made room is checked against that count in this same turn.
                oldest.connections.discard(oldest)
                if not oldest.transport.is_closing():
                    oldest.transport.close()

        def _start_header_deadline(self) -> None:
            if header_timeout_s is not None and self._header_deadline is None:
                self._header_deadline = asyncio.get_running_loop().call_later(header_timeout_s, self._header_expired)

        def _header_done(self) -> None:
            self._in_header = False
            self._pending.pop(self, None)
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_expired(self) -> None:
            self._header_done()
            if not self.transport.is_closing():
                self.transport.close()

        def _refuse_header(self) -> None:
            self._header_done()
            self._in_body = False
            if not self.transport.is_closing():
                self.transport.write(_HEADER_TOO_LARGE)
                self.transport.close()

    return CoalescingHttpProtocol


def _error_json(message: str, status: int, error_type: str) -> bytes:
    """An OpenAI-style error body (vLLM's ``ErrorResponse``), for the answers this server gives
    before any app sees the request."""
    from serve_app.runtime.compat import ErrorInfo, ErrorResponse

    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=None, code=status)).model_dump_json().encode()


def _header_too_large() -> bytes:
    body = _error_json("the request's line and headers are too large", 431, "invalid_request_error")
    head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


_HEADER_TOO_LARGE = _header_too_large()


def _protocol_base(implementation: str) -> type[asyncio.Protocol]:
    if implementation in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:  # httptools is optional
            if implementation == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


# Handing a shared port over (SO_REUSEPORT: the router replicas). Closing a listener resets every
# connection the kernel has queued on it and not yet accepted; with SO_REUSEPORT the kernel hashes
# each new connection to one of the port's listeners, so a replica that stops while others serve
# would reset the share of new connections it was dealt in its last moments. So a stopping
# listener first drops new connections' SYNs (a socket filter), lets the handshakes already under
# way finish, accepts everything queued, and only then closes. A client whose SYN was dropped
# sends it again about a second later, when the kernel gives it to a listener still open.
SO_ATTACH_FILTER = 26  # Linux's socket option (not in Python's socket module)
# Classic BPF over a TCP segment (offset 0: the TCP header): ld [13] (the flags byte); jset SYN;
# ret 0 (drop); ret 0xffffffff (keep it all).
DROP_SYN_FILTER = ((0x30, 0, 0, 13), (0x45, 0, 1, 0x02), (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF))
# A handshake whose SYN was answered before the filter completes within a round trip (µs on
# loopback, well under a millisecond on a LAN).
HANDSHAKE_GRACE_S = 0.05
ACCEPT_POLL_S = 0.005
HAND_OFF_LIMIT_S = 2.0  # the event loop accepts what was queued in a few iterations


def drop_new_connections(sock: socket.socket) -> bool:
    """Make the kernel drop new connections' SYNs at ``sock``, a listening TCP socket; segments of
    connections already under way pass. False where it cannot (not Linux, or refused)."""
    if not sys.platform.startswith("linux"):
        return False
    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *insn) for insn in DROP_SYN_FILTER))
    fprog = struct.pack("HL", len(DROP_SYN_FILTER), ctypes.addressof(program))  # struct sock_fprog
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)  # the kernel copies the program
    except OSError as exc:
        logger.warning("a stopping listener on %s cannot refuse new connections first: %s", sock.getsockname(), exc)
        return False
    return True


def queued_connections(sock: socket.socket) -> bool:
    """Whether the kernel holds a connection for ``sock`` (a listener) that is not yet accepted."""
    poller = select.poll()  # not select(): a Ray worker's descriptors can pass FD_SETSIZE
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


async def hand_off(sock: socket.socket, limit_s: float = HAND_OFF_LIMIT_S) -> None:
    """Before ``sock`` (a listener whose port others share) closes: no new connection is queued on
    it, and the event loop, still serving, has accepted every one that was (module comment)."""
    if not drop_new_connections(sock):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    await asyncio.sleep(HANDSHAKE_GRACE_S)
    while queued_connections(sock) and loop.time() < deadline:
        await asyncio.sleep(ACCEPT_POLL_S)


def shares_port(sock: socket.socket) -> bool:
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    try:
        return reuse_port is not None and bool(sock.getsockopt(socket.SOL_SOCKET, reuse_port))
    except OSError:
        return False


class InReplicaServer:
    """Serves ``app`` on ``sock`` from the running event loop until ``stop``."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        keep_alive_s: float = 5.0,
        *,
        header_timeout_s: float = 10.0,
        max_connections: int | None = 4096,
        max_header_bytes: int = MAX_HEADER_BYTES,
        http: str = "auto",
        write_stall_s: float | None = WRITE_STALL_S,
    ) -> None:
        """``header_timeout_s``: a connection's request header must be complete within it;
        ``max_connections``: connections plus requests in progress, beyond which uvicorn answers
        503 at once (its ``limit_concurrency``). The defaults hold for the router's API, the
        engines' call endpoints (a kept-alive connection per call in progress from each router:
        an engine runs a few hundred requests at most) and the metaserver relay (one per poster
        thread). ``max_header_bytes``: a request's line and headers (431 beyond);
        ``http``: uvicorn's protocol ("auto": httptools if installed, else h11);
        ``write_stall_s``: how long a response may wait for a client that reads nothing."""
        self.sock = sock
        self.address = sock.getsockname()
        self.shares_port = shares_port(sock)
        # log_config=None: uvicorn would otherwise run logging.config.dictConfig, which closes every
        # handler in the process, Serve's log-file handler of this replica included.
        config = uvicorn.Config(
            self._within_limit(app, max_connections),
            # Half the connections for those waiting for their header: the rest stay for requests.
            http=coalescing_http_protocol(
                header_timeout_s, max_header_bytes, http, max_connections // 2 if max_connections else None, write_stall_s
            ),
            h11_max_incomplete_event_size=max_header_bytes,
            log_config=None,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=keep_alive_s,
        )
        # Nothing to stand aside from: the override is inert, and uvicorn's own handlers would
        # take this replica's signals.
        unchanged([CAPTURE_SIGNALS], logger, "keeping uvicorn off the replica's signal handlers")
        self._server = _QuietServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))

    def _within_limit(self, app: Any, limit: int | None) -> Any:
        """``app`` behind uvicorn's ``limit_concurrency`` check (connections, or requests in
        progress, at the limit), answered with an OpenAI-style 503 rather than uvicorn's plain
        text. The server's state is read when a request comes, the server being made after."""
        if limit is None:
            return app
        busy = _error_json("the server is at its connection limit; retry later", 503, "service_unavailable")

        async def limited(scope: Any, receive: Any, send: Any) -> None:
            state = self._server.server_state
            # As uvicorn counts: this connection is among the connections, this request's task
            # among the tasks (uvicorn checks before adding it).
            if scope["type"] == "http" and (len(state.connections) >= limit or len(state.tasks) > limit):
                headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(busy)), (b"connection", b"close")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": busy})
                return
            await app(scope, receive, send)

        return limited

    @property
    def serving(self) -> bool:
        """False once the server has exited (asked to, or failed)."""
        return not self._task.done()

    def close(self) -> None:
        """Ask the server to exit (from sync code too, e.g. a replica's ``__del__``)."""
        self._server.should_exit = True

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving: a listener that shares its port with other replicas (SO_REUSEPORT) first
        leaves new connections to them and accepts those queued on it (``hand_off``); then
        uvicorn's graceful shutdown closes the idle connections and lets the requests in progress
        finish, up to ``timeout_s`` in all."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.shares_port:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(hand_off(self.sock), min(timeout_s, HAND_OFF_LIMIT_S + HANDSHAKE_GRACE_S))
        self.close()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self._task, max(0.0, deadline - loop.time()))
