"""A vLLM ``AsyncLLM`` with the few operations the deployments need.

Token ids in, token deltas out: the router has already tokenized, so the engine is given a
``TokensInput`` and never sees text. Deltas are paced (engines/pacing.py): while the wrapper
waits, AsyncLLM's own output collector merges the engine steps that arrive, so concurrent
streams cost fewer streamed items than tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from serve_app.engines.pacing import FinishSignal, StreamPacer
from serve_app.engines.records import Recent, TransferRecords
from serve_app.runtime.compat import CLIENT_ERRORS
from serve_app.vllm_plugins.stat_logger import ray_stat_logger
from serve_app.wire.protocol import EngineRejected, EngineRequest, EngineStats, Role, TokenDelta, TokenLogprob
from serve_app.wire.sampling import decode_sampling

logger = logging.getLogger("pd_serve.engine")


class _LoadTracker:
    """Latest scheduler stats, fed by vLLM's stat-logger hook on every engine step; also collects
    the KV connector's per-transfer records that ride along with them, and tells each paced
    stream when its request has finished (the hook runs once the step's outputs are in the
    requests' queues, so the stream then finds its last tokens there)."""

    def __init__(self) -> None:
        self.finish_signals: dict[str, FinishSignal] = {}
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.failed_record: str | None = None  # the first stats record that could not be read
        self.transfers = TransferRecords()
        self.kv_counters: dict[str, int] = {}

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        tracker = self

        class _TrackerLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    tracker.num_running = scheduler_stats.num_running_reqs
                    tracker.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    tracker.kv_usage = float(scheduler_stats.kv_cache_usage)
                    try:
                        connector = scheduler_stats.kv_connector_stats or {}
                        tracker.transfers.add(connector.get("transfers") or {})
                        tracker.kv_counters.update(connector.get("counters") or {})
                    except Exception as exc:  # noqa: BLE001
                        # vLLM's output handler runs this hook unguarded: an exception here
                        # would fail every request in flight and mark the engine dead, for a
                        # connector (vllm-ascend's, say) whose stats are of another shape.
                        if tracker.failed_record is None:
                            tracker.failed_record = f"{type(exc).__name__}: {exc}"
                            logger.warning("the KV connector's stats could not be read (%s); later ones skipped alike", exc)
                if iteration_stats is not None and tracker.finish_signals:
                    for finished in iteration_stats.finished_requests:
                        # By the id pd-serve gave it (vLLM 0.23 and 0.32); a version that named
                        # none would leave each stream to wait out its interval.
                        signal = tracker.finish_signals.get(getattr(finished, "request_id", None))
                        if signal is not None:
                            signal.set()

            def log_engine_initialized(self) -> None:
                pass

        return _TrackerLogger


class VLLMRunner:
    def __init__(self, name: str, role: Role, engine_kwargs: dict[str, Any], pacer: StreamPacer | None = None) -> None:
        self.name = name
        self.role = role
        self.engine_kwargs = engine_kwargs
        self.pacer = pacer or StreamPacer()
        self.llm: Any = None
        self.kv_capacity_tokens = 0
        self._load = _LoadTracker()
        # attempt id -> what the engine did with it (prompt tokens it did not compute, outcome).
        self.requests = Recent()

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        args = AsyncEngineArgs(**self.engine_kwargs)
        # The tracker feeds the router's load scores; vLLM's Ray stat logger exports vLLM's own
        # engine metrics (and replaces vLLM's default Prometheus one, which Ray cannot scrape).
        loggers = [self._load.logger_factory(), ray_stat_logger(self.name, self.role)]
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)
        cache = self.llm.vllm_config.cache_config
        self.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        logger.info(
            "engine %s (%s) started in %.1fs, KV capacity %d tokens",
            self.name,
            self.role,
            time.monotonic() - started,
            self.kv_capacity_tokens,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineRejected]:
        """Stream the request's output as coalesced deltas; leaving early aborts it in the engine.

        A request the engine refuses as invalid yields one ``EngineRejected`` and ends."""
        from vllm.inputs.engine import tokens_input

        if self.llm is None:  # before anything is registered: nothing would release it
            raise RuntimeError(f"{self.name}: the engine has stopped")
        params = engine_sampling_params(request)
        num_logprobs = params.logprobs
        record: dict[str, Any] = {"prompt_tokens": len(request.prompt_token_ids), "output_tokens": 0, "finish_reason": None}
        self.requests.put(request.request_id, record)
        prompt = tokens_input(request.prompt_token_ids, cache_salt=request.cache_salt)
        # A reasoning model's chat request: as vLLM's server hands it over (only where set).
        reasoning = {
            name: value
            for name, value in (("reasoning_ended", request.reasoning_ended), ("reasoning_parser_kwargs", request.reasoning_parser_kwargs))
            if value is not None
        }
        outputs = self.llm.generate(prompt, params, request.request_id, priority=request.priority, **reasoning)
        finish = self._load.finish_signals[request.request_id] = FinishSignal()
        try:
            # Closing the engine's stream (however this one ends) aborts the request in vLLM.
            async with aclosing(outputs):
                try:
                    out = await anext(outputs)
                except CLIENT_ERRORS as exc:
                    # vLLM checks the request against the model when it is added, before output.
                    record["finish_reason"] = "rejected"
                    yield EngineRejected(str(exc))
                    return
                except StopAsyncIteration:
                    return
                # Prompt tokens this engine did not compute: prefix-cache hits and KV received.
                record["num_cached_tokens"] = out.num_cached_tokens
                delta = _to_delta(out, num_logprobs)
                delta.num_cached_tokens = out.num_cached_tokens
                if params.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    delta.prompt_logprobs = _prompt_logprobs(request.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs)
                # Paced from its first output on: a request still queued or waiting for its KV
                # sends nothing, and counting it would hold the streams that do (pacing.py).
                with self.pacer.stream() as pace:
                    while True:
                        record["output_tokens"] += len(delta.token_ids)
                        record["finish_reason"] = delta.finish_reason
                        record["stop_reason"] = delta.stop_reason
                        yield delta
                        pace.sent()
                        if delta.finish_reason is not None:
                            return
                        # AsyncLLM merges the steps that arrive meanwhile into the next output.
                        await finish.hold(pace.wait_s())
                        try:
                            delta = _to_delta(await anext(outputs), num_logprobs)
                        except StopAsyncIteration:
                            return
        finally:
            self._load.finish_signals.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:  # stopped: nothing left to abort
            await self.llm.abort(request_id)

    def held(self) -> list[str]:
        return list(self._load.finish_signals)  # registered for the life of each generate call

    async def check_health(self) -> None:
        if self.llm is None:
            raise RuntimeError(f"{self.name}: the engine has stopped")
        await self.llm.check_health()

    def stats(self) -> EngineStats:
        return EngineStats(
            name=self.name,
            role=self.role,
            num_running=self._load.num_running,
            num_waiting=self._load.num_waiting,
            kv_usage=self._load.kv_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
            inflight=len(self._load.finish_signals),
            healthy=self.llm is not None and not self.llm.errored,
            extra={"kv_side_channel": dict(self._load.kv_counters)} if self._load.kv_counters else {},
        )

    def transfers(self) -> dict[str, Any]:
        return self._load.transfers.all()

    async def transfer_record(self, transfer_id: str, timeout_s: float) -> dict[str, Any] | None:
        return await self._load.transfers.wait_for(transfer_id, timeout_s)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


