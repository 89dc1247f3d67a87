"""The decode replica's metaserver relay.

A decode engine's KV connector (ours on the CPU, vllm-ascend's MooncakeLayerwiseConnector on
NPUs) reports the blocks it allocated for a request by POSTing its KV parameters to
``kv_transfer_params["metaserver"]``. vllm-ascend's proxies receive that callback themselves; here
each decode replica receives it on a loopback HTTP endpoint of its own and turns it into the first
event (``KVReady``) of that request's decode stream. So the router replica that holds the stream
gets the parameters through the stream, whatever the number of router replicas, and no router
needs an address the engines can reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

logger = logging.getLogger("pd_serve.engine")

PATH = "/v1/metaserver"


def with_relay(kv_transfer_params: dict[str, Any], relay_url: str) -> dict[str, Any]:
    """The decode engine's kv_transfer_params: the router's decode-first parameters
    (``do_remote_prefill=True, do_remote_decode=False, request_id``) plus this replica's relay as
    ``metaserver``, which is all either connector (ours, or vllm-ascend's
    MooncakeLayerwiseConnector) needs to call back once it has allocated blocks."""
    return {**kv_transfer_params, "metaserver": relay_url}


class _QuietServer(uvicorn.Server):
    """uvicorn inside a Serve replica: the replica's process owns the signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class MetaserverRelay:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.url = ""
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(128)
        app = Starlette(routes=[Route(PATH, self._receive, methods=["POST"])])
        self._server = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        self.url = f"http://{self.host}:{sock.getsockname()[1]}{PATH}"
        logger.info("metaserver relay at %s", self.url)

    def expect(self, request_id: str) -> asyncio.Future[dict[str, Any]]:
        """Register before the request reaches the engine, so the callback always finds it."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    @property
    def pending(self) -> int:
        return len(self._waiting)

    async def _receive(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
            request_id = str(body["request_id"])
        except Exception:
            return JSONResponse({"error": "body must be JSON with a request_id"}, status_code=400)
        future = self._waiting.get(request_id)
        if future is None or future.done():
            # The attempt is over (aborted, timed out): nobody waits for these blocks any more.
            return JSONResponse({"error": f"no request {request_id} is waiting"}, status_code=404)
        future.set_result(body)
        return JSONResponse({"status": "ok"})

    def close(self) -> None:
        """Ask the server to exit (from sync code too, e.g. a replica's ``__del__``)."""
        if self._server is not None:
            self._server.should_exit = True

    async def stop(self) -> None:
        self.close()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 5)
