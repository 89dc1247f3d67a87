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


def coalescing_http_protocol() -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn's ``http="auto"`` picks (httptools, else h11), on a
    ``CoalescingTransport``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class CoalescingHttpProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]

    return CoalescingHttpProtocol


class InReplicaServer:
    """Serves ``app`` on ``sock`` from the running event loop until ``stop``."""

    def __init__(self, app: Any, sock: socket.socket, keep_alive_s: float = 5.0) -> None:
        self.sock = sock
        self.address = sock.getsockname()
        # log_config=None: uvicorn would otherwise run logging.config.dictConfig, which closes every
        # handler in the process, Serve's log-file handler of this replica included.
        config = uvicorn.Config(
            app,
            http=coalescing_http_protocol(),
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