def engine_sampling_params(request: EngineRequest) -> Any:
    """The SamplingParams the engine runs: the router's, with the output mode this wrapper needs
    and ``kv_transfer_params`` exactly as the pd-serve side set it on ``request`` (none for a
    colocated attempt), whatever ``extra_args`` carried before: nothing a client put there can
    steer the engine's KV transfer."""
    from vllm.sampling_params import RequestOutputKind

    params = decode_sampling(request.sampling_params)
    params.output_kind = RequestOutputKind.DELTA
    # The router detokenizes (one stream across attempts) and matches stop strings itself.
    params.detokenize = False
    extra = {k: v for k, v in (params.extra_args or {}).items() if k != "kv_transfer_params"}
    if request.kv_transfer_params is not None:
        extra["kv_transfer_params"] = dict(request.kv_transfer_params)
    params.extra_args = extra or None
    return params


def _to_delta(out: Any, num_logprobs: int | None) -> TokenDelta:
    completion = out.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs = None
    if num_logprobs is not None and completion.logprobs is not None:
        logprobs = [_to_token_logprob(tid, pos, num_logprobs) for tid, pos in zip(token_ids, completion.logprobs)]
    finish_reason = completion.finish_reason
    if finish_reason is None and out.finished:
        finish_reason = "abort"
    return TokenDelta(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=completion.stop_reason,
    )


def _prompt_logprobs(prompt: list[int], positions: list[Any], k: int) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (None at the first position) for the wire: the prompt's own token
    at each position, with the top k."""
    return [None if position is None else _to_token_logprob(tid, position, k) for tid, position in zip(prompt, positions)]


def _to_token_logprob(token_id: int, position: dict[int, Any], k: int) -> TokenLogprob:
    """vLLM gives the sampled token plus the top-k by rank; the sampled one may rank below k."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    top = tuple((tid, float(lp.logprob)) for tid, lp in ranked if k < 0 or (lp.rank is not None and lp.rank <= k))
    own = position[token_id]
    return TokenLogprob(token_id=token_id, logprob=float(own.logprob), top=top, rank=own.rank)
