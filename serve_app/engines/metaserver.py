"""The prefill replica's metaserver relay.

A decode engine's KV connector (ours on the CPU, vllm-ascend's MooncakeLayerwiseConnector on
NPUs) reports the blocks it allocated for a request by POSTing its KV parameters to
``kv_transfer_params["metaserver"]``. vllm-ascend's proxies receive that callback themselves and
then send the prompt to a prefill engine; here the router picks the prefill engine when it
starts the attempt, and the callback goes straight to that prefill replica's relay, which starts
the prefill as soon as it lands (``Prefill.run_on_kv_ready``). Routing the callback through the
decode replica and the router instead cost two more hops before every prefill (traced on the
2-core development host: about 2.6 ms at c=1, 11 ms at c=8).

Each attempt gets its own callback URL, ``<relay>/<token>`` with a random token the router draws,
and a POST is answered only at that URL and only with that attempt's id. A callback may land
before the router's call has registered its token (the decode engine can be quicker than the
prefill replica's call): it is held, a bounded number for a bounded time, for the registration to
pick up. Anything else on the host that can reach the relay's port still cannot answer for an
attempt it was not told about, so it cannot redirect a prefill engine's KV push elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.http_server import InReplicaServer, listening_socket

logger = logging.getLogger("pd_serve.engine")

PATH = "/v1/metaserver"
# Callbacks that came before their attempt registered: how many, and for how long, are held.
EARLY_LIMIT = 256
EARLY_TTL_S = 10.0
# Tokens whose attempt is over, remembered so that their late callbacks are refused (404).
ENDED_MEMORY = 4096


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
        self._early: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()  # token -> (when, body)
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.early_callbacks = 0  # callbacks that came before their attempt registered
        self._server: InReplicaServer | None = None

    async def start(self) -> None:
        app = Starlette(routes=[Route(PATH + "/{token}", self._receive, methods=["POST"])])
        self._server = InReplicaServer(app, listening_socket(self.host, 0, backlog=128))
        self.url = f"http://{self.host}:{self._server.address[1]}{PATH}"
        logger.info("metaserver relay at %s", self.url)

    def expect(self, request_id: str, token: str | None = None) -> tuple[asyncio.Future[dict[str, Any]], str]:
        """(the future of the callback's body, the URL the callback must go to). ``token`` is the
        one the router drew for the attempt (a fresh one when None); a callback already held for
        it resolves the future at once."""
        token = token or secrets.token_urlsafe(24)
        if request_id in self._tokens or token in self._waiting or token in self._ended:
            raise ValueError(f"request {request_id} is already waiting for its KV parameters, or its token is taken")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        waiting = _Waiting(request_id, future)
        self._waiting[token] = waiting
        self._tokens[request_id] = token
        early = self._early.pop(token, None)
        if early is not None:
            body = early[1]
            if str(body.get("request_id")) == request_id:
                future.set_result(body)
            else:
                logger.warning("a callback held for %s named another request; dropped", request_id)
        return future, f"{self.url}/{token}"

    def forget(self, request_id: str) -> None:
        token = self._tokens.pop(request_id, None)
        if token is None:
            return
        self._ended[token] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        waiting = self._waiting.pop(token, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.cancel()

    @property
    def pending(self) -> int:
        return len(self._waiting)

    @property
    def held(self) -> int:
        """Callbacks waiting for their attempt to register (each ends within EARLY_TTL_S)."""
        self._expire_early(time.monotonic())
        return len(self._early)

    async def _receive(self, request: Request) -> JSONResponse:
        token = request.path_params["token"]
        waiting = self._waiting.get(token)
        if token in self._ended or (waiting is not None and waiting.future.done()):
            # The attempt is over (aborted, timed out) or already answered: nobody waits here.
            return JSONResponse({"error": "no request is waiting at this URL"}, status_code=404)
        try:
            body = await request.json()
            request_id = str(body["request_id"])
        except Exception:
            return JSONResponse({"error": "body must be JSON with a request_id"}, status_code=400)
        waiting = self._waiting.get(token)  # the attempt may have registered meanwhile
        if waiting is None:
            self._hold(token, body)
            return JSONResponse({"status": "ok"})
        if request_id != waiting.request_id:
            return JSONResponse({"error": f"this URL answers for another request than {request_id}"}, status_code=403)
        if not waiting.future.done():
            waiting.future.set_result(body)
        return JSONResponse({"status": "ok"})

    def _hold(self, token: str, body: dict[str, Any]) -> None:
        self.early_callbacks += 1
        now = time.monotonic()
        self._expire_early(now)
        self._early[token] = (now, body)
        while len(self._early) > EARLY_LIMIT:
            self._early.popitem(last=False)

    def _expire_early(self, now: float) -> None:
        while self._early and next(iter(self._early.values()))[0] < now - EARLY_TTL_S:
            self._early.popitem(last=False)

    def close(self) -> None:
        """Ask the server to exit (from sync code too, e.g. a replica's ``__del__``)."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
