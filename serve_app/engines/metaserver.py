"""The decode replica's metaserver relay.

A decode engine's KV connector (ours on the CPU, vllm-ascend's MooncakeLayerwiseConnector on
NPUs) reports the blocks it allocated for a request by POSTing its KV parameters to
``kv_transfer_params["metaserver"]``. vllm-ascend's proxies receive that callback themselves; here
each decode replica receives it on a loopback HTTP endpoint of its own and turns it into the first
event (``KVReady``) of that request's decode stream. So the router replica that holds the stream
gets the parameters through the stream, whatever the number of router replicas, and no router
needs an address the engines can reach.

Each waiting request gets its own callback URL, ``<relay>/<token>`` with a random token, and a
POST is accepted only at that URL and only with that request's id. Anything else on the host
that can reach the relay's port still cannot answer for a request it was not told about, so it
cannot redirect a prefill engine's KV push elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.runtime.http_server import InReplicaServer, listening_socket

logger = logging.getLogger("pd_serve.engine")

PATH = "/v1/metaserver"


def with_relay(kv_transfer_params: dict[str, Any], callback_url: str) -> dict[str, Any]:
    """The decode engine's kv_transfer_params: the router's decode-first parameters
    (``do_remote_prefill=True, do_remote_decode=False, request_id``) plus this request's relay
    URL as ``metaserver``, which is all either connector (ours, or vllm-ascend's
    MooncakeLayerwiseConnector) needs to call back once it has allocated blocks."""
    return {**kv_transfer_params, "metaserver": callback_url}


@dataclass(frozen=True)
class _Waiting:
    request_id: str
    future: asyncio.Future[dict[str, Any]]


class MetaserverRelay:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.url = ""
        self._waiting: dict[str, _Waiting] = {}  # token -> the request it answers for
        self._tokens: dict[str, str] = {}  # request id -> token
        self._server: InReplicaServer | None = None

    async def start(self) -> None:
        app = Starlette(routes=[Route(PATH + "/{token}", self._receive, methods=["POST"])])
        self._server = InReplicaServer(app, listening_socket(self.host, 0, backlog=128))
        self.url = f"http://{self.host}:{self._server.address[1]}{PATH}"
        logger.info("metaserver relay at %s", self.url)

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.serving

    def expect(self, request_id: str) -> tuple[asyncio.Future[dict[str, Any]], str]:
        """(the future of the callback's body, the URL the callback must go to). Register before
        the request reaches the engine, so the callback always finds it."""
        if request_id in self._tokens:
            raise ValueError(f"request {request_id} is already waiting for its KV parameters")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        token = secrets.token_urlsafe(24)
        self._waiting[token] = _Waiting(request_id, future)
        self._tokens[request_id] = token
        return future, f"{self.url}/{token}"

    def forget(self, request_id: str) -> None:
        token = self._tokens.pop(request_id, None)
        waiting = self._waiting.pop(token, None) if token is not None else None
        if waiting is not None and not waiting.future.done():
            waiting.future.cancel()

    @property
    def pending(self) -> int:
        return len(self._waiting)

    async def _receive(self, request: Request) -> JSONResponse:
        waiting = self._waiting.get(request.path_params["token"])
        if waiting is None or waiting.future.done():
            # Unknown token, or the attempt is over (aborted, timed out): nobody waits here.
            return JSONResponse({"error": "no request is waiting at this URL"}, status_code=404)
        try:
            body = await request.json()
            request_id = str(body["request_id"])
        except Exception:
            return JSONResponse({"error": "body must be JSON with a request_id"}, status_code=400)
        if request_id != waiting.request_id:
            return JSONResponse({"error": f"this URL answers for another request than {request_id}"}, status_code=403)
        if waiting.future.done():
            # The attempt ended (``forget``) while the body was arriving: nobody waits here now.
            return JSONResponse({"error": "no request is waiting at this URL"}, status_code=404)
        waiting.future.set_result(body)
        return JSONResponse({"status": "ok"})

    def close(self) -> None:
        """Ask the server to exit (from sync code too, e.g. a replica's ``__del__``)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
