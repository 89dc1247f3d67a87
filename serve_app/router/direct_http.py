"""The router replicas serve the OpenAI HTTP API themselves (``router.http``).

Serve's HTTP proxy would put one more process, and two more Ray hops per request and per
streamed chunk, between the client and the router; on a small host that hop, not pd-serve's own
work, decides latency and throughput (docs/design.md, "Serving HTTP"). So each router replica
runs a uvicorn server on ``router.http.host:port`` (``SO_REUSEPORT``: several replicas on one host
share the port) with the same routes the Serve ingress has, answered by the same
``RouterService``. The Serve ingress stays, for a Serve proxy when one is enabled, and the
handle API is unchanged.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.router.client_keys import unauthorized
from serve_app.router.errors import CLIENT_CLOSED, OpenAIError, error_body
from serve_app.router.parsing import ClientHeaders
from serve_app.router.service import RouterService
from serve_app.runtime.http_server import InReplicaServer, listening_socket


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request's body, refused with a 413 as soon as it is known to exceed ``limit`` (its
    Content-Length, else the bytes read so far: never more than ``limit`` are held), and a 408
    when it does not arrive within ``timeout_s`` (a client trickling its body holds a slot)."""
    declared = request.headers.get("content-length")
    if declared is not None and _declares_more(declared, limit):
        raise OpenAIError(413, f"Request body of {declared[:32]} bytes exceeds this server's limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(413, f"Request body exceeds this server's limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"Request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        # Gone before its body was complete: counted, and never an application error (uvicorn
        # would log one with a traceback for every such client).
        raise OpenAIError(CLIENT_CLOSED, "The client closed the connection before its request body was complete") from None
    return b"".join(chunks)


def _declares_more(content_length: str, limit: int) -> bool:
    """Whether a Content-Length says more than ``limit``; one longer than the limit's own digits
    does without converting it (Python refuses to convert more than 4,300 digits: a ValueError,
    a 500, where a header of this server's size bound holds 60,000)."""
    if not content_length.isdigit():
        return False  # not a length: the body is counted as it is read
    digits = content_length.lstrip("0") or "0"
    return len(digits) > len(str(limit)) or int(digits) > limit


async def openai_call(service: RouterService, route: Any, request: Request) -> Response:
    """An OpenAI route: the client's key, the body within the configured limits, then the
    service, for as long as the client stays."""
    refused = refused_client(service, route, request)
    if refused is not None:
        return refused
    http = service.config.router.http
    try:
        body = await read_body(request, http.max_body_bytes, http.body_timeout_s)
    except OpenAIError as exc:
        service.refused(route, exc.status)
        return JSONResponse(exc.body(), exc.status)
    return await until_client_leaves(request, service.http(route, body, ClientHeaders.of(request.headers)))


async def until_client_leaves(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response, or ``work`` cancelled as soon as the client disconnects.

    uvicorn never cancels a handler whose client went away (Serve's proxy does, and vLLM's server
    watches for it the same way, ``with_cancellation``). Without this a non-streamed request, or
    a streamed one before its first token (Starlette's streaming response watches only once it
    exists), runs on to its end or its deadline, holding its engine requests, their KV blocks and
    the router's leases."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        handler.cancel()
        raise
    finally:
        watcher.cancel()
    if not handler.done():
        handler.cancel()
    try:
        return await handler  # a response made meanwhile is still returned: it releases itself
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this handler's own cancellation, not the client's
        return Response(status_code=CLIENT_CLOSED)


async def _disconnected(request: Request) -> None:
    """Return once the ASGI server reports the client gone (the body is already read: the next
    message is the disconnect, or the end of the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def refused_client(service: RouterService, route: Any, request: Request, operator_too: bool = False) -> Response | None:
    """The 401 for a client without one of the API keys (router/client_keys.py), counted under
    ``route``; None: admitted. ``operator_too``: the operator token admits as well."""
    authorization = request.headers.get("authorization")
    if service.client_keys.admit(authorization) or (operator_too and authorized_operator(service, authorization)):
        return None
    service.refused(route, 401)
    return unauthorized()


def told_details(service: RouterService, request: Request) -> bool:
    """Whether ``/health`` may say why the engines are down: to a caller with an API key or the
    operator token (anyone, where no keys are set); a probe without one learns the status only."""
    authorization = request.headers.get("authorization")
    return service.client_keys.admit(authorization) or authorized_operator(service, authorization)


def authorized_operator(service: RouterService, authorization: str | None) -> bool:
    """Whether the caller holds the operator token (``router.operator_token``); none is set: no one."""
    token = service.config.router.operator_token
    return token is not None and authorization is not None and secrets.compare_digest(authorization.encode(), f"Bearer {token}".encode())


def openai_app(service: RouterService) -> Starlette:
    async def completions(request: Request) -> Response:
        return await openai_call(service, "completions", request)

    async def chat_completions(request: Request) -> Response:
        return await openai_call(service, "chat", request)

    async def tokenize(request: Request) -> Response:
        return await openai_call(service, "tokenize", request)

    async def detokenize(request: Request) -> Response:
        return await openai_call(service, "detokenize", request)

    async def models(request: Request) -> Response:
        return refused_client(service, "models", request) or JSONResponse(service.models())

    async def health(request: Request) -> Response:
        return await service.health(told_details(service, request))

    async def engines(request: Request) -> Response:
        refused = refused_client(service, "engines", request, operator_too=True)
        if refused is not None:
            return refused
        full = authorized_operator(service, request.headers.get("authorization"))
        return JSONResponse(await service.engine_view(full))

    async def http_error(request: Request, exc: Any) -> Response:
        # A path or method no route serves: counted like the routes' own refusals.
        service.refused("other", exc.status_code)
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/pd/engines", engines, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


def serve_openai(service: RouterService, host: str, port: int) -> InReplicaServer:
    """Start serving on ``host:port`` from the running event loop (the replica's)."""
    http = service.config.router.http
    return InReplicaServer(
        openai_app(service),
        listening_socket(host, port, reuse_port=True),
        header_timeout_s=http.header_timeout_s,
        max_connections=http.max_connections,
        max_header_bytes=http.max_header_bytes,
        keep_alive_s=http.keep_alive_s,
    )
