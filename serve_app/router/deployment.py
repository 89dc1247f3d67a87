"""The router deployment: the Serve ingress (OpenAI HTTP API) and the Python handle API.

A thin shell: each route and handle method delegates to ``RouterService``, which holds all of
the router's behaviour and can be tested without Serve. It owns no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.config.autoscaling import CLIENT_REQUESTS
from serve_app.config.backends import engine_specs
from serve_app.config.settings import load_config
from serve_app.router.direct_http import authorized_operator, openai_call, refused_client, serve_openai, told_details
from serve_app.router.errors import error_body
from serve_app.router.sampling_defaults import max_tokens_cap, model_sampling_defaults
from serve_app.router.service import RouterService
from serve_app.runtime.cpu_placement import keep_off_engine_cores
from serve_app.runtime.gc_heap import freeze_startup_heap
from serve_app.runtime.logs import quiet_cancelled_requests, to_serve_logs
from serve_app.runtime.metrics import router_metrics
from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.router")

HANDLE_OPTIONS = "ray.serve.handle.DeploymentHandle.options"  # its private ``_by_reference``

http_app = FastAPI(title="pd-serve", docs_url=None, redoc_url=None, openapi_url=None)  # the routes of router/direct_http.py only

STATUS_TIMEOUT_S = 2.0
# What a stopping router replica leaves of graceful_shutdown_timeout_s for Serve's own steps.
ROUTER_SHUTDOWN_MARGIN_S = 3.0


# Module-level helpers sit above the class: serve.ingress pickles the class when it is decorated.
def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"router-{int(time.time())}"


def engine_handle(handle: Any, transport: str) -> Any:
    """The router's handle to an engine. With ``grpc`` (Ray Serve's transport for its
    throughput-optimized mode) calls and streamed items go straight to the replica's gRPC server
    instead of through Ray's object store: about a millisecond less per call and much less CPU per
    streamed item on both ends. Our messages are plain dataclasses: pickle, not cloudpickle. With
    ``http`` it carries only the calls made before an engine's endpoint is known. The stats polls
    take the deployment's plain handle whatever the transport (``EnginePool.attach``)."""
    if transport in ("grpc", "http"):
        if not unchanged([HANDLE_OPTIONS], logger, f"by-value engine calls over {transport} (they go through Ray's object store)"):
            return handle
        return handle.options(_by_reference=False, request_serialization="pickle", response_serialization="pickle")
    return handle


async def deployment_status() -> dict[str, str]:
    """'STATUS: message' of every deployment of this app that is not healthy, from Serve."""

    def read() -> dict[str, str]:
        app = serve.get_replica_context().app_name
        deployments = serve.status().applications[app].deployments
        return {name: f"{d.status}: {d.message}".strip(": ") for name, d in deployments.items() if d.status != "HEALTHY"}

    return await asyncio.wait_for(asyncio.to_thread(read), STATUS_TIMEOUT_S)


def build_service(config: dict[str, Any], engines: dict[str, Any]) -> RouterService:
    """The service over the engine pools: ``engines`` holds each role's deployment handle."""
    from transformers import AutoConfig, AutoTokenizer

    app_config = load_config(config)
    name, options = app_config.tokenizer_source
    tokenizer = AutoTokenizer.from_pretrained(name, **options)
    try:
        where, options = app_config.model_config_source
        vocab_size = int(AutoConfig.from_pretrained(where, **options).vocab_size)
    except Exception:
        vocab_size = len(tokenizer)
    transport = app_config.router.engine_transport
    decode_kwargs = app_config.role_engine_kwargs("decode")
    defaults = model_sampling_defaults(app_config.model, decode_kwargs)
    service = RouterService(
        app_config,
        {},
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        metrics=router_metrics(),
        replica_id=_replica_id(),
        pools={role: (engine_handle(handle, transport), handle) for role, handle in engines.items()},
        app_name=serve.get_replica_context().app_name,
        sampling_defaults=defaults,
        max_tokens_cap=max_tokens_cap(decode_kwargs, defaults),
    )
    service.engine_status = deployment_status  # type: ignore[method-assign]
    return service


@http_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    _count_refusal(request, exc.status_code)
    return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)


@http_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _count_refusal(request, 400)
    return JSONResponse(error_body(str(exc), 400), 400)


