"""The router's side of ``router.engine_transport: http``: calls to an engine replica's own
endpoint (engines/call_server.py), shaped like the Serve responses they stand in for.

``EngineStream`` is read like a streaming ``DeploymentResponseGenerator`` (``__anext__``,
``cancel``) and ``EngineCall`` awaited like a ``DeploymentResponse`` (``cancel``), so the
attempt's code does not care which transport it holds. Connections are kept alive and reused
(aiohttp's pool): a finished stream reads its body to the end so its connection goes back to
the pool; a cancelled one closes its connection, which is what tells the replica to abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterator, Generator
from typing import Any

from serve_app.wire.frames import CONTENT_TYPE, GENERATE_PATH, RUN_PATH, CallError, FrameReader, Message, WireError, encode_request
from serve_app.wire.protocol import EngineCallEndpoint, EngineEvent, EngineRequest, PrefillResult, TokenDelta

# How long a finished stream may take to deliver the rest of its body (the end of the chunked
# encoding, sent right after the last frame) before its connection is closed instead of reused.
DRAIN_TIMEOUT_S = 1.0
ERROR_TEXT_BYTES = 4096  # of an error answer's body, for the log line
CONNECT_TIMEOUT_S = 5.0
# Shorter than the endpoint's own (call_server.SERVER_KEEP_ALIVE_S), so this side always closes
# an idle connection first and never sends a call on one the engine is closing.
CLIENT_KEEP_ALIVE_S = 60.0


_closing: set[asyncio.Future] = set()


class EngineUnreachable(ConnectionError):
    """The engine replica's endpoint did not answer, or its connection broke: the replica is
    gone or restarting (Serve replaces it), or unreachable from here: the router leaves it alone
    for a backoff that grows while its calls keep failing (``EnginePool.mark_unhealthy``)."""


class EngineCallFailed(RuntimeError):
    """The replica answered, but its call failed (it raised, or refused the call)."""


# Errors of this module name the failure, never the endpoint's URL or the call's headers (its
# token): they become the detail of attempts' failures, which the router logs (the client reads
# only the kind of failure, cdcp.failure_of). aiohttp's exceptions carry both (a
# ClientResponseError's repr holds the request's headers, a ClientConnectorError's text the
# host and port), so they are summarised by class and a reason picked from known-safe fields
# (``transport_reason``), and never chained.


def transport_reason(exc: BaseException) -> str:
    """A short description of a transport error that holds no address, URL or header: the
    class, and where one is known to be safe, an errno name or an HTTP status. Never ``str(exc)``
    or ``repr(exc)``: aiohttp puts the connection key, the URL and the request's headers there,
    and the OS error's own text names the peer's address (asyncio's "Connect call failed (host,
    port)")."""
    import aiohttp

    name = type(exc).__name__
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{name}, status {exc.status}"  # its message is the peer's text: not ours to repeat
    os_error = getattr(exc, "os_error", exc)  # a ClientConnectorError wraps the OS's error
    code = os_error.errno if isinstance(os_error, OSError) else None
    if isinstance(code, int) and code in errno.errorcode:
        return f"{name}, {errno.errorcode[code]}"
    return name


