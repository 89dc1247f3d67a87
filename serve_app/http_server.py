"""A uvicorn server inside a Serve replica, on the replica's own event loop.

Used by the decode replicas' metaserver relay and by the router replicas when they serve the
OpenAI API themselves (``router.http``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


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
    reader costs the writer tens of microseconds of CPU (measured here: 3.7 µs per write to a
    busy reader, 47 µs to one that sleeps between writes), and a streamed response's headers and
    first chunk are sent in the same iteration: one write instead of two, per response. Data is
    held only until the loop's next round of callbacks, never across an await that waits."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

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

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def coalescing_http_protocol(header_timeout_s: float | None = None) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn's ``http="auto"`` picks (httptools, else h11), on a
    ``CoalescingTransport``; with httptools, a connection that has not sent a whole request
    header within ``header_timeout_s`` of connecting (or of its request's first byte) is closed.

    uvicorn bounds only the idle time between kept-alive requests: a client that sends half a
    header, a byte at a time, holds its connection and its place in ``limit_concurrency``
    forever. uvicorn has no setting for it, so the protocol's own parser callbacks arm and
    disarm a timer."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional; without it no header deadline
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

        header_timeout_s = None

    class CoalescingHttpProtocol(base):  # type: ignore[valid-type, misc]
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]
            self._arm_header_deadline()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if header_timeout_s is not None and self._header_deadline is None:
                self._header_deadline = asyncio.get_running_loop().call_later(header_timeout_s, self._header_expired)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _header_expired(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return CoalescingHttpProtocol


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
    ) -> None:
        """``header_timeout_s``: a connection's request header must be complete within it;
        ``max_connections``: connections plus requests in progress, beyond which uvicorn answers
        503 at once (its ``limit_concurrency``). The defaults hold for the router's API, the
        engines' call endpoints (one kept-alive connection per router) and the metaserver relay
        (one per poster thread)."""
        self.sock = sock
        self.address = sock.getsockname()
        # log_config=None: uvicorn would otherwise run logging.config.dictConfig, which closes every
        # handler in the process, Serve's log-file handler of this replica included.
        config = uvicorn.Config(
            app,
            http=coalescing_http_protocol(header_timeout_s),
            limit_concurrency=max_connections,
            log_config=None,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=keep_alive_s,
        )
        self._server = _QuietServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))

    def close(self) -> None:
        """Ask the server to exit (from sync code too, e.g. a replica's ``__del__``)."""
        self._server.should_exit = True

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.close()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self._task, timeout_s)
