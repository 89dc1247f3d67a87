"""One attempt of the decode-first (CDCP) schedule, executed through Serve handles.

Disaggregated (DESIGN.md steps 2-7):
  1. pick a decode engine and open its stream with ``do_remote_prefill``; its replica fills in
     the metaserver URL of its own relay;
  2. the stream's first event is ``KVReady(params)``: the decode engine holds blocks for the
     prompt and its connector posted their ids;
  3. pick a prefill engine and call ``run`` with those params; it pushes the KV layer by layer;
  4. the decode stream continues with tokens, sampled by the decode engine itself.
Colocated: step 1 without ``do_remote_prefill``, then tokens.

Every wait has a deadline, and leaving the attempt by any path (finish, retry, failure, timeout,
client disconnect) cancels the decode stream and the prefill call, which aborts their engine
requests and frees their KV blocks, and gives back the router's load leases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from serve_app.config import TimeoutsConfig
from serve_app.metrics import RouterMetrics
from serve_app.protocol import EngineRequest, KVReady, Role, TokenDelta
from serve_app.router.balancer import EngineLoad
from serve_app.router.pool import EnginePool
from serve_app.router.recompute import AttemptPlan

logger = logging.getLogger("pd_serve.router")

ENGINE_WAIT_POLL_S = 0.2
PREFILL_FAULTS = frozenset({"corrupt_kv", "push_delay_s", "prefill_raise"})


@dataclass
class KVReadyEvent:
    params: dict[str, Any]
    engine: str


@dataclass
class PrefillDoneEvent:
    engine: str


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


AttemptEvent = KVReadyEvent | PrefillDoneEvent | DeltaEvent | AttemptFailed


def _engine_gone(exc: BaseException) -> bool:
    """Errors that mean the replica itself is gone (Serve restarts it), not a bad request."""
    import ray.exceptions

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class AttemptExecutor:
    def __init__(self, pool: EnginePool, timeouts: TimeoutsConfig, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.metrics = metrics

    async def run(
        self, plan: AttemptPlan, params_template: Any, debug: dict[str, Any] | None = None
    ) -> AsyncIterator[AttemptEvent]:
        decode = await self._pick("decode", plan.avoid)
        if decode is None:
            yield AttemptFailed("no decode engine is available", retryable=False, status=503)
            return
        params = params_template.clone()
        params.max_tokens = plan.max_tokens
        params.min_tokens = plan.min_tokens
        faults = debug if debug and plan.number <= int(debug.get("attempts", 1)) else {}
        kv_params = None
        if plan.disaggregated:
            # The decode replica adds the URL of its own metaserver relay.
            kv_params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": plan.attempt_id}
            if faults.get("skip_metaserver"):
                kv_params["debug_skip_metaserver"] = True
        request = EngineRequest(plan.attempt_id, plan.prompt_token_ids, params, kv_params)
        reserved = len(plan.prompt_token_ids) + plan.max_tokens
        with self.pool.lease(decode.name, reserved):
            stream = self.pool.handles[decode.name].options(stream=True).generate.remote(request)
            attempt = _AttemptRun(self, plan, decode.name, stream, faults)
            try:
                async for event in attempt.events():
                    yield event
            finally:
                attempt.close()

    async def _pick(self, role: Role, avoid: frozenset[str]) -> EngineLoad | None:
        """An engine of ``role``; while none is healthy (restarting), wait up to kv_ready_s."""
        deadline = time.monotonic() + self.timeouts.kv_ready_s
        while True:
            load = self.pool.pick(role, avoid)
            if load is not None or time.monotonic() >= deadline:
                return load
            await asyncio.sleep(ENGINE_WAIT_POLL_S)
            await self.pool.refresh()


class _AttemptRun:
    """The moving parts of one attempt: the decode stream, the prefill call, the deadlines."""

    def __init__(self, executor: AttemptExecutor, plan: AttemptPlan, decode: str, stream: Any, faults: dict[str, Any]) -> None:
        self.executor = executor
        self.faults = faults
        self.plan = plan
        self.decode = decode
        self.stream = stream
        self.prefill_lease = ExitStack()
        self.prefill: str | None = None
        self.prefill_task: asyncio.Task | None = None
        self.next_item: asyncio.Future | None = None

    def _next(self) -> asyncio.Future:
        self.next_item = asyncio.ensure_future(self.stream.__anext__())
        return self.next_item

    async def events(self) -> AsyncIterator[AttemptEvent]:
        timeouts = self.executor.timeouts
        metrics = self.executor.metrics
        started = time.monotonic()
        if self.plan.disaggregated:
            phase, deadline = "awaiting KVReady", started + timeouts.kv_ready_s
        else:
            phase, deadline = "awaiting the first token", started + timeouts.first_token_s
        self._next()
        prefill_started = 0.0
        while True:
            waiting: set[asyncio.Future] = {self.next_item}  # type: ignore[arg-type]
            if self.prefill_task is not None:
                waiting.add(self.prefill_task)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                metrics.errors.inc(tags={"kind": "timeout"})
                engine = self.prefill if phase == "awaiting prefill" else self.decode
                yield AttemptFailed(f"timed out {phase}", retryable=True, engine=engine, status=504)
                return

            if self.prefill_task is not None and self.prefill_task in done:
                task, self.prefill_task = self.prefill_task, None
                exc = task.exception()
                if exc is not None:
                    metrics.errors.inc(tags={"kind": "prefill"})
                    assert self.prefill is not None
                    if _engine_gone(exc):
                        self.executor.pool.mark_unhealthy(self.prefill)
                    yield AttemptFailed(f"prefill engine {self.prefill} failed: {exc!r}", True, self.prefill, 502)
                    return
                metrics.prefill.observe(time.monotonic() - prefill_started)
                self.prefill_lease.close()  # its prompt is no longer queued on that engine
                yield PrefillDoneEvent(self.prefill)  # type: ignore[arg-type]
                if phase == "awaiting prefill":
                    phase, deadline = "awaiting the first token", time.monotonic() + timeouts.first_token_s

            if self.next_item in done:
                try:
                    item = self.next_item.result()  # type: ignore[union-attr]
                except StopAsyncIteration:
                    yield AttemptFailed(f"decode engine {self.decode} ended the stream early", True, self.decode, 502)
                    return
                except Exception as exc:
                    metrics.errors.inc(tags={"kind": "decode"})
                    if _engine_gone(exc):
                        self.executor.pool.mark_unhealthy(self.decode)
                    yield AttemptFailed(f"decode engine {self.decode} failed: {exc!r}", True, self.decode, 502)
                    return
                if isinstance(item, KVReady):
                    metrics.kv_ready.observe(time.monotonic() - started)
                    yield KVReadyEvent(item.params, self.decode)
                    prefill = await self.executor._pick("prefill", self.plan.avoid)
                    if prefill is None:
                        yield AttemptFailed("no prefill engine is available", True, None, 503)
                        return
                    self.prefill = prefill.name
                    prefill_started = time.monotonic()
                    self._start_prefill(prefill, item.params)
                    phase, deadline = "awaiting prefill", prefill_started + timeouts.prefill_s
                elif isinstance(item, TokenDelta):
                    yield DeltaEvent(item, self.decode)
                    if item.finish_reason is not None:
                        return
                    # Tokens flow; from here only the request's own deadline applies.
                    if phase != "awaiting prefill":
                        phase, deadline = "decoding", None
                self._next()

    def _start_prefill(self, prefill: EngineLoad, kv_params: dict[str, Any]) -> None:
        params = self.plan_params_for_prefill()
        for fault in PREFILL_FAULTS & self.faults.keys():
            kv_params = {**kv_params, f"debug_{fault}": self.faults[fault]}
        request = EngineRequest(self.plan.attempt_id, self.plan.prompt_token_ids, params, kv_params)
        self.prefill_lease.enter_context(self.executor.pool.lease(prefill.name, len(self.plan.prompt_token_ids)))
        response = self.executor.pool.handles[prefill.name].run.remote(request)

        async def call() -> Any:
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()
                raise

        self.prefill_task = asyncio.ensure_future(call())

    def plan_params_for_prefill(self) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Prefill computes the prompt's KV; the token it samples is discarded.
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def close(self) -> None:
        """Cancel whatever is still running; the engines abort and free those requests."""
        if self.next_item is not None and not self.next_item.done():
            self.next_item.cancel()
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
        self.prefill_lease.close()
        try:
            self.stream.cancel()
        except Exception:  # already finished
            pass
