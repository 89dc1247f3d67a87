"""Everything the router does, without Ray Serve.

``deployment.Router`` (the Serve ingress) is a thin shell whose HTTP routes and handle methods
delegate here, so the whole request path (parsing, sessions, attempts, framing, accounting) can be
driven in-process by fast tests with fake engine handles.

Every client request is accounted once, on every path out (success, error, client disconnect):
``_in_flight`` counts it in and, on exit, out, with the status it ended with.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.config.backends import BACKENDS
from serve_app.config.settings import AppConfig
from serve_app.router.balancer import every_line_at_least
from serve_app.router.cdcp import AttemptExecutor
from serve_app.router.choices import ChoicesSession
from serve_app.router.client_keys import ClientKeys
from serve_app.router.engine_client import EngineClient
from serve_app.router.errors import CLIENT_CLOSED, OpenAIError, bad_request, error_body, error_kind
from serve_app.router.framing import SSE_DONE, sse
from serve_app.router.leak_audit import Discrepancy, LeakAudit
from serve_app.router.membership import MEMBERSHIP, ReplicaInfo
from serve_app.router.output_parsers import cached_tokenizer, load_parser
from serve_app.router.parsing import (
    ClientHeaders,
    ModelContext,
    ParsedRequest,
    Route,
    check_strings,
    decode_json,
    parse_request,
    route_of,
)
from serve_app.router.pool import EnginePool, PrefixRouting
from serve_app.router.session import OFFLOAD_LOGPROB_ENTRIES, ResponseSession
from serve_app.router.text import token_piece
from serve_app.router.tokenization import TokenizerRoute, answer
from serve_app.runtime.metrics import RouterMetrics
from serve_app.wire.protocol import Role

logger = logging.getLogger("pd_serve.router")

# Bodies larger than this are parsed (validated, rendered, tokenized) in a worker thread: about a
# millisecond of tokenizing on the event loop, where every stream of the replica waits for it.
OFFLOAD_BYTES = 64 * 1024
# Chat requests with more messages than this are rendered in a worker thread whatever their size:
# a template's work can grow faster than its conversation (one that looks back over the messages
# for each message: a 64 KiB body holds a couple of thousand empty ones). Real conversations of
# this length are long bodies anyway.
OFFLOAD_MESSAGES = 64
# Completion requests with more prompts than this are tokenized in a worker thread whatever their
# size (each prompt is a tokenizer call and a sampling parameters' build and check).
MANY_PROMPTS = 8
# A /tokenize reply with more ids than this is encoded in a worker thread (about 10 ms of JSON).
LARGE_REPLY_TOKENS = 16 * 1024
PUBLIC_ENGINE_FIELDS = frozenset(
    {
        "role",
        "healthy",
        "draining",
        "router_inflight",
        "router_reserved_tokens",
        "engine_inflight",
        "engine_running",
        "engine_waiting",
        "kv_usage",
    }
)


@dataclass
class Outcome:
    """How a client request ended, for its accounting (a disconnect unless set otherwise)."""

    status: int = CLIENT_CLOSED


class SessionStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends: finished, client gone, or
    cancelled before its first chunk (when the body iterator never starts, no code inside it
    could release anything)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()

    async def stream_response(self, send: Any) -> None:
        """Starlette's, but the body's ``LastChunk`` ends the response in the same write (it sends
        an empty last body after the iterator instead: one more write per response)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            ended = isinstance(chunk, LastChunk)
            await send({"type": "http.response.body", "body": utf8(chunk), "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class LastChunk(str):
    """The last piece of a streamed body."""


def utf8(text: str) -> bytes:
    """A JSON text (or an SSE event of one) as UTF-8. A model can write a lone surrogate's escape
    (``"\\ud83d"``) in a tool call's arguments, which JSON parsing turns into a character UTF-8
    cannot encode: it is written as that escape again (valid JSON, as the model wrote it) instead
    of failing the response. Clients cannot send one (refused when parsed)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


class JSONReply(JSONResponse):
    """Starlette's JSONResponse (the same JSON), encoded by ``utf8``."""

    def render(self, content: Any) -> bytes:
        return utf8(json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")))


async def sse_body(
    session: ResponseSession | ChoicesSession,
    first: list[dict[str, Any]],
    batches: AsyncIterator[list[dict[str, Any]]],
    outcome: Outcome,
) -> AsyncIterator[str]:
    """One write per group of events that are ready together; the stream's last group, its
    usage chunk and ``[DONE]`` go in one write (every write costs the router a send through
    uvicorn and the client a read).

    An attempt reads what its engine has already sent without waiting on the event loop, so
    the items that queued up while the router was busy leave together, in the one write the
    in-replica server makes per loop iteration. The first chunk is never held for them: after
    it the stream gives the loop one turn, in which it is sent."""
    pending = first
    first_sent = False
    while True:
        if not session.finished:
            started = time.perf_counter()
            yield "".join(map(sse, pending))
            if not first_sent:  # the loop's turn in which the first chunk is sent
                first_sent = True
                await asyncio.sleep(0)
            session.client_wait_s += time.perf_counter() - started
            pending = []
        batch = await anext(batches, None)
        if batch is None:
            break
        pending += batch
    started = time.perf_counter()
    yield LastChunk("".join(map(sse, pending)) + SSE_DONE)
    session.client_wait_s += time.perf_counter() - started
    outcome.status = session.status


async def ended_by_an_error_event(
    session: ResponseSession | ChoicesSession, batches: AsyncIterator[list[dict[str, Any]]], route: Route
) -> AsyncIterator[list[dict[str, Any]]]:
    """The session's groups of events; a bug of ours raised while it streams ends the stream
    with a 500 error event, as vLLM's server ends its streams, instead of a connection cut
    without ``[DONE]`` or an exception raised into a handle caller. The session's own closing
    (aclosing) still releases its engines and leases. Not after the response is whole (a bug in
    what runs after its last group: the client keeps a complete answer, the bug is logged), and
    never in place of a cancellation (the client left; a bug in its clean-up is logged)."""
    whole = False  # the last group yielded finished the response
    async with contextlib.aclosing(batches):  # type: ignore[type-var]
        try:
            async for batch in batches:
                whole = session.finished
                yield batch
        except Exception:
            logger.exception("a streamed %s request failed", route)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            if whole:
                return
            session.status = 500
            yield [error_body("internal error while answering the request", 500)]


def reply_parsers(config: AppConfig, tokenizer: Any) -> dict[str, Any]:
    """vLLM's parsers of the model's replies, as ModelContext takes them: the tool-call parser
    (with the reasoning parser, if any, ahead of it) for tool_choice "auto", and for a named or
    required choice where its format is not vLLM's JSON (router/tools.py), and the reasoning
    parser alone for every other chat reply."""
    reasoning, reasoning_plugin = config.reasoning_parser
    router = config.router
    if not reasoning and not router.tool_call_parser:
        return {}
    cached = cached_tokenizer(tokenizer)
    common = {"reasoning": reasoning, "reasoning_plugin": reasoning_plugin, "model_name": config.model}
    return {
        "tool_parser": load_parser(cached, tool=router.tool_call_parser, tool_plugin=router.tool_parser_plugin, **common)
        if router.tool_call_parser
        else None,
        "reasoning_parser": load_parser(cached, **common) if reasoning else None,
        "parser_tokenizer": cached,
    }


class RouterService:
    def __init__(
        self,
        config: AppConfig,
        engines: dict[str, tuple[Role, Any]],
        *,
        tokenizer: Any,
        vocab_size: int,
        metrics: RouterMetrics,
        replica_id: str = "router",
        pools: dict[Role, tuple[Any, Any]] | None = None,
        app_name: str = "",
        sampling_defaults: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
    ) -> None:
        """``engines``: engines given by name, one handle each (the in-process tests); ``pools``:
        each role's deployment handles (for calls, for stats polls), whose replicas join and leave
        as Serve runs them."""
        self.config = config
        self.client_keys = ClientKeys.of(config.router.api_keys, os.environ)
        self.tokenizer = tokenizer
        self.ctx = ModelContext(
            name=config.model_name,
            aliases=frozenset({config.model}),
            max_model_len=config.max_model_len,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            trust_request_chat_template=config.router.trust_request_chat_template,
            priority_scheduling=config.priority_scheduling,
            sampling_defaults=dict(sampling_defaults or {}),
            max_tokens_cap=max_tokens_cap,
            max_choices=config.router.max_choices,
            max_body_bytes=config.router.http.max_body_bytes,
            **reply_parsers(config, tokenizer),
        )
        self.metrics = metrics
        audit = LeakAudit(
            warn_after_s=config.router.leak_warn_after_s,
            sole_router=not config.router.autoscaled and config.router.initial_replicas == 1,
            report=self._report_leaks,
        )
        prefix = None
        if config.router.balancer == "prefix":
            prefix = PrefixRouting(block_tokens=config.prefix_block_tokens, max_imbalance=config.router.prefix.max_imbalance)
        self.pool = EnginePool(
            engines,
            audit=audit,
            client=EngineClient() if config.router.engine_transport == "http" else None,
            prefix=prefix,
            pick_at_random=config.router.balancer == "random",
        )
        self.pool.on_prefix_choice = lambda role, engine, tokens: metrics.prefix_routed.inc(tokens, tags={"role": role, "engine": engine})
        self.pool.on_drained = self._report_pool
        self.pools = pools or {}
        self.app_name = app_name
        self._unsubscribe: list[Callable[[], None]] = []
        self.executor = AttemptExecutor(self.pool, config.router.timeouts, metrics, BACKENDS[config.backend].kv_ready_checks)
        self.replica_id = replica_id
        self.inflight = 0
        self._token_texts: dict[int, str] = {}
        self._poller: asyncio.Task | None = None
        self._joined: set[asyncio.Task] = set()  # first stats polls of joining replicas

    def warm_up(self) -> None:
        """Load, at start, what the first request would otherwise wait for: vLLM's protocol
        modules (seconds to import), the chat template, the response models and what a token's
        text for logprobs needs."""
        from serve_app.router.framing import ResponseFramer

        for route, body in (("completions", {"prompt": "warm up"}), ("chat", {"messages": [{"role": "user", "content": "hi"}]})):
            parsed = parse_request(route, body, self.ctx)  # type: ignore[arg-type]
            framer = ResponseFramer(parsed, self._token_text)
            framer.usage_chunk(1, 1)
            framer.final(text="", token_ids=[], logprobs=None, finish_reason="length", stop_reason=None, prompt_tokens=1)
        error_body("warm up", 400)
        self.models()
        self._token_text(0)  # vLLM reads the tokenizer's space marker once (its whole JSON: ms for a large vocabulary)

    def start(self) -> None:
        """Follow the pools' membership, and poll the engines' stats in the background (the
        balancer's load and health); a replica that joins is polled at once, so it takes work
        as soon as its first stats answer."""
        loop = asyncio.get_running_loop()
        def poll_joined(name: str) -> None:
            task = loop.create_task(self.pool.refresh([name]))
            self._joined.add(task)
            task.add_done_callback(self._joined.discard)

        self.pool.on_joined = poll_joined
        for role, handles in self.pools.items():
            self.pool.attach(role, *handles)
            self._unsubscribe.append(MEMBERSHIP.subscribe(self.app_name, role, functools.partial(self.on_replicas, role)))
        self._poller = loop.create_task(self.pool.poll_forever(self.config.router.stats_interval_s))

    def on_replicas(self, role: Role, running: list[ReplicaInfo], publisher: str = "") -> None:
        """Serve's latest list of ``role``'s replicas, as one of the process's request routers
        has it: the pool follows it, and the gauge says how many of them the router can now choose."""
        self.pool.update(role, running, publisher)
        self._report_pool(role)

    def _report_pool(self, role: Role) -> None:
        """The gauge follows a drain as soon as this router learns of it (an engine that answered
        that it is leaving, before Serve's list says so)."""
        self.metrics.pool_replicas.set(self.pool.choosable(role), tags={"role": role})

    def stop(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        if self._poller is not None:
            self._poller.cancel()
        if self.pool.client is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: the process is ending anyway
                asyncio.get_running_loop().create_task(self.pool.client.close())

    # ------------------------------------------------------------------ HTTP
    async def http(self, route: Route | TokenizerRoute, raw_body: bytes, headers: ClientHeaders | None = None) -> Response:
        """A /v1/completions or /v1/chat/completions request, answered as the OpenAI API does (or
        one of vLLM's /tokenize and /detokenize); ``headers``: what its headers say of it."""
        if route == "tokenize" or route == "detokenize":
            status, reply = await self.tokenizer_route(route, raw_body)
            if reply.get("count", 0) > LARGE_REPLY_TOKENS or len(reply.get("prompt", "")) > OFFLOAD_BYTES:
                return await asyncio.to_thread(JSONResponse, reply, status)  # encoded off the event loop too
            return JSONResponse(reply, status)
        received = time.monotonic()
        parsed = await self._parsed_or_error(route, self._parse(route, raw_body, headers))
        if isinstance(parsed, tuple):
            return JSONResponse(parsed[1], parsed[0])
        if not parsed.stream:
            status, body = await self._final(parsed, received)
            if sum(choice.prompt_logprob_entries for choice in parsed.choices) > OFFLOAD_LOGPROB_ENTRIES:
                return await asyncio.to_thread(JSONReply, body, status)  # encoded off the event loop too
            return JSONReply(body, status)
        session = self._session(parsed, received)
        batches = ended_by_an_error_event(session, session.event_batches(), route)
        stack = AsyncExitStack()
        outcome = stack.enter_context(self._in_flight(route, session))
        stack.push_async_callback(batches.aclose)  # type: ignore[attr-defined]
        try:
            first = await anext(batches)
        except BaseException:
            await stack.aclose()
            raise
        if "error" in first[0]:
            # Nothing was sent yet: a plain error response with the failure's status.
            outcome.status = session.status
            await stack.aclose()
            return JSONReply(first[0], session.status)
        return SessionStreamingResponse(sse_body(session, first, batches, outcome), stack.aclose)

    async def _parsed_or_error(self, route: Route, parsing: Awaitable[ParsedRequest]) -> ParsedRequest | tuple[int, dict[str, Any]]:
        """The parsed request, or the status and OpenAI error body a bad one gets, counted: one
        answer for HTTP and the handle API alike, and never a raw exception to the caller."""
        try:
            return await parsing
        except OpenAIError as exc:
            status, body = exc.status, exc.body()
        except Exception:  # a bug of ours, not the client's: log it, answer in OpenAI form
            logger.exception("could not parse a %s request", route)
            status, body = 500, error_body("internal error while reading the request", 500)
        self._count(route, status)
        return status, body

    def models(self) -> dict[str, Any]:
        from serve_app.runtime.compat import ModelCard, ModelList

        card = ModelCard(id=self.ctx.name, root=self.config.model, owned_by="pd-serve", max_model_len=self.ctx.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json", exclude_none=True)

    async def health(self, details: bool = True) -> Response:
        """200 when at least one decode engine is healthy (prefill is optional: colocated fallback);
        otherwise 503, with ``details`` saying why each decode engine is not (what Serve reports
        of its deployment, e.g. an engine that failed to start and the error it failed with: file
        paths, the model, addresses), which only a caller admitted to the other routes is told."""
        if self.pool.has_healthy("decode"):
            return JSONResponse({"status": "ok"})
        message = "no healthy decode engine"
        if not details:
            return JSONResponse(error_body(message, 503), 503)
        try:
            reasons = await self.engine_status()
        except Exception as exc:  # the status is a courtesy: never let it fail the health check
            reasons = {"status": f"unavailable ({exc!r})"}
        details = "; ".join(f"{name}: {why}" for name, why in reasons.items() if name in ("prefill", "decode", "status"))
        return JSONResponse(error_body(f"{message} ({details})" if details else message, 503), 503)

    async def engine_status(self) -> dict[str, str]:
        """Why engines are not serving, by name (the Serve deployment's status and message);
        set by the deployment, empty outside Serve."""
        return {}

    # ------------------------------------------------------------------ handle API
    async def _parse_handle(self, route: Route, request: Any, stream: bool) -> ParsedRequest:
        """A handle request read as the HTTP API reads its body: the same checks, the same
        size limit (what its JSON would weigh), the same errors."""
        if not isinstance(request, dict):
            raise bad_request("Request body must be a JSON object")
        body = request if stream else {k: v for k, v in request.items() if k != "stream_options"}
        size = check_strings(body)
        limit = self.config.router.http.max_body_bytes
        if size is not None and size > limit:
            raise OpenAIError(413, f"Request body of {size} bytes exceeds this server's limit of {limit} bytes")
        return await self._parse_body(route, {**body, "stream": stream}, size)

    async def _handle_request(self, request: Any, stream: bool) -> tuple[Route, ParsedRequest | dict[str, Any]]:
        """The route and the parsed request, or the error body a bad one gets (counted)."""
        route = route_of(request)
        parsed = await self._parsed_or_error(route, self._parse_handle(route, request, stream))
        return route, parsed[1] if isinstance(parsed, tuple) else parsed

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the events the HTTP API sends for this request (as dicts), whatever its
        ``stream`` field says; a bad request yields one error event."""
        received = time.monotonic()
        route, parsed = await self._handle_request(request, stream=True)
        if isinstance(parsed, dict):
            yield parsed
            return
        session = self._session(parsed, received)
        with self._in_flight(route, session) as outcome:
            events = ended_by_an_error_event(session, session.event_batches(), route)
            async with contextlib.aclosing(events) as batches:  # released however the caller leaves
                async for batch in batches:
                    for event in batch:  # a failure ends the stream with an error event
                        started = time.perf_counter()
                        yield event
                        session.client_wait_s += time.perf_counter() - started
            outcome.status = session.status

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The final response dict (or an OpenAI error body) for this request, non-streaming."""
        received = time.monotonic()
        _, parsed = await self._handle_request(request, stream=False)
        if isinstance(parsed, dict):
            return parsed
        _, response = await self._final(parsed, received)
        return response

    async def tokenizer_route(self, route: TokenizerRoute, body: Any) -> tuple[int, dict[str, Any]]:
        """``/tokenize`` or ``/detokenize`` (router/tokenization.py): the status and the body.
        ``body`` is the request's raw bytes (HTTP) or its object (the handle API); no engine is
        called. Off the event loop where ``_parse`` would take a completion off it."""
        limit = self.config.router.http.max_body_bytes
        try:
            if isinstance(body, bytes):
                size = len(body)
                if size <= OFFLOAD_BYTES:
                    body = decode_json(body)
            else:
                size = check_strings(body)
            if isinstance(body, bytes) or size is None or size > OFFLOAD_BYTES or self._heavy("chat", body):
                raw = body

                def work() -> dict[str, Any]:
                    return answer(route, decode_json(raw) if isinstance(raw, bytes) else raw, self.ctx, limit)

                reply = await asyncio.to_thread(work)
            else:
                reply = answer(route, body, self.ctx, limit)
            status = 200
        except OpenAIError as exc:
            status, reply = exc.status, exc.body()
        except Exception:  # a bug of ours, not the client's
            logger.exception("could not answer a %s request", route)
            status, reply = 500, error_body(f"internal error while answering a {route} request", 500)
        self._count(route, status)
        return status, reply

    async def engine_view(self, full: bool) -> dict[str, Any]:
        """``/pd/engines``: the whole snapshot for the operator; for anyone else, only what a
        client may see (names, roles, health, load), never engines' addresses, ports or records."""
        snapshot = await self.engine_snapshot()
        if full:
            return snapshot
        engines = {name: {k: v for k, v in engine.items() if k in PUBLIC_ENGINE_FIELDS} for name, engine in snapshot["engines"].items()}
        return {"router": snapshot["router"], "engines": engines}

    def refused(self, route: Route | Literal["other"], status: int) -> None:
        """Account a request refused before parsing (its body too large or too slow; ``other``:
        a path or method no route serves)."""
        self._count(route, status)

    async def engine_snapshot(self, refresh: bool = True) -> dict[str, Any]:
        """Router-side counters and every engine's last stats (tests and operators)."""
        if refresh:
            await self.pool.refresh()
        return {"router": {"replica": self.replica_id, "inflight": self.inflight}, "engines": self.pool.snapshot()}

    # ------------------------------------------------------------------ internals
    async def _parse(self, route: Route, raw: bytes, headers: ClientHeaders | None = None) -> ParsedRequest:
        """Parse on the event loop when it is cheap; a large body (tokenizing a long prompt, a
        chat template over long messages), a long conversation or a client's own template in a
        worker thread, so one request never stalls every stream of this replica."""
        if len(raw) > OFFLOAD_BYTES:
            return await asyncio.to_thread(lambda: parse_request(route, decode_json(raw), self.ctx, headers))
        body = decode_json(raw)  # at most OFFLOAD_BYTES: C-speed, microseconds
        if self._heavy(route, body):
            return await asyncio.to_thread(parse_request, route, body, self.ctx, headers)
        return parse_request(route, body, self.ctx, headers)

    async def _parse_body(self, route: Route, body: dict[str, Any], size: int | None) -> ParsedRequest:
        """The handle API's twin of ``_parse``: ``size`` is the body's size as JSON (None: unknown,
        so treated as large); the same thresholds, so a handle caller's long prompt never stalls
        the replica's streams either."""
        if size is None or size > OFFLOAD_BYTES or self._heavy(route, body):
            return await asyncio.to_thread(parse_request, route, body, self.ctx)
        return parse_request(route, body, self.ctx)

    def _heavy(self, route: Route, body: Any) -> bool:
        """Whether a small body's chat template, or its many prompts, could still cost more than a
        loop turn should."""
        if route != "chat":
            prompt = body.get("prompt") if isinstance(body, dict) else None
            return isinstance(prompt, list) and len(prompt) > MANY_PROMPTS and isinstance(prompt[0], (str, list))
        if self.ctx.trust_request_chat_template:
            return True
        messages = body.get("messages") if isinstance(body, dict) else None
        return isinstance(messages, list) and len(messages) > OFFLOAD_MESSAGES

    def _session(self, parsed: ParsedRequest, received_at: float | None = None) -> ResponseSession | ChoicesSession:
        """The request's session: one choice's, or a response of several choices'."""
        if parsed.others:
            return ChoicesSession(parsed, functools.partial(self._session, received_at=received_at), received_at)
        return ResponseSession(
            parsed,
            executor=self.executor,
            choose_disaggregated=self._choose_disaggregated,
            tokenizer=self.tokenizer,
            token_text=self._token_text,
            max_attempts=self.config.router.max_attempts,
            request_timeout_s=self.config.router.timeouts.request_s,
            metrics=self.metrics,
            received_at=received_at,
        )

    def _choose_disaggregated(self, prompt_tokens: int) -> bool:
        if self.config.router.mode != "disaggregated":
            return False
        if prompt_tokens <= self.config.router.local_prefill_max_tokens:
            self.metrics.fallback.inc(tags={"reason": "local_prefill"})
            return False
        if not self.pool.has_healthy("prefill"):
            self.metrics.fallback.inc(tags={"reason": "no_healthy_prefill"})
            return False
        bound = self.config.router.local_prefill_queue_tokens
        if bound and every_line_at_least(self.pool.of_role("prefill"), bound):
            self.metrics.fallback.inc(tags={"reason": "prefill_queue"})
            return False
        return True

    def _token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (text.token_piece); cached: the vocabulary is finite."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = token_piece(self.tokenizer, token_id)
        return text

    async def _final(self, parsed: ParsedRequest, received_at: float | None = None) -> tuple[int, dict[str, Any]]:
        session = self._session(parsed, received_at)
        with self._in_flight(parsed.route, session) as outcome:
            try:
                status, body = await session.final_response()
            except Exception:  # a bug of ours: an OpenAI error, as vLLM's server answers, not Starlette's text
                logger.exception("a %s request failed", parsed.route)
                status, body = 500, error_body("internal error while answering the request", 500)
            outcome.status = status
            return status, body

    @contextmanager
    def _in_flight(self, route: Route, session: ResponseSession | ChoicesSession | None = None) -> Iterator[Outcome]:
        outcome = Outcome()
        self._track(+1)
        try:
            yield outcome
        finally:
            self._track(-1)
            self._count(route, outcome.status)
            if session is not None:
                session.observe_times()
            if outcome.status == CLIENT_CLOSED:
                logger.info("a %s request ended: the client went away", route)

    def _report_leaks(self, engine: str, found: Discrepancy) -> None:
        self.metrics.leak_requests.set(found.requests, tags={"engine": engine})
        self.metrics.leak_kv_tokens.set(found.kv_tokens, tags={"engine": engine})

    def _track(self, change: int) -> None:
        self.inflight += change
        self.metrics.router_inflight.set(self.inflight, tags={"role": "router", "engine": self.replica_id})

    def _count(self, route: str, status: int) -> None:
        self.metrics.requests.inc(tags={"route": route, "status": str(status)})
        if status >= 400:
            self.metrics.errors.inc(tags={"kind": error_kind(status)})
