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

from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.http_server import InReplicaServer, listening_socket
from serve_app.router.errors import error_body
from serve_app.router.service import RouterService


def openai_app(service: RouterService) -> Starlette:
    async def completions(request: Request) -> Response:
        return await service.http("completions", await request.body())

    async def chat_completions(request: Request) -> Response:
        return await service.http("chat", await request.body())

    async def models(request: Request) -> Response:
        return JSONResponse(service.models())

    async def health(request: Request) -> Response:
        return await service.health()

    async def engines(request: Request) -> Response:
        return JSONResponse(await service.engine_snapshot())

    async def http_error(request: Request, exc: Any) -> Response:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/pd/engines", engines, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


def serve_openai(service: RouterService, host: str, port: int) -> InReplicaServer:
    """Start serving on ``host:port`` from the running event loop (the replica's)."""
    return InReplicaServer(openai_app(service), listening_socket(host, port, reuse_port=True))
