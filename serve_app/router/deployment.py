"""The router: HTTP ingress (OpenAI API) and Python handle API. It owns no engine.

It validates and tokenizes each request once, then hands it to a ``ResponseSession`` that runs the
attempts. Errors before the first token get a proper HTTP status with an OpenAI error body; once
a stream has started, a failure ends it with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.config import load_config
from serve_app.engines.backends import engine_specs
from serve_app.metrics import router_metrics
from serve_app.router.cdcp import AttemptExecutor
from serve_app.router.framing import SSE_DONE, sse
from serve_app.router.openai import (
    ModelContext,
    OpenAIError,
    ParsedRequest,
    Route,
    decode_json,
    error_body,
    parse_request,
    route_of,
)
from serve_app.router.pool import EnginePool
from serve_app.router.session import ResponseSession

logger = logging.getLogger("pd_serve.router")

CLIENT_CLOSED = 499  # nginx's status for a client that went away; used in metrics only
ERROR_KINDS = {400: "invalid_request", 404: "not_found", CLIENT_CLOSED: "client_closed"}

http_app = FastAPI(title="pd-serve", docs_url=None, redoc_url=None)


# Module-level helpers sit above the class: serve.ingress pickles the class when it is decorated.
def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"router-{int(time.time())}"


@http_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), type="invalid_request_error", code=exc.status_code), exc.status_code)


@http_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), type="invalid_request_error", code=400), 400)


@serve.deployment
@serve.ingress(http_app)
class Router:
    def __init__(self, config: dict[str, Any], engines: dict[str, Any]) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.config = load_config(config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        try:
            vocab_size = int(AutoConfig.from_pretrained(self.config.model).vocab_size)
        except Exception:
            vocab_size = len(self.tokenizer)
        self.ctx = ModelContext(
            name=self.config.model_name,
            aliases=frozenset({self.config.model}),
            max_model_len=self.config.max_model_len,
            vocab_size=vocab_size,
            tokenizer=self.tokenizer,
        )
        roles = {spec.name: spec.role for spec in engine_specs(self.config)}
        self.pool = EnginePool({name: (roles[name], handle) for name, handle in engines.items()})
        self.metrics = router_metrics()
        self.executor = AttemptExecutor(self.pool, self.config.router.timeouts, self.metrics)
        self._inflight = 0
        self._token_texts: dict[int, str] = {}
        self._replica = _replica_id()
        self._poller = asyncio.get_event_loop().create_task(self.pool.poll_forever(self.config.router.stats_interval_s))

    # ------------------------------------------------------------------ HTTP routes
    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._http("completions", request)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._http("chat", request)

    @http_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=self.ctx.name, root=self.config.model, owned_by="pd-serve", max_model_len=self.ctx.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json", exclude_none=True)

    @http_app.get("/health")
    async def health(self) -> Response:
        """200 when at least one decode engine is healthy (prefill is optional: colocated fallback)."""
        if self.pool.has_healthy("decode"):
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("no healthy decode engine", type="service_unavailable", code=503), 503)

    @http_app.get("/pd/engines")
    async def engines(self) -> dict[str, Any]:
        return await self.engine_snapshot()

    # ------------------------------------------------------------------ handle API
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the events the HTTP API sends for this request (as dicts), whatever its
        ``stream`` field says; a bad request yields one error event."""
        route = route_of(request)
        try:
            parsed = parse_request(route, {**request, "stream": True}, self.ctx, self.config.debug_faults)
        except OpenAIError as exc:
            self._count(route, exc.status)
            yield exc.body()
            return
        session = self._session(parsed)
        status = CLIENT_CLOSED
        self._track(+1)
        try:
            async for event in session.stream_events():
                yield event
            status = session.status
        finally:
            self._track(-1)
            self._count(route, status)

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The final response dict (or an OpenAI error body) for this request, non-streaming."""
        route = route_of(request)
        body = {k: v for k, v in request.items() if k != "stream_options"}
        try:
            parsed = parse_request(route, {**body, "stream": False}, self.ctx, self.config.debug_faults)
        except OpenAIError as exc:
            self._count(route, exc.status)
            return exc.body()
        status, response = await self._final(parsed)
        return response

    async def engine_snapshot(self, refresh: bool = True) -> dict[str, Any]:
        """Router-side counters and every engine's last stats (tests and operators)."""
        if refresh:
            await self.pool.refresh()
        return {"router": {"replica": self._replica, "inflight": self._inflight}, "engines": self.pool.snapshot()}

    # ------------------------------------------------------------------ internals
    def _session(self, parsed: ParsedRequest) -> ResponseSession:
        return ResponseSession(
            parsed,
            executor=self.executor,
            choose_disaggregated=self._choose_disaggregated,
            tokenizer=self.tokenizer,
            token_text=self._token_text,
            max_attempts=self.config.router.max_attempts,
            request_timeout_s=self.config.router.timeouts.request_s,
            metrics=self.metrics,
        )

    def _choose_disaggregated(self) -> bool:
        if self.config.router.mode != "disaggregated":
            return False
        if self.pool.has_healthy("prefill"):
            return True
        self.metrics.fallback.inc(tags={"reason": "no_healthy_prefill"})
        return False

    def _token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (cached: the vocabulary is finite)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    async def _http(self, route: Route, request: Request) -> Response:
        try:
            parsed = parse_request(route, decode_json(await request.body()), self.ctx, self.config.debug_faults)
        except OpenAIError as exc:
            self._count(route, exc.status)
            return JSONResponse(exc.body(), exc.status)
        except Exception:  # a bug of ours, not the client's: log it, answer in OpenAI form
            logger.exception("could not parse a %s request", route)
            self._count(route, 500)
            return JSONResponse(error_body("internal error while reading the request", type="internal_error", code=500), 500)
        if not parsed.stream:
            status, body = await self._final(parsed)
            return JSONResponse(body, status)
        session = self._session(parsed)
        events = session.stream_events()
        self._track(+1)
        try:
            first = await anext(events)
        except BaseException:
            self._track(-1)
            self._count(route, CLIENT_CLOSED)
            await events.aclose()
            raise
        if "error" in first:
            # Nothing was sent yet: a plain error response with the failure's status.
            self._track(-1)
            self._count(route, session.status)
            await events.aclose()
            return JSONResponse(first, session.status)
        return StreamingResponse(self._sse(route, session, first, events), media_type="text/event-stream")

    async def _sse(
        self, route: Route, session: ResponseSession, first: dict[str, Any], events: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[str]:
        status = CLIENT_CLOSED
        try:
            yield sse(first)
            async for event in events:
                yield sse(event)
            yield SSE_DONE
            status = session.status
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            self._track(-1)
            self._count(route, status)

    async def _final(self, parsed: ParsedRequest) -> tuple[int, dict[str, Any]]:
        session = self._session(parsed)
        status = CLIENT_CLOSED
        self._track(+1)
        try:
            status, body = await session.final_response()
            return status, body
        finally:
            self._track(-1)
            self._count(parsed.route, status)

    def _track(self, change: int) -> None:
        self._inflight += change
        self.metrics.router_inflight.set(self._inflight, tags={"role": "router", "engine": self._replica})

    def _count(self, route: str, status: int) -> None:
        self.metrics.requests.inc(tags={"route": route, "status": str(status)})
        if status >= 400:
            self.metrics.errors.inc(tags={"kind": ERROR_KINDS.get(status, f"http_{status}")})
