"""The vLLM runner's bookkeeping on the paths that are not a request's normal life: a stats
record it cannot read, a call to an engine that has stopped."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams
from vllm.v1.metrics.stats import SchedulerStats

from serve_app.engines import vllm_runner
from serve_app.engines.vllm_runner import VLLMRunner, _LoadTracker
from serve_app.wire.protocol import EngineRequest
from serve_app.wire.sampling import encode_sampling


def test_connector_stats_of_another_shape_do_not_kill_the_engine(monkeypatch):
    """vLLM's output handler runs the stat loggers unguarded: an exception from this one would
    fail every request in flight and mark the engine dead."""
    warnings: list[str] = []
    monkeypatch.setattr(vllm_runner.logger, "warning", lambda message, *args: warnings.append(message % args))
    tracker = _LoadTracker()
    record = tracker.logger_factory()(None).record
    for _ in range(3):
        record(SchedulerStats(num_running_reqs=2, kv_connector_stats={"transfers": ["not", "a", "mapping"]}), None)
    assert tracker.num_running == 2  # the load is read all the same
    assert tracker.failed_record is not None and "AttributeError" in tracker.failed_record
    assert len(warnings) == 1 and "could not be read" in warnings[0]  # once, not per step
    record(SchedulerStats(num_running_reqs=1, kv_connector_stats={"transfers": {"t-1": {"outcome": "done"}}}), None)
    assert tracker.num_running == 1 and "t-1" in tracker.transfers.all()


def test_a_call_to_a_stopped_engine_leaves_nothing_held():
    async def main() -> None:
        runner = VLLMRunner("decode-0", "decode", {})  # never started, or stopped: no engine
        params = encode_sampling(SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="the engine has stopped"):
            await anext(runner.generate(EngineRequest("r-1", [1, 2], params)))
        assert runner.held() == [] and runner.stats().inflight == 0

    asyncio.run(main())
