"""One attempt of the decode-first (CDCP) schedule, executed through Serve handles.

Disaggregated (docs/design.md, "One attempt, decode first"):
  1. pick a decode engine and a prefill engine; draw a token for the attempt's callback URL on
     the prefill replica's metaserver relay;
  2. call both at once: the prefill replica waits at its relay (``run_on_kv_ready``), the decode
     engine gets ``do_remote_prefill`` with that URL as its metaserver;
  3. the decode engine allocates blocks for the prompt and its connector posts their ids to the
     relay; the prefill replica checks that the parameters name the decode engine the router
     chose (engine id, KV host and port, as that engine reported them), so nothing else can
     redirect the push, starts the prefill and reports ``KVReady``; it pushes the KV layer by
     layer and reports its ``PrefillResult``;
  4. the decode stream carries tokens, sampled by the decode engine itself.
Colocated: the decode call without ``do_remote_prefill``, then tokens.

Every wait has a deadline, and leaving the attempt by any path (finish, retry, failure, timeout,
client disconnect) cancels the decode stream and the prefill stream, which aborts their engine
requests and frees their KV blocks, and gives back the router's load leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Collection
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from serve_app.config import TimeoutsConfig
from serve_app.logs import attempt_log_level
from serve_app.metrics import RouterMetrics
from serve_app.protocol import EngineRejected, EngineRequest, KVReady, KVRefused, KVWait, PrefillResult, Role, TokenDelta
from serve_app.router.balancer import EngineLoad
from serve_app.router.pool import EnginePool
from serve_app.router.recompute import AttemptPlan, Phase
from serve_app.sampling import encode_sampling

logger = logging.getLogger("pd_serve.router")

ENGINE_WAIT_POLL_S = 0.2

# What the attempt waits for in each phase, for the timeout message.
WAITING_FOR = {
    Phase.AWAITING_KV: "KVReady",
    Phase.PREFILLING: "prefill",
    Phase.DECODING: "the first token",
}


@dataclass
class KVReadyEvent:
    params: dict[str, Any]
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
    reason: str
    retryable: bool
    engine: str | None = None
    status: int = 500  # HTTP status if this failure ends the response
    kind: str = "engine"  # metrics: pd_errors_total{kind}


AttemptEvent = KVReadyEvent | PrefillDoneEvent | DeltaEvent | AttemptFailed


def engine_gone(exc: BaseException) -> bool:
    """Errors that mean the replica itself is gone (Serve restarts it), not a bad request."""
    import ray.exceptions

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


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
        self.kv_ready_checks = tuple(kv_ready_checks)

    async def run(self, plan: AttemptPlan, params_template: Any, request_deadline: float | None = None) -> AsyncIterator[AttemptEvent]:
        """The attempt's events, ending with its last token or an ``AttemptFailed``. Past
        ``request_deadline`` (monotonic) it fails for good: the client's whole request is over."""
        decode = await self.pick("decode", plan.avoid)
        if decode is None:
            yield AttemptFailed("no decode engine is available", retryable=False, status=503, kind="no_engine")
            return
        prefill = None
        relay_url = None
        if plan.disaggregated:
            prefill = await self.pick("prefill", plan.avoid)
            if prefill is None:
                yield AttemptFailed("no prefill engine is available", True, None, 503, "no_engine")
                return
            relay_url = self.pool.relay_url(prefill.name)
            if relay_url is None:
                yield AttemptFailed(f"prefill engine {prefill.name} has not reported its relay yet", True, prefill.name, 503, "no_engine")
                return
        params = params_template.clone()
        params.max_tokens = plan.max_tokens
        params.min_tokens = plan.min_tokens
        encoded = encode_sampling(params)
        kv_params = None
        prefill_stream = None
        attempt: AttemptRun | None = None
        prefill_lease = ExitStack()  # given back as soon as the prefill's part is over
        try:
            if prefill is not None:
                # The callback URL's token is drawn here and travels only over Ray, to the two
                # engines of this attempt.
                token = secrets.token_urlsafe(24)
                kv_params = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "request_id": plan.attempt_id,
                    "metaserver": f"{relay_url}/{token}",
                }
                wait = KVWait(token, self.pool.kv_endpoint(decode.name), self.kv_ready_checks)
                prefill_request = EngineRequest(plan.attempt_id, plan.prompt_token_ids, prefill_sampling_params(), None)
                prefill_lease.enter_context(self.pool.lease(prefill.name, len(plan.prompt_token_ids)))
                # Called first: its wait is usually registered before the callback comes.
                prefill_stream = self.pool.stream_handles[prefill.name].run_on_kv_ready.remote(prefill_request, wait)
            request = EngineRequest(plan.attempt_id, plan.prompt_token_ids, encoded, kv_params)
            with self.pool.lease(decode.name, len(plan.prompt_token_ids) + plan.max_tokens):
                stream = self.pool.stream_handles[decode.name].generate.remote(request)
                attempt = AttemptRun(
                    self, plan, decode.name, stream, request_deadline, prefill.name if prefill else None, prefill_stream, prefill_lease
                )
                try:
                    async for event in attempt.events():
                        yield event
                finally:
                    await attempt.close()
        finally:
            prefill_lease.close()
            if attempt is None and prefill_stream is not None:
                with contextlib.suppress(Exception):
                    prefill_stream.cancel()

    async def pick(self, role: Role, avoid: frozenset[str]) -> EngineLoad | None:
        """An engine of ``role``; while none is healthy (restarting), wait up to kv_ready_s."""
        deadline = time.monotonic() + self.timeouts.kv_ready_s
        while True:
            load = self.pool.pick(role, avoid)
            if load is not None or time.monotonic() >= deadline:
                return load
            await asyncio.sleep(ENGINE_WAIT_POLL_S)
            await self.pool.refresh()