def _count_refusal(request: Request, status: int) -> None:
    """A path or method no route serves, counted as the direct HTTP server counts it (the
    replica's service is on the app's state: one router replica per process)."""
    service = getattr(request.app.state, "service", None)
    if service is not None:
        service.refused("other", status)


@serve.deployment
@serve.ingress(http_app)
class Router:
    async def __init__(self, config: dict[str, Any], engines: dict[str, Any], engines_cores: list[int] | None = None) -> None:
        to_serve_logs()
        quiet_cancelled_requests()
        self.service = build_service(config, engines)
        http_app.state.service = self.service
        # Off the cores the engines' threads are bound to, where the host has others.
        cores = engines_cores if engines_cores is not None else engine_specs(self.service.config)[0].engines_cores
        keep_off_engine_cores(set(cores), "router replica")
        self.service.warm_up()
        self.service.start()
        http = self.service.config.router.http
        self.http = serve_openai(self.service, http.host, http.port) if http.port else None
        freeze_startup_heap("router replica")

    # ------------------------------------------------------------------ HTTP routes
    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await openai_call(self.service, "completions", request)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await openai_call(self.service, "chat", request)

    @http_app.post("/tokenize")
    async def tokenize_route(self, request: Request) -> Response:
        return await openai_call(self.service, "tokenize", request)

    @http_app.post("/detokenize")
    async def detokenize_route(self, request: Request) -> Response:
        return await openai_call(self.service, "detokenize", request)

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        return refused_client(self.service, "models", request) or self.service.models()

    @http_app.get("/health")
    async def health(self, request: Request) -> Response:
        return await self.service.health(told_details(self.service, request))

    @http_app.get("/pd/engines")
    async def engines(self, request: Request) -> Any:
        refused = refused_client(self.service, "engines", request, operator_too=True)
        if refused is not None:
            return refused
        return await self.service.engine_view(authorized_operator(self.service, request.headers.get("authorization")))

    # ------------------------------------------------------------------ handle API
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the events the HTTP API sends for this request (as dicts). Closed with this
        generator (Serve closes it when the caller goes), so the request is released at once."""
        async with contextlib.aclosing(self.service.generate(request)) as events:
            async for event in events:
                yield event

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The final response dict (or an OpenAI error body) for this request."""
        return await self.service.complete(request)

    async def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /tokenize: the prompt's (or conversation's) token ids, or an OpenAI error body."""
        return (await self.service.tokenizer_route("tokenize", request))[1]

    async def detokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /detokenize: the text of ``tokens``, or an OpenAI error body."""
        return (await self.service.tokenizer_route("detokenize", request))[1]

    async def engine_snapshot(self, refresh: bool = True) -> dict[str, Any]:
        return await self.service.engine_snapshot(refresh)

    def check_health(self) -> None:
        """Serve's health check: a replica whose own HTTP server has exited serves nothing on its
        port, and with one router replica the app is down while Serve counts it healthy."""
        http = getattr(self, "http", None)
        if http is not None and not http.serving and not getattr(self, "stopping", False):
            raise RuntimeError("the router's HTTP server stopped serving")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Client requests in progress on this replica: over its own HTTP server too, which
        Serve's default signal does not see (serve_app/config/autoscaling.py)."""
        return {CLIENT_REQUESTS: float(self.service.inflight)}

    async def __del__(self) -> None:
        """Serve awaits this when it stops the replica (a downscale, a redeploy): the HTTP server
        leaves new connections to the other replicas on its port (a redeploy starts them first:
        router.max_surge_percent), accepts those already queued, closes idle connections, and the
        responses in progress finish (uvicorn's graceful shutdown), up to the router's drain time;
        then the service stops. A coroutine function, not a function returning a coroutine as
        the engines' destructors are: Serve's ingress wrapper awaits the router's destructor only
        if it is one (Ray Serve 2.60 calls it and drops what it returns otherwise), and then
        reports the replica stopped, which the controller kills with its responses cut."""
        http = getattr(self, "http", None)
        self.stopping = True  # its server closes now: not a failed health check
        if http is not None:
            drain_s = self.service.config.router.graceful_shutdown_timeout_s - ROUTER_SHUTDOWN_MARGIN_S
            await http.stop(timeout_s=max(0.0, drain_s))
        self._stop_service()

    def _stop_service(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()
