"""A vLLM ``AsyncLLM`` with the few operations the deployments need.

Token ids in, token deltas out: the router has already tokenized, so the engine is given a
``TokensInput`` and never sees text. Deltas are coalesced in time (``coalesce_s``): while the
wrapper waits, AsyncLLM's own output collector merges the engine steps that arrive, so a stream
costs one Ray item per window instead of one per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from serve_app.protocol import EngineRequest, EngineStats, Role, TokenDelta, TokenLogprob

logger = logging.getLogger("pd_serve.engine")


RECENT = 2048  # per-request records kept for inspection (tests, operators)


class _Recent(OrderedDict):
    """A bounded map: the oldest entries go first."""

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > RECENT:
            self.popitem(last=False)


class _LoadTracker:
    """Latest scheduler stats, fed by vLLM's stat-logger hook on every engine step; also collects
    the KV connector's per-transfer records that ride along with them."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.updated_at = 0.0
        self.transfers = _Recent()

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
                    tracker.updated_at = time.monotonic()
                    connector = scheduler_stats.kv_connector_stats or {}
                    for transfer_id, record in (connector.get("transfers") or {}).items():
                        tracker.transfers.put(transfer_id, record)

            def log_engine_initialized(self) -> None:
                pass

        return _TrackerLogger


class EngineRunner:
    def __init__(self, name: str, role: Role, engine_kwargs: dict[str, Any], coalesce_s: float = 0.01) -> None:
        self.name = name
        self.role = role
        self.engine_kwargs = engine_kwargs
        self.coalesce_s = coalesce_s
        self.llm: Any = None
        self.kv_capacity_tokens = 0
        self._load = _LoadTracker()
        # attempt id -> reserved tokens (prompt + max_tokens) of the requests this engine holds.
        self._inflight: dict[str, int] = {}
        # attempt id -> what the engine did with it (prompt tokens it did not compute, outcome).
        self.requests = _Recent()

    def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        args = AsyncEngineArgs(**self.engine_kwargs)
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._load.logger_factory()])
        cache = self.llm.vllm_config.cache_config
        self.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        logger.info(
            "engine %s (%s) started in %.1fs, KV capacity %d tokens",
            self.name,
            self.role,
            time.monotonic() - started,
            self.kv_capacity_tokens,
        )

    @property
    def block_size(self) -> int:
        return int(self.llm.vllm_config.cache_config.block_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's output as coalesced deltas; leaving early aborts it in the engine."""
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        params = request.sampling_params.clone()
        params.output_kind = RequestOutputKind.DELTA
        # The router detokenizes (one stream across attempts) and matches stop strings itself.
        params.detokenize = False
        if request.kv_transfer_params is not None:
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": request.kv_transfer_params}
        num_logprobs = params.logprobs
        self._inflight[request.request_id] = len(request.prompt_token_ids) + (params.max_tokens or 0)
        record: dict[str, Any] = {"prompt_tokens": len(request.prompt_token_ids), "output_tokens": 0, "finish_reason": None}
        self.requests.put(request.request_id, record)
        first = True
        try:
            outputs = self.llm.generate(tokens_input(request.prompt_token_ids), params, request.request_id)
            async for out in outputs:
                delta = _to_delta(out, num_logprobs)
                if first:
                    # Prompt tokens this engine did not compute: prefix-cache hits and KV received.
                    delta.num_cached_tokens = out.num_cached_tokens
                    record["num_cached_tokens"] = out.num_cached_tokens
                    first = False
                record["output_tokens"] += len(delta.token_ids)
                record["finish_reason"] = delta.finish_reason
                record["stop_reason"] = delta.stop_reason
                yield delta
                if delta.finish_reason is not None:
                    return
                if self.coalesce_s > 0:
                    # AsyncLLM merges the steps that arrive meanwhile into the next output.
                    await asyncio.sleep(self.coalesce_s)
        finally:
            self._inflight.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def check_health(self) -> None:
        await self.llm.check_health()

    def stats(self) -> EngineStats:
        return EngineStats(
            name=self.name,
            role=self.role,
            num_running=self._load.num_running,
            num_waiting=self._load.num_waiting,
            kv_usage=self._load.kv_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
            inflight=len(self._inflight),
            healthy=self.llm is not None and not self.llm.errored,
        )

    def transfers(self) -> dict[str, Any]:
        return dict(self._load.transfers)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


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


def _to_token_logprob(token_id: int, position: dict[int, Any], k: int) -> TokenLogprob:
    """vLLM gives the sampled token plus the top-k by rank; the sampled one may rank below k."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    top = tuple(
        (tid, float(lp.logprob)) for tid, lp in ranked if k < 0 or (lp.rank is not None and lp.rank <= k)
    )
    return TokenLogprob(token_id=token_id, logprob=float(position[token_id].logprob), top=top)