class AttemptRun:
    """The moving parts of one attempt: the decode stream, the prefill stream, the deadlines."""

    def __init__(
        self,
        executor: AttemptExecutor,
        plan: AttemptPlan,
        decode: str,
        stream: Any,
        request_deadline: float | None = None,
        prefill: str | None = None,
        prefill_stream: Any = None,
        prefill_lease: ExitStack | None = None,
    ) -> None:
        self.executor = executor
        self.request_deadline = request_deadline
        self.plan = plan
        self.decode = decode
        self.stream = stream
        self.prefill = prefill
        self.prefill_stream = prefill_stream
        # The prefill engine's lease, given back once its part is over (its prompt is no longer
        # queued there); the decode lease lasts the attempt (the caller's).
        self.prefill_lease = prefill_lease if prefill_lease is not None else ExitStack()
        self.next_item: asyncio.Future | None = None
        self.next_prefill: asyncio.Future | None = None
        self.started = time.monotonic()
        self.prefill_started = 0.0
        self.phase = Phase.AWAITING_KV if plan.disaggregated else Phase.DECODING
        timeouts = executor.timeouts
        self.deadline: float | None = self.started + (timeouts.kv_ready_s if plan.disaggregated else timeouts.first_token_s)

    def _next(self) -> None:
        self.next_item = asyncio.ensure_future(self.stream.__anext__())

    def _next_prefill(self) -> None:
        self.next_prefill = asyncio.ensure_future(self.prefill_stream.__anext__())

    async def events(self) -> AsyncIterator[AttemptEvent]:
        self._next()
        if self.prefill_stream is not None:
            self._next_prefill()
        while True:
            waiting: set[asyncio.Future] = {self.next_item}  # type: ignore[arg-type]
            if self.next_prefill is not None:
                waiting.add(self.next_prefill)
            deadlines = [d for d in (self.deadline, self.request_deadline) if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield self._timed_out()
                return
            if self.next_prefill is not None and self.next_prefill in done:
                event = self._prefill_item()
                yield event
                if isinstance(event, AttemptFailed):
                    return
            if self.next_item in done:
                async for event in self._decode_item():
                    yield event
                    if isinstance(event, AttemptFailed) or (isinstance(event, DeltaEvent) and event.delta.finish_reason):
                        return
                self._next()

    def _timed_out(self) -> AttemptFailed:
        if self.request_deadline is not None and time.monotonic() >= self.request_deadline:
            return AttemptFailed("the request timed out", False, None, 504, "request_timeout")
        engine = self.prefill if self.phase is Phase.PREFILLING else self.decode
        return AttemptFailed(f"timed out waiting for {WAITING_FOR[self.phase]}", True, engine, 504, "timeout")

    def _prefill_item(self) -> AttemptEvent:
        """The prefill stream's next event: its KVReady, its result, or how it failed."""
        future, self.next_prefill = self.next_prefill, None
        assert future is not None and self.prefill is not None
        try:
            item = future.result()
        except StopAsyncIteration:
            return AttemptFailed(f"prefill engine {self.prefill} ended its stream without a result", True, self.prefill, 502, "prefill")
        except Exception as exc:
            if engine_gone(exc):
                self.executor.pool.mark_unhealthy(self.prefill)
            return AttemptFailed(f"prefill engine {self.prefill} failed: {exc}", True, self.prefill, 502, "prefill")
        if isinstance(item, KVRefused):
            logger.warning("attempt %s: KVReady rejected: %s", self.plan.attempt_id, item.reason)
            return AttemptFailed(
                f"decode engine {self.decode} sent a KVReady for another engine: {item.reason}", True, self.decode, 502, "kv_ready_mismatch"
            )
        if isinstance(item, KVReady):
            self.prefill_started = time.monotonic()
            self.executor.metrics.kv_ready.observe(self.prefill_started - self.started)
            self.phase = Phase.PREFILLING
            self.deadline = self.prefill_started + self.executor.timeouts.prefill_s
            logger.log(
                attempt_log_level(self.plan.number),
                "attempt %s: KV ready on %s; prefill on %s pushes transfer %s",
                self.plan.attempt_id,
                self.decode,
                self.prefill,
                item.params.get("request_id"),
                extra={
                    "pd_request": self.plan.request_id,
                    "pd_attempt": self.plan.attempt_id,
                    "pd_decode": self.decode,
                    "pd_prefill": self.prefill,
                    "pd_transfer": item.params.get("request_id"),
                },
            )
            self._next_prefill()
            return KVReadyEvent(item.params, self.decode)
        assert isinstance(item, PrefillResult), item
        self.executor.metrics.prefill.observe(time.monotonic() - self.prefill_started)
        self._drop_prefill()
        if self.phase is Phase.PREFILLING:
            self.phase = Phase.DECODING
            self.deadline = time.monotonic() + self.executor.timeouts.first_token_s
        return PrefillDoneEvent(self.prefill, item)

    def _drop_prefill(self) -> None:
        """The prefill's part is over: give back its lease; end its stream if still open."""
        self.prefill_lease.close()
        if self.next_prefill is not None:
            if self.next_prefill.done() and not self.next_prefill.cancelled():
                self.next_prefill.exception()  # retrieved: the attempt no longer cares how it ended
            self.next_prefill.cancel()
            self.next_prefill = None
        if self.prefill_stream is not None:
            with contextlib.suppress(Exception):
                self.prefill_stream.cancel()
            self.prefill_stream = None

    async def _decode_item(self) -> AsyncIterator[AttemptEvent]:
        assert self.next_item is not None
        try:
            item = self.next_item.result()
        except StopAsyncIteration:
            yield AttemptFailed(f"decode engine {self.decode} ended the stream early", True, self.decode, 502, "decode")
            return
        except Exception as exc:
            if engine_gone(exc):
                self.executor.pool.mark_unhealthy(self.decode)
            yield AttemptFailed(f"decode engine {self.decode} failed: {exc}", True, self.decode, 502, "decode")
            return
        if isinstance(item, EngineRejected):
            yield AttemptFailed(item.message, False, self.decode, 400, "rejected")
        elif isinstance(item, TokenDelta):
            if self.phase is Phase.AWAITING_KV:
                # Tokens before any KVReady: the decode engine had the whole prompt cached and
                # asked for no KV, so no callback will come; the prefill replica stops waiting.
                self._drop_prefill()
            yield DeltaEvent(item, self.decode)
            # Tokens flow; from here only the request's own deadline applies.
            if self.phase is not Phase.PREFILLING:
                self.phase, self.deadline = Phase.DECODING, None

    async def close(self) -> None:
        """Cancel whatever is still running; the engines abort and free those requests. Every
        cancelled wait is awaited, so no exception is left unretrieved (and logged) by asyncio."""
        pending = [f for f in (self.next_item, self.next_prefill) if f is not None and not f.done()]
        for future in pending:
            future.cancel()
        for future in (self.next_item, self.next_prefill):
            if future is not None:
                with contextlib.suppress(BaseException):
                    await future
        self._drop_prefill()
        try:
            self.stream.cancel()
        except Exception:  # already finished
            pass


@functools.cache
def prefill_sampling_params() -> bytes:
    """Prefill computes the prompt's KV; the one token it samples is discarded."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return encode_sampling(SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))