def one_line(text: str, limit: int) -> str:
    """Text from another process (an engine's answer, an exception's message) as part of one log
    line: cut to ``limit`` characters, control characters escaped, so a line break in it cannot
    forge a log line of its own."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])


class EngineClient:
    """One per router replica: a pool of kept-alive connections to the engines' endpoints."""

    def __init__(self) -> None:
        self._session: Any = None

    def _http(self) -> Any:
        import aiohttp

        if self._session is None:  # made on first use, inside the replica's running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                auto_decompress=False,
            )
        return self._session

    def stream(self, endpoint: EngineCallEndpoint, request: EngineRequest) -> EngineStream:
        return EngineStream(self._post(endpoint, GENERATE_PATH, request))

    def call(self, endpoint: EngineCallEndpoint, request: EngineRequest) -> EngineCall:
        return EngineCall(self._post(endpoint, RUN_PATH, request))

    async def _post(self, endpoint: EngineCallEndpoint, path: str, request: EngineRequest) -> AsyncIterator[Message]:
        """The call's messages as they arrive; errors as ``EngineUnreachable`` or ``EngineCallFailed``."""
        import aiohttp

        headers = {"Authorization": f"Bearer {endpoint.token}", "Content-Type": CONTENT_TYPE}
        try:
            async with self._http().post(endpoint.url + path, data=encode_request(request), headers=headers) as response:
                if response.status != 200:
                    if response.status == 401:  # another replica at that address now: ours is gone
                        raise EngineUnreachable("the engine's endpoint refused its token (the replica was replaced)")
                    reason = one_line((await _error_text(response)).decode(errors="replace"), 200)
                    raise EngineCallFailed(f"the engine's endpoint answered {response.status}: {reason}")
                reader = FrameReader()
                async for chunk in response.content.iter_any():
                    for message in reader.feed(chunk):
                        if isinstance(message, CallError):
                            # The engine's exception text, for the router's log line: one line.
                            raise EngineCallFailed(one_line(message.message, 1000))
                        yield message
                if reader.pending:
                    raise EngineUnreachable(f"the engine's answer ended inside a frame ({reader.pending} bytes)")
        except EngineUnreachable:  # ours, raised above: an OSError too, kept as it says
            raise
        except aiohttp.ClientError as exc:
            raise EngineUnreachable(f"the engine's endpoint could not be reached ({transport_reason(exc)})") from None
        except TimeoutError as exc:  # aiohttp's connect timeout
            raise EngineUnreachable(f"the engine's endpoint did not answer in time ({type(exc).__name__})") from None
        except OSError as exc:  # a socket error aiohttp did not wrap: its text may name the peer
            raise EngineUnreachable(f"the engine's endpoint could not be reached ({transport_reason(exc)})") from None
        except WireError as exc:
            raise EngineCallFailed(f"the engine's endpoint sent a broken answer: {one_line(str(exc), 200)}") from None
        except RecursionError:  # msgspec's answer to a frame nested past its depth: a broken frame
            raise EngineCallFailed("the engine's endpoint sent a broken answer: a frame nested too deep") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _error_text(response: Any) -> bytes:
    """The start of an error answer's body, within ``DRAIN_TIMEOUT_S``: whatever answers at a
    gone replica's address (another process may have its port) need not send a short one."""
    text = b""
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            while len(text) < ERROR_TEXT_BYTES and (chunk := await response.content.read(ERROR_TEXT_BYTES - len(text))):
                text += chunk
    return text


class EngineStream:
    def __init__(self, messages: AsyncIterator[Message]) -> None:
        self._messages = messages
        self._finished = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> EngineEvent:
        message = await anext(self._messages)
        if isinstance(message, PrefillResult):
            raise EngineCallFailed("the engine answered a stream with a prefill result")
        if isinstance(message, TokenDelta) and message.finish_reason is not None:
            self._finished = True
        return message

    def cancel(self) -> None:
        """Close the call: after its last delta, once its body has ended (the connection is then
        reused); before, at once (the replica sees the connection close and aborts)."""
        closing = asyncio.ensure_future(self._close())
        _closing.add(closing)  # the loop keeps only a weak reference to a task
        closing.add_done_callback(_closing.discard)

    async def _close(self) -> None:
        with contextlib.suppress(BaseException):
            if self._finished:
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    async for _ in self._messages:
                        pass
        with contextlib.suppress(BaseException):
            await self._messages.aclose()


class EngineCall:
    def __init__(self, messages: AsyncIterator[Message]) -> None:
        self._task = asyncio.ensure_future(self._result(messages))

    @staticmethod
    async def _result(messages: AsyncIterator[Message]) -> PrefillResult:
        result = None
        async for message in messages:
            result = message
        if not isinstance(result, PrefillResult):
            raise EngineCallFailed(f"the engine answered {type(result).__name__} instead of a prefill result")
        return result

    def __await__(self) -> Generator[Any, None, PrefillResult]:
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()
