"""A decode engine's scheduler that gives requests back instead of preempting them.

vLLM preempts the newest running request when another one needs a KV block and none is free: it
frees the victim's blocks and requeues it, to recompute its whole context later on this same
engine. On a disaggregated decode engine that is the wrong place to recompute (the prompt's KV came
from a prefill engine) and the wrong time (the victim waits behind everything else). This
scheduler, like vllm-ascend's RecomputeScheduler, instead *finishes* the victim with
``finish_reason="stop"`` and ``stop_reason="recomputed"`` and no new tokens, freeing its blocks at
once; the router then resumes it, token for token, through prefill and another decode engine.

Every token already streamed stays valid and none is sent twice: the victim ends between two
engine steps. With synchronous scheduling and one pipeline stage (vLLM's CPU engine) no token is
computed and then dropped either; where vLLM schedules a step ahead (pipeline parallelism, async
scheduling) the victim's token of the step already under way is dropped with it, and the router
resumes from the tokens it streamed.

vLLM's ``reset_prefix_cache(reset_running_requests=True)`` (which pd-serve never calls) preempts
every running request: here each is given back the same way.

Enable it with ``scheduler_cls="serve_app.kv.recompute_scheduler.RecomputeScheduler"`` (the CPU
backend does for decode engines when ``decode.recompute`` is on). It runs in the engine-core
process.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from serve_app.runtime.private_symbols import unchanged
from serve_app.wire.protocol import RECOMPUTED

logger = logging.getLogger("pd_serve.kv")

# The private hooks of vLLM's scheduler the override needs (serve_app/runtime/private_symbols.py).
SYMBOLS = ("vllm.v1.core.sched.scheduler.Scheduler._preempt_request", "vllm.v1.core.sched.scheduler.Scheduler._free_request")


class RecomputeScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given_back: list[Request] = []
        self.num_given_back = 0
        if not unchanged(SYMBOLS, logger, "giving preempted requests back to the router (vLLM recomputes them here)"):
            # The instance's hook is vLLM's own again: preempted requests wait and are recomputed here.
            self._preempt_request = super()._preempt_request  # type: ignore[method-assign]

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        """Called by ``schedule()`` for the victim it already took off the running queue."""
        assert request.status == RequestStatus.RUNNING, "only running requests are preempted"
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = RECOMPUTED
        # A preemption all the same, for vLLM's own count (vllm:num_preemptions) and events.
        request.num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        # Frees the blocks (and tells the KV connector) now, so the allocation that needed them
        # can retry in this same scheduling pass.
        self._free_request(request)
        self._given_back.append(request)
        self.num_given_back += 1
        logger.info(
            "request %s given back for recompute after %d output tokens (%d tokens of context)",
            request.request_id,
            request.num_output_tokens,
            request.num_tokens,
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        given_back, self._given_back = self._given_back, []
        for request in given_back:
            end = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.STOP,
                stop_reason=RECOMPUTED,
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            client = outputs.get(request.client_index)
            if client is None:
                outputs[request.client_index] = EngineCoreOutputs(outputs=[end])
            else:
                client.outputs.append(end)
        return outputs
