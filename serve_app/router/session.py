"""One client request end to end: attempts through the executor, steps through the state
machine, and the client's events (stream chunks or one final response) out.

The HTTP routes and the handle API both sit on top of this, so both send the same events.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from serve_app.router.cdcp import (
    MOVED,
    AttemptEvent,
    AttemptExecutor,
    AttemptFailed,
    DeltaEvent,
    KVReadyEvent,
    PrefillDoneEvent,
    PrefillStartedEvent,
)
from serve_app.router.engine_client import one_line
from serve_app.router.errors import error_body
from serve_app.router.framing import ResponseFramer, usage
from serve_app.router.parsing import ParsedRequest
from serve_app.router.recompute import Action, Emission, RecomputeStateMachine, Step, repetition_check
from serve_app.router.text import DecodeTextStream, StopMatcher, piece_in_context
from serve_app.runtime.logs import attempt_log_level
from serve_app.runtime.metrics import RouterMetrics

logger = logging.getLogger("pd_serve.router")

# A reply whose logprobs have more entries than this (the prompt's, and a whole reply's output's)
# is framed in a worker thread: up to about 30 ms of the event loop, where every stream of the
# replica waits for it (an entry is about 0.5 µs; a multi-byte character's piece, read in
# context, up to 7 µs).
OFFLOAD_LOGPROB_ENTRIES = 4 * 1024


class ResponseSession:
    def __init__(
        self,
        request: ParsedRequest,
        *,
        executor: AttemptExecutor,
        choose_disaggregated: Callable[[int], bool],  # the attempt's prompt length -> disaggregated?
        tokenizer: Any,
        token_text: Callable[[int], str],
        max_attempts: int,
        request_timeout_s: float,
        metrics: RouterMetrics,
        received_at: float | None = None,
    ) -> None:
        self.request = request
        self.executor = executor
        self.choose_disaggregated = choose_disaggregated
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.machine = RecomputeStateMachine(
            request_id=request.engine_request_id,
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=request.max_tokens,
            max_attempts=max_attempts,
            text=DecodeTextStream(tokenizer, request.prompt_token_ids, request.skip_special_tokens, request.spaces_between_special_tokens),
            stops=StopMatcher(request.stops, request.include_stop_str_in_output),
            min_tokens=request.min_tokens,
            logprobs=request.logprobs is not None,
            repeats=repetition_check(request.sampling_params),
        )
        self.framer = ResponseFramer(request, token_text, functools.partial(piece_in_context, tokenizer))
        self.status = 200
        self._started = received_at if received_at is not None else time.monotonic()
        # Where the request's time went (``observe_times``): waiting on engines, and waiting on
        # the HTTP layer and the client to take a chunk (added by whoever sends the chunks).
        self.engine_wait_s = 0.0
        self.client_wait_s = 0.0
        self._engines: dict[str, None] = {}  # engines that served this request, in order
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        # Called once, at the first output token or at the end without one (router/choices.py:
        # a prompt's other samples wait for it, to find the prompt in the engines' prefix caches).
        self.on_first_token: Callable[[], None] | None = None
        self._without_prompt_logprobs: Any = None  # the parameters once the prompt's logprobs are in

    # ------------------------------------------------------------------ client-facing
    async def event_batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The stream's events, grouped as they become ready together: one step's chunks (chat:
        the role delta with the first text), and the usage chunk with the step that finishes the
        response, so that an HTTP stream sends each group in one write. Once a group leaves with
        ``finished`` set, what follows waits on no engine."""
        usage_due = self.request.include_usage
        async with aclosing(self.emissions()) as emissions:  # its attempt released on every way out
            async for emission in emissions:
                if emission.prompt_logprobs is not None and self.request.prompt_logprob_entries > OFFLOAD_LOGPROB_ENTRIES:
                    batch = await asyncio.to_thread(self.framer.chunks, emission)
                else:
                    batch = self.framer.chunks(emission)
                if self.request.continuous_usage:
                    self._add_usage(batch)
                if emission.error is not None:
                    batch.append(self._error(emission))
                    yield batch
                    return
                if usage_due and self.machine.finished:
                    usage_due = False
                    batch.append(self._usage_chunk())
                if batch:
                    yield batch
        if usage_due:
            yield [self._usage_chunk()]

    def _add_usage(self, chunks: list[dict[str, Any]]) -> None:
        """``continuous_usage_stats``: each chunk's usage so far, as vLLM's server counts it (a chat
        reply's role chunk before any output)."""
        m = self.machine
        reasoning = self.framer.reasoning_tokens(m.output_token_ids)
        for i, chunk in enumerate(chunks):
            opening = i < self.framer.opening_chunks
            so_far = usage(m.prompt_tokens, 0 if opening else m.completion_tokens, 0 if opening and reasoning is not None else reasoning)
            chunk["usage"] = so_far.model_dump(mode="json", exclude_none=True)

    def _usage_chunk(self) -> dict[str, Any]:
        m = self.machine
        return self.framer.usage_chunk(m.prompt_tokens, m.completion_tokens, self.framer.reasoning_tokens(m.output_token_ids))

    @property
    def finished(self) -> bool:
        """The response's outcome is decided: nothing it still sends waits on an engine."""
        return self.machine.finished

    async def final_response(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of a non-streaming request."""
        async with aclosing(self.emissions()) as emissions:
            async for emission in emissions:
                if emission.error is not None:
                    return emission.error_status, self._error(emission)
        m = self.machine
        final = functools.partial(
            self.framer.final,
            text=m.text,
            token_ids=m.output_token_ids,
            logprobs=m.output_logprobs if self.request.logprobs is not None else None,
            finish_reason=m.finish_reason,
            stop_reason=m.stop_reason,
            prompt_tokens=m.prompt_tokens,
            prompt_logprobs=m.prompt_logprobs,
        )
        output_entries = len(m.output_token_ids) * (self.request.logprobs + 1) if self.request.logprobs is not None else 0
        if self.request.prompt_logprob_entries + output_entries > OFFLOAD_LOGPROB_ENTRIES:
            return 200, await asyncio.to_thread(final)
        return 200, final()

    def _error(self, emission: Emission) -> dict[str, Any]:
        self.status = emission.error_status
        return error_body(emission.error or "internal error", emission.error_status)

    # ------------------------------------------------------------------ attempts
    async def emissions(self) -> AsyncIterator[Emission]:
        machine = self.machine
        deadline = self._started + self.request_timeout_s
        try:
            while not machine.finished:
                params, prompt_logprobs = self._attempt_params()
                # The prompt's logprobs are read where the prompt is computed: its decode engine.
                disaggregated = not prompt_logprobs and self.choose_disaggregated(machine.prompt_tokens + machine.completion_tokens)
                plan = machine.start_attempt(disaggregated)
                logger.log(
                    attempt_log_level(plan.number),
                    "request %s attempt %d/%d id=%s %s prompt=%d budget=%d",
                    machine.request_id,
                    plan.number,
                    machine.max_attempts,
                    plan.attempt_id,
                    "disaggregated" if plan.disaggregated else "colocated",
                    len(plan.prompt_token_ids),
                    plan.max_tokens,
                    extra={"pd_request": machine.request_id, "pd_attempt": plan.attempt_id},
                )
                step: Step | None = None
                # The attempt runs in this task (no wait_for around it): a cancellation, which
                # anyio delivers again at every await, then finds nothing half-running to close.
                async with aclosing(self.executor.run(plan, params, deadline, self.request.tags)) as events:
                    async for event in _EngineWaitClock(events, self):
                        step = self._step(event)
                        if step is None:
                            continue
                        if not step.emission.empty:
                            self._note_tokens(step.emission)
                            yield step.emission
                        if step.action is not Action.CONTINUE:
                            break
                if step is None or step.action is Action.CONTINUE:
                    step = machine.on_attempt_failed("the attempt ended without an outcome", retryable=True)
                    if not step.emission.empty:
                        yield step.emission
                self._note_outcome(plan.attempt_id, step)
        finally:
            self._first_token_done()
            self._observe_end()

    def _attempt_params(self) -> tuple[Any, bool]:
        """The next attempt's sampling parameters, and whether they ask for the prompt's logprobs:
        only until an attempt on the original prompt has given them (a resumed attempt's prompt
        holds earlier output)."""
        params = self.request.sampling_params
        if params.prompt_logprobs is None:
            return params, False
        machine = self.machine
        if machine.prompt_logprobs is None and not machine.output_token_ids:
            return params, True
        if self._without_prompt_logprobs is None:
            self._without_prompt_logprobs = params.clone()
            self._without_prompt_logprobs.prompt_logprobs = None
            self._without_prompt_logprobs.skip_reading_prefix_cache = False
        return self._without_prompt_logprobs, False

    def _step(self, event: AttemptEvent) -> Step | None:
        """The state machine's answer to the attempt's next event (None: nothing to answer)."""
        machine = self.machine
        match event:
            case KVReadyEvent() | PrefillDoneEvent():  # the attempt's own phases (cdcp.AttemptRun)
                return None
            case PrefillStartedEvent(engine=engine):  # always before its PrefillDoneEvent
                self._engines.setdefault(engine, None)
                return None
            case DeltaEvent(delta=delta, engine=engine):
                self._engines.setdefault(engine, None)
                step = machine.on_delta(delta, engine)
                if step.moved:
                    self._log_move(engine)
                return step
            case AttemptFailed(kind=kind) if kind == MOVED:  # not a failure: the request resumes on another decode engine
                self._log_move(event.engine)
                return machine.on_attempt_failed(event.reason, True, event.engine, event.status, moved=True)
            case AttemptFailed():
                return self._failed(event)
            case _:
                raise TypeError(f"not an attempt event: {event!r}")

    def _failed(self, event: AttemptFailed) -> Step:
        machine = self.machine
        self.metrics.errors.inc(tags={"kind": event.kind})
        # The log names the engine and the failure's detail (the operator's); the client, if this
        # ends its response, reads event.reason alone (cdcp.AttemptFailed).
        logger.warning(
            "request %s attempt %d failed%s: %s%s",
            machine.request_id,
            machine.attempts,
            f" on {event.engine}" if event.engine else "",
            one_line(event.reason, 1000),  # an engine's refusal of the request: vLLM's text
            f" ({one_line(event.detail, 1000)})" if event.detail else "",
            extra={"pd_request": machine.request_id, "pd_engine": event.engine, "pd_error": event.kind},
        )
        return machine.on_attempt_failed(event.reason, event.retryable, event.engine, event.status)

    def _log_move(self, engine: str | None) -> None:
        machine = self.machine
        logger.info(
            "request %s attempt %d moves off %s (Serve is stopping it) with %d output tokens so far",
            machine.request_id,
            machine.attempts,
            engine,
            machine.completion_tokens,
            extra={"pd_request": machine.request_id, "pd_engine": engine},
        )

    def _note_outcome(self, attempt_id: str, step: Step) -> None:
        if step.action is Action.RETRY:
            cause = "drain" if step.moved else "kv_full" if step.recomputed else "failure"
            self.metrics.migrations.inc(tags={"cause": cause, "engine": self.machine.last_engine or ""})
        if step.recomputed:
            self.metrics.recompute.inc()
            if step.wasted_tokens > 0:  # a Ray counter takes positive increments only
                self.metrics.wasted_tokens.inc(step.wasted_tokens)
        ids = {"pd_request": self.machine.request_id, "pd_attempt": attempt_id}
        if step.action is Action.RETRY:
            logger.info(
                "request %s attempt %s ended (%s) with %d output tokens so far; resuming",
                self.machine.request_id,
                attempt_id,
                "recomputed" if step.recomputed else "failed",
                self.machine.completion_tokens,
                extra={**ids, "pd_outcome": "recomputed" if step.recomputed else "failed"},
            )
        elif self.machine.finished:
            logger.info(
                "request %s finished after %d attempt(s) on %s: %d output tokens, %s",
                self.machine.request_id,
                self.machine.attempts,
                ", ".join(self._engines) or "no engine",
                self.machine.completion_tokens,
                self.machine.finish_reason or "error",
                extra={
                    **ids,
                    "pd_outcome": self.machine.finish_reason or "error",
                    "pd_attempts": self.machine.attempts,
                    "pd_engines": ",".join(self._engines),
                    # Every request's line goes to the replica's log file (and the dashboard)
                    # only: on stderr too it would cost the router a second formatted write per
                    # request, for a console that cannot be read at hundreds of lines a second.
                    "log_to_stderr": False,
                },
            )

    # ------------------------------------------------------------------ metrics
    def observe_times(self) -> None:
        observe_request_times(self.metrics, self.request.route, self._started, self.engine_wait_s, self.client_wait_s)

    def _note_tokens(self, emission: Emission) -> None:
        if emission.token_ids:
            now = time.monotonic()
            if self._first_token_at is None:
                self._first_token_at = now
                self.metrics.ttft.observe(now - self._started, tags={"route": self.request.route})
                self._first_token_done()
            self._last_token_at = now

    def _first_token_done(self) -> None:
        if self.on_first_token is not None:
            self.on_first_token, call = None, self.on_first_token
            call()

    def _observe_end(self) -> None:
        machine = self.machine
        self.metrics.attempts.observe(machine.attempts)
        n = machine.completion_tokens
        if n > 1 and self._first_token_at is not None and self._last_token_at is not None:
            self.metrics.tpot.observe((self._last_token_at - self._first_token_at) / (n - 1), tags={"route": self.request.route})


def observe_request_times(metrics: RouterMetrics, route: str, started: float, engine_wait_s: float, client_wait_s: float) -> None:
    """A client request's time, and the router's own share of it: what is left once the waits on
    engines and on the client are taken out (parsing, tokenizing, the state machine,
    detokenizing, framing)."""
    total = time.monotonic() - started
    metrics.request_time.observe(total, tags={"route": route})
    metrics.engine_wait.observe(engine_wait_s, tags={"route": route})
    metrics.router_time.observe(max(0.0, total - engine_wait_s - client_wait_s), tags={"route": route})


class _EngineWaitClock:
    """The attempt's events, timing how long each took to come (the router waiting on its
    engines). A plain iterator, not a generator: closing stays with the attempt's own."""

    def __init__(self, events: AsyncIterator[Any], session: ResponseSession) -> None:
        self._events = events
        self._session = session

    def __aiter__(self) -> _EngineWaitClock:
        return self

    async def __anext__(self) -> Any:
        started = time.perf_counter()
        try:
            return await self._events.__anext__()
        finally:
            self._session.engine_wait_s += time.perf_counter() - started
