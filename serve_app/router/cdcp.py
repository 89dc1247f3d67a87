"""One attempt of the decode-first (CDCP) schedule, over the engines' own HTTP endpoints or Serve handles.

Disaggregated (docs/design.md, "One attempt, decode first"):
  1. pick a decode engine and open its stream with ``do_remote_prefill``; its replica fills in
     the metaserver URL of its own relay;
  2. the stream's first event is ``KVReady(params)``: the decode engine holds blocks for the
     prompt and its connector posted their ids. The router checks that the parameters name the
     engine it chose (engine id, KV host and port), so nothing else can redirect the push;
  3. pick a prefill engine and call ``run`` with those parameters (only the keys a prefill
     connector reads); it pushes the KV layer by layer;
  4. the decode stream continues with tokens, sampled by the decode engine itself.
Colocated: step 1 without ``do_remote_prefill``, then tokens.

Every wait has a deadline, and leaving the attempt by any path (finish, retry, failure, timeout,
client disconnect) cancels the decode stream and the prefill call, which aborts their engine
requests and frees their KV blocks, and gives back the router's load leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from serve_app.config.settings import TimeoutsConfig
from serve_app.router.attempt_phase import WAITING_FOR, AttemptPhase, PhaseEvent, advance, allowed, prefill_running
from serve_app.router.balancer import EngineLoad
from serve_app.router.engine_client import EngineCallFailed, EngineUnreachable
from serve_app.router.pool import EnginePool
from serve_app.router.recompute import AttemptPlan
from serve_app.runtime.logs import attempt_log_level
from serve_app.runtime.metrics import RouterMetrics
from serve_app.wire.protocol import MOVED as MOVED_STOP
from serve_app.wire.protocol import (
    NO_TAGS,
    EngineRejected,
    EngineRequest,
    KVEndpoint,
    KVReady,
    PrefillResult,
    RequestTags,
    Role,
    TokenDelta,
)
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS, encode_sampling

logger = logging.getLogger("pd_serve.router")

ENGINE_WAIT_POLL_S = 0.2
# A prefill engine Serve is stopping finishes its pushes in progress: the attempt waits this long
# (within its deadlines) for its prefill call, then resumes elsewhere as a move (a replica that
# died instead never answers a call pinned to it over Serve's handles).
PREFILL_LEAVING_GRACE_S = 5.0

# The KVReady keys a prefill engine's connector reads (vllm-ascend's MooncakeLayerwiseConnector
# and ours); anything else a callback carried stays with the router.
PREFILL_KV_KEYS = frozenset(
    {
        "token_ids",
        "request_id",
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_block_size",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "remote_tp_size",
        "remote_pcp_size",
        "remote_dcp_size",
        "remote_cached_tokens",
        "transfer_secret",
    }
)

@dataclass
class KVReadyEvent:
    params: dict[str, Any]
    engine: str


@dataclass
class PrefillStartedEvent:
    """The prefill call went out: the engine has served the request even if decode finishes
    before the call returns (a short answer) and the call is cancelled."""

    engine: str


@dataclass
class PrefillDoneEvent:
    engine: str
    result: PrefillResult | None = None


@dataclass
class DeltaEvent:
    delta: TokenDelta
    engine: str


@dataclass
class AttemptFailed:
    # What the client reads if this failure ends the response: the kind of failure only. No engine
    # names, addresses, secrets or engine-side exception text: those are the operator's, in
    # ``detail`` (and ``engine``), which only the router's log line shows.
    reason: str
    retryable: bool
    engine: str | None = None
    status: int = 500  # HTTP status if this failure ends the response
    kind: str = "engine"  # metrics: pd_errors_total{kind}
    detail: str = ""  # for the router's log only


def failure_of(role: str, exc: BaseException) -> tuple[str, str]:
    """(what a client may read, what the log may read) of an engine call's error.

    The client gets the kind of failure: whether the engine could not be reached or its call
    failed, or, for any other error (Ray's), its class. The log gets the description: pd-serve's
    own transport errors are written to be logged (engine_client.py: a class and a short reason,
    never a URL or the call's headers); anything else is cut short (Ray's errors name nodes,
    actors and processes, which the operator may read and a client may not)."""
    if isinstance(exc, EngineUnreachable):
        return f"the {role} engine could not be reached", str(exc)
    if isinstance(exc, EngineCallFailed):
        return f"the {role} engine's call failed", str(exc)
    return f"the {role} engine's call failed ({type(exc).__name__})", str(exc)[:1000]


AttemptEvent = KVReadyEvent | PrefillStartedEvent | PrefillDoneEvent | DeltaEvent | AttemptFailed

# The kind of an AttemptFailed that is a move, not a failure: an engine of the attempt (decode, or
# prefill before it took the prompt) is being stopped.
MOVED = "moved"
# What ``_read_stream`` returns when the decode engine left while the read waited.
_LEFT = object()


def engine_gone(exc: BaseException) -> bool:
    """Errors that mean the replica itself is gone (Serve restarts it), not a bad request."""
    import ray.exceptions

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineUnreachable))


def kv_ready_mismatch(params: dict[str, Any], endpoint: KVEndpoint | None, checks: Collection[str]) -> str | None:
    """Why a KVReady does not come from the decode engine it should (None when it does)."""
    if endpoint is None:
        return "the decode engine has not reported its KV endpoint yet"
    engine_id = str(params.get("remote_engine_id", ""))
    if "engine_id" in checks and engine_id != endpoint.engine_id and not engine_id.startswith(endpoint.engine_id + "-"):
        return f"remote_engine_id {engine_id!r} is not {endpoint.engine_id!r}"
    if "host" in checks and params.get("remote_host") != endpoint.host:
        return f"remote_host {params.get('remote_host')!r} is not {endpoint.host!r}"
    if "port" in checks and str(params.get("remote_port")) != str(endpoint.port):
        return f"remote_port {params.get('remote_port')!r} is not {endpoint.port}"
    return None


class AttemptExecutor:
    def __init__(
        self,
        pool: EnginePool,
        timeouts: TimeoutsConfig,
        metrics: RouterMetrics,
        kv_ready_checks: Collection[str] = ("engine_id", "host", "port"),
    ) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.metrics = metrics
        self.kv_ready_checks = frozenset(kv_ready_checks)

    async def run(
        self,
        plan: AttemptPlan,
        params_template: Any,
        request_deadline: float | None = None,
        tags: RequestTags = NO_TAGS,
    ) -> AsyncIterator[AttemptEvent]:
        """The attempt's events, ending with its last token or an ``AttemptFailed``. Past
        ``request_deadline`` (monotonic) it fails for good: the client's whole request is over.
        ``tags`` go to the engines; the client's ``cache_salt`` into the prefix keys too."""
        if past(request_deadline):  # an attempt retried at the deadline: no engine is asked
            yield request_timed_out()
            return
        # The prompt's prefix blocks, once for both choices (router.balancer: prefix).
        keys = self.pool.prefix_keys(plan.prompt_token_ids, tags.cache_salt)
        wait_s = None if request_deadline is None else max(0.0, request_deadline - time.monotonic())
        decode = await self.pick("decode", plan.avoid, keys, len(plan.prompt_token_ids) + plan.max_tokens, wait_s=wait_s)
        if decode is None:
            if past(request_deadline):
                yield request_timed_out()
            else:
                yield AttemptFailed("no decode engine is available", retryable=False, status=503, kind="no_engine")
            return
        params = params_template.clone()
        params.max_tokens = plan.max_tokens
        params.min_tokens = plan.min_tokens
        if plan.resumed_output_tokens:
            # So the decode engine's penalties count the earlier attempts' output as output.
            params.extra_args = {**(params.extra_args or {}), RESUMED_OUTPUT_TOKENS: plan.resumed_output_tokens}
        encoded = encode_sampling(params)
        kv_params = None
        if plan.disaggregated:
            # The decode replica adds the URL of its own metaserver relay.
            kv_params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": plan.attempt_id}
        request = EngineRequest(plan.attempt_id, plan.prompt_token_ids, encoded, kv_params, **tags.decode())
        reserved = len(plan.prompt_token_ids) + plan.max_tokens
        with self.pool.lease(decode.name, reserved):
            stream = self.pool.open_stream(decode.name, request)
            attempt = AttemptRun(self, plan, decode.name, stream, request_deadline, keys, tags)
            try:
                with self.pool.watch(decode.name, attempt.decode_leaving):
                    async for event in attempt.events():
                        yield event
            finally:
                await attempt.close()

    async def pick(
        self,
        role: Role,
        avoid: frozenset[str],
        prefix_keys: list[int] | None = None,
        request_load: int = 0,
        wait_s: float | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> EngineLoad | None:
        """An engine of ``role``; while none is healthy (restarting), wait up to kv_ready_s (or
        ``wait_s``, if less: what is left of the caller's deadlines), or until ``give_up()``."""
        wait = self.timeouts.kv_ready_s if wait_s is None else min(wait_s, self.timeouts.kv_ready_s)
        deadline = time.monotonic() + wait
        while True:
            load = self.pool.pick(role, avoid, prefix_keys, request_load)
            if load is not None or time.monotonic() >= deadline or (give_up is not None and give_up()):
                return load
            await asyncio.sleep(ENGINE_WAIT_POLL_S)
            # A poll of a hung engine takes its whole stats timeout: never past the deadline.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self.pool.refresh()


def past(deadline: float | None) -> bool:
    """Whether a monotonic deadline (None: none) has passed."""
    return deadline is not None and time.monotonic() >= deadline


def request_timed_out() -> AttemptFailed:
    """The client's whole request is over (``router.timeouts.request_s``): no attempt follows."""
    return AttemptFailed("the request timed out", False, None, 504, "request_timeout")


class AttemptRun:
    """The moving parts of one attempt: the decode stream, the prefill call, the deadlines."""

    def __init__(
        self,
        executor: AttemptExecutor,
        plan: AttemptPlan,
        decode: str,
        stream: Any,
        request_deadline: float | None = None,
        prefix_keys: list[int] | None = None,
        tags: RequestTags = NO_TAGS,
    ) -> None:
        self.executor = executor
        self.prefix_keys = prefix_keys
        self.tags = tags
        self.request_deadline = request_deadline
        self.plan = plan
        self.decode = decode
        self.stream = stream
        self.prefill_lease = ExitStack()
        self.prefill: str | None = None
        self.prefill_task: asyncio.Task | None = None
        self.prefill_call: Any = None  # the started call itself: cancelled on close even if its task never ran
        self.next_item: asyncio.Future | None = None
        self.started = time.monotonic()
        self.prefill_started = 0.0
        self.decode_answered = False  # the decode engine's first item came (its call went through)
        # The phase and its deadline move only through ``_advance`` (router/attempt_phase.py).
        self.phase = AttemptPhase.STARTING
        self.deadline: float | None = None
        self._advance(PhaseEvent.OPEN_DISAGGREGATED if plan.disaggregated else PhaseEvent.OPEN_COLOCATED)
        # Set when Serve starts stopping the decode engine (the pool's ``watch``): the attempt
        # ends at once, as a move, and the request resumes on another decode engine.
        self.leaving = False
        # When the prefill engine's grace ends, if it began leaving during its call (a deadline of
        # its own beside the phase's: which one passes first says whether it was a move).
        self.prefill_grace_end: float | None = None
        self._read_scope: asyncio.Timeout | None = None
        self._wake: asyncio.Future | None = None

    def _advance(self, event: PhaseEvent) -> None:
        self.phase, self.deadline = advance(self.phase, event, self.deadline, time.monotonic(), self.executor.timeouts)

    def _protocol_error(self, problem: str) -> AttemptFailed:
        logger.warning("attempt %s: the decode engine broke the protocol: %s", self.plan.attempt_id, problem)
        return AttemptFailed("the decode engine broke the protocol", True, self.decode, 502, "protocol", problem)

    def decode_leaving(self) -> None:
        """The decode engine is leaving: wake whatever wait the attempt is in."""
        self.leaving = True
        if self._read_scope is not None and not self._read_scope.expired():
            self._read_scope.reschedule(asyncio.get_running_loop().time())
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def prefill_leaving(self) -> None:
        """The prefill engine is leaving while its call runs: the call gets a short grace."""
        if self.prefill_task is None or self.prefill_task.done():
            return
        self.prefill_grace_end = time.monotonic() + PREFILL_LEAVING_GRACE_S
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)  # the wait looks again, with the shorter deadline

    def _moved(self) -> AttemptFailed:
        return AttemptFailed("the decode engine was stopped", True, self.decode, 503, MOVED)

    def _prefill_moved(self) -> AttemptFailed:
        return AttemptFailed("the prefill engine was stopped", True, self.prefill, 503, MOVED)

    async def events(self) -> AsyncIterator[AttemptEvent]:
        while True:
            if self.leaving:
                yield self._moved()
                return
            if self.prefill_task is None and self.next_item is None:
                read = await self._read_stream()
                if read is _LEFT:
                    yield self._moved()
                    return
                if read is None:
                    yield self._timed_out()
                    return
            else:
                # A prefill call is running: whichever of it and the stream's next item comes
                # first. The stream's read is a task of its own here, kept across iterations.
                if self.next_item is None:
                    self.next_item = asyncio.ensure_future(self.stream.__anext__())
                if self._wake is None:
                    self._wake = asyncio.get_running_loop().create_future()
                waiting: set[asyncio.Future] = {self.next_item, self._wake}
                if self.prefill_task is not None:
                    waiting.add(self.prefill_task)
                done, _ = await asyncio.wait(waiting, timeout=self._time_left(), return_when=asyncio.FIRST_COMPLETED)
                if self.leaving:
                    yield self._moved()
                    return
                if not done:
                    if self.phase is AttemptPhase.PREFILL_ENDING and not past(self.request_deadline):
                        yield self._let_prefill_go("outlived its deadline" if self.prefill_grace_end is None else "is leaving")
                        continue
                    if self._prefill_grace_passed_first() and not past(self.request_deadline):
                        yield self._prefill_moved()
                    else:
                        yield self._timed_out()
                    return
                if self._wake in done:
                    self._wake = None  # woken by the prefill engine leaving: a fresh one for the next wait
                if self.prefill_task is not None and self.prefill_task in done and not self._token_first(done):
                    event = self._prefill_outcome()
                    yield event
                    if isinstance(event, AttemptFailed):
                        return
                if self.next_item not in done:
                    continue
                future, self.next_item = self.next_item, None
                read = _outcome_of(future)
            async for event in self._decode_item(*read):
                yield event
                if isinstance(event, AttemptFailed) or (isinstance(event, DeltaEvent) and event.delta.finish_reason):
                    return

    async def _read_stream(self) -> tuple[Any, BaseException | None] | object | None:
        """The stream's next item, or the error that ended it; None once a deadline has passed.

        With no prefill call to race, the stream is read here, in the attempt's own task, not
        through a task and an ``asyncio.wait`` per item, a cost the router would pay on every
        streamed item. Items the engine sent while the router was busy are then read
        without a turn of the event loop between them, so their chunks leave in one write
        (``service.sse_body`` lets the first one go alone). A cancellation (the client gone)
        goes through the read into the stream, as it would into a read's task; ``close``
        cancels the stream either way. The read's timeout scope is also how ``decode_leaving``
        wakes it (``_LEFT``)."""
        left = self._time_left()
        try:
            async with asyncio.timeout(left) as scope:
                self._read_scope = scope
                return await self.stream.__anext__(), None
        except Exception as exc:  # StopAsyncIteration too: the stream ended
            if self.leaving:
                return _LEFT
            if scope.expired():
                return None
            return None, exc
        finally:
            self._read_scope = None

    def _prefill_grace_passed_first(self) -> bool:
        """The prefill engine left during its call and its grace, not the phase's deadline, ran out."""
        grace = self.prefill_grace_end
        return grace is not None and self.prefill_task is not None and (self.deadline is None or grace <= self.deadline)

    def _let_prefill_go(self, why: str) -> PrefillDoneEvent:
        """Tokens flow, so the prompt's KV is whole on the decode engine: a prefill call that
        outlives its deadline, whose engine is leaving or that fails now (only its last
        acknowledgements were left) no longer matters to this attempt. Its call is cancelled
        and its lease released, and the stream decodes on (its KV stays where it is)."""
        task, self.prefill_task = self.prefill_task, None
        if task is not None:
            if not task.done():
                task.cancel()
                if self.prefill_call is not None:
                    self.prefill_call.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its outcome no longer matters
        logger.info("attempt %s: the prefill call on %s %s after its push; decoding on", self.plan.attempt_id, self.prefill, why)
        if self.prefill is not None:
            self.executor.pool.call_succeeded(self.prefill)  # its push went through
        self.prefill_grace_end = None
        self.prefill_lease.close()
        self._advance(PhaseEvent.PREFILL_DONE)
        return PrefillDoneEvent(self.prefill or "", None)

    def _time_left(self) -> float | None:
        """Seconds to the earliest of the phase's and the request's deadlines and a leaving
        prefill engine's grace (None: no deadline)."""
        grace = self.prefill_grace_end if self.prefill_task is not None else None
        deadlines = [d for d in (self.deadline, self.request_deadline, grace) if d is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _timed_out(self) -> AttemptFailed:
        if past(self.request_deadline):
            return request_timed_out()
        engine = self.prefill if prefill_running(self.phase) else self.decode
        return AttemptFailed(f"timed out waiting for {WAITING_FOR[self.phase]}", True, engine, 504, "timeout")

    def _token_first(self, done: set[asyncio.Future]) -> bool:
        """Whether the stream's item, ready in the same turn as a prefill call that failed, is read
        first: a token says the push went through, and the failure is then one of a call let go
        (read in the next turn), not the attempt's end."""
        item, task = self.next_item, self.prefill_task
        if item not in done or task is None or task.cancelled() or task.exception() is None:
            return False
        return not item.cancelled() and item.exception() is None and isinstance(item.result(), TokenDelta)

    def _prefill_outcome(self) -> AttemptEvent:
        task, self.prefill_task = self.prefill_task, None
        assert task is not None and self.prefill is not None
        exc = task.exception()
        if exc is not None:
            # (Once tokens flow its push went through: a call that breaks then says little of
            # its engine, and its stats still tell if it is gone.)
            if engine_gone(exc) and self.phase is not AttemptPhase.PREFILL_ENDING:
                self.executor.pool.mark_unhealthy(self.prefill)
            if self.phase is AttemptPhase.PREFILL_ENDING:
                self.prefill_task = task
                return self._let_prefill_go(f"failed ({type(exc).__name__})")
            if self.prefill_grace_end is not None:
                # Its engine is leaving (Serve stops it) and the call broke within the grace: a
                # move, as a decode stream that breaks while its engine leaves, not an attempt
                # counted against max_attempts.
                return self._prefill_moved()
            reason, detail = failure_of("prefill", exc)
            return AttemptFailed(reason, True, self.prefill, 502, "prefill", detail)
        if task.result().finish_reason == MOVED_STOP:
            # The prefill engine is being stopped and took nothing: choose it for nothing new, and
            # resume at once (before any token: the decode engine holds no KV yet) as a move.
            self.executor.pool.drain(self.prefill)
            return AttemptFailed("the prefill engine was stopped", True, self.prefill, 503, MOVED)
        self.executor.metrics.prefill.observe(time.monotonic() - self.prefill_started)
        self.executor.pool.call_succeeded(self.prefill)
        self.prefill_lease.close()  # its prompt is no longer queued on that engine
        self._advance(PhaseEvent.PREFILL_DONE)
        return PrefillDoneEvent(self.prefill, task.result())

    async def _decode_item(self, item: Any, error: BaseException | None) -> AsyncIterator[AttemptEvent]:
        if isinstance(error, StopAsyncIteration):
            yield AttemptFailed("the decode engine ended the stream early", True, self.decode, 502, "decode")
            return
        if error is not None:
            if engine_gone(error):
                self.executor.pool.mark_unhealthy(self.decode)
            reason, detail = failure_of("decode", error)
            yield AttemptFailed(reason, True, self.decode, 502, "decode", detail)
            return
        if not self.decode_answered:
            self.decode_answered = True
            self.executor.pool.call_succeeded(self.decode)
        if isinstance(item, KVReady):
            if not allowed(self.phase, PhaseEvent.KV_READY):  # a second one: never a second prefill
                yield self._protocol_error(f"a KVReady while {self.phase.value}")
                return
            self.executor.metrics.kv_ready.observe(time.monotonic() - self.started)
            problem = kv_ready_mismatch(item.params, self.executor.pool.kv_endpoint(self.decode), self.executor.kv_ready_checks)
            if problem is not None:
                logger.warning("attempt %s: KVReady rejected: %s", self.plan.attempt_id, problem)
                # The problem names KV hosts and ports: the log's, not the client's.
                yield AttemptFailed(
                    "the decode engine sent a KVReady for another engine",
                    True,
                    self.decode,
                    502,
                    "kv_ready_mismatch",
                    problem,
                )
                return
            yield KVReadyEvent(item.params, self.decode)
            prefill = await self.executor.pick(
                "prefill",
                self.plan.avoid,
                self.prefix_keys,
                len(self.plan.prompt_token_ids),
                wait_s=self._time_left(),
                give_up=lambda: self.leaving,
            )
            if self.leaving:  # the decode engine began stopping while no prefill engine was free
                yield self._moved()
                return
            if prefill is None:
                if past(self.request_deadline):
                    yield request_timed_out()
                else:
                    yield AttemptFailed("no prefill engine is available", True, None, 503, "no_engine")
                return
            self._start_prefill(prefill, item.params)
            yield PrefillStartedEvent(prefill.name)
        elif isinstance(item, EngineRejected):
            yield AttemptFailed(item.message, False, self.decode, 400, "rejected")
        elif isinstance(item, TokenDelta):
            if item.stop_reason == MOVED_STOP:
                # The engine is being stopped (it says so before Serve's list does): choose it
                # for nothing new.
                self.executor.pool.drain(self.decode)
            self._advance(PhaseEvent.TOKENS)  # every phase past the start takes tokens
            yield DeltaEvent(item, self.decode)

    def _start_prefill(self, prefill: EngineLoad, kv_params: dict[str, Any]) -> None:
        self.prefill = prefill.name
        self.prefill_started = time.monotonic()
        self._advance(PhaseEvent.KV_READY)
        params = {k: v for k, v in kv_params.items() if k in PREFILL_KV_KEYS}
        request = EngineRequest(self.plan.attempt_id, self.plan.prompt_token_ids, prefill_sampling_params(), params, **self.tags.prefill())
        self.prefill_lease.enter_context(self.executor.pool.lease(prefill.name, len(self.plan.prompt_token_ids)))
        self.prefill_lease.enter_context(self.executor.pool.watch(prefill.name, self.prefill_leaving))
        response = self.prefill_call = self.executor.pool.start_prefill(prefill.name, request)
        logger.log(
            attempt_log_level(self.plan.number),
            "attempt %s: KV ready on %s; prefill on %s pushes transfer %s",
            self.plan.attempt_id,
            self.decode,
            prefill.name,
            kv_params.get("request_id"),
            extra={
                "pd_request": self.plan.request_id,
                "pd_attempt": self.plan.attempt_id,
                "pd_decode": self.decode,
                "pd_prefill": prefill.name,
                "pd_transfer": kv_params.get("request_id"),
            },
        )

        async def call() -> Any:
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()
                raise

        self.prefill_task = asyncio.ensure_future(call())

    async def close(self) -> None:
        """Cancel whatever is still running; the engines abort and free those requests. Every
        cancelled wait is awaited, so no exception is left unretrieved (and logged) by asyncio;
        a cancellation of the caller's own during that wait still reaches it, after the rest is
        released."""
        if self._wake is not None and not self._wake.done():
            self._wake.cancel()
        futures = [f for f in (self.next_item, self.prefill_task) if f is not None]
        for future in futures:
            future.cancel()
        try:
            if self.prefill_task is not None and self.prefill_call is not None:
                self.prefill_call.cancel()  # its task may be cancelled before it ever ran
            pending = [f for f in futures if not f.done()]
            if pending:
                await asyncio.wait(pending)
        finally:
            for future in futures:
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: its outcome no longer matters
            self.prefill_lease.close()
            try:
                self.stream.cancel()
            except Exception:  # already finished
                pass


def _outcome_of(future: asyncio.Future) -> tuple[Any, BaseException | None]:
    """A finished read's (item, None), or (None, the error it raised)."""
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


@functools.cache
def prefill_sampling_params() -> bytes:
    """Prefill computes the prompt's KV; the one token it samples is discarded."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return encode_sampling(SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))
