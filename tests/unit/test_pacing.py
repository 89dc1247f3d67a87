"""Paced streams (engines/pacing.py): a stream waits between items, but never past the moment its
request finishes in the engine; the signal that ends the wait comes from vLLM's own per-step
stats (the real types, no engine) and, in the mock engine, from its step loop."""

from __future__ import annotations

import asyncio
import time

from vllm import SamplingParams
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import IterationStats, RequestStateStats

from serve_app.engines.mock_runner import MockCosts, MockEngine
from serve_app.engines.pacing import FinishSignal, StreamPacer
from serve_app.engines.vllm_runner import _LoadTracker
from serve_app.wire.protocol import EngineRequest
from serve_app.wire.sampling import encode_sampling


def test_a_hold_lasts_its_time_unless_the_request_finishes():
    async def main() -> None:
        signal = FinishSignal()
        started = time.monotonic()
        await signal.hold(0.05)
        assert time.monotonic() - started >= 0.05

        loop = asyncio.get_running_loop()
        loop.call_later(0.01, signal.set)
        started = time.monotonic()
        await signal.hold(30)
        assert time.monotonic() - started < 10
        await asyncio.wait_for(signal.hold(30), 1)  # finished already: no wait at all

    asyncio.run(main())


def test_a_cancelled_hold_leaves_nothing_behind():
    async def main() -> None:
        signal = FinishSignal()
        task = asyncio.ensure_future(signal.hold(30))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert signal._waiter is None
        signal.set()  # nothing waits: a no-op

    asyncio.run(main())


def test_vllms_step_stats_end_the_finished_requests_hold():
    """The tracker is vLLM's stat logger: the step that finishes a request names it in
    ``iteration_stats.finished_requests`` (vLLM's own types here), and that request's signal is
    set; other requests' are not."""
    tracker = _LoadTracker()
    done, running = FinishSignal(), FinishSignal()
    tracker.finish_signals.update({"req-done": done, "req-running": running})
    stats = IterationStats()
    stats.update_from_finished_request(FinishReason.LENGTH, "req-done", 8, 4, RequestStateStats())
    tracker.logger_factory()(None).record(None, stats)
    assert done.finished and not running.finished
    tracker.logger_factory()(None).record(None, None)  # a step without iteration stats


def test_the_mock_engine_sends_a_paced_streams_last_delta_when_it_finishes():
    """Four streams at one item per second may each send every 3 s; a request that finishes in
    the meantime still ends at once, with the steps since its last item merged into one delta."""

    async def main() -> None:
        engine = MockEngine("decode-0", "decode", MockCosts(0.0, 0.001, 100_000, 8), None, recompute=True, pacer=StreamPacer(1.0))
        await engine.start()
        try:
            params = encode_sampling(SamplingParams(max_tokens=20, temperature=0.0, detokenize=False, ignore_eos=True))

            async def one(i: int) -> tuple[float, list[int]]:
                started = time.monotonic()
                sizes = [len(d.token_ids) async for d in engine.generate(EngineRequest(f"r{i}", [5, 6, 7 + i], params, None))]
                return time.monotonic() - started, sizes

            results = await asyncio.gather(*(one(i) for i in range(4)))
            for seconds, sizes in results:
                assert sum(sizes) == 20 and len(sizes) < 10, sizes  # paced: steps merged
                assert seconds < 1.5, (seconds, sizes)  # not held for the 3 s interval
            assert engine.stats().inflight == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_mock_streams_are_paced_only_from_their_first_output():
    """As vLLM's runner (next test): requests queued behind a full batch (max_num_seqs 1) send
    nothing and are not counted, so the one running stream is not held for them."""

    async def main() -> None:
        engine = MockEngine("decode-0", "decode", MockCosts(0.0, 0.002, 100_000, 1), None, recompute=True, pacer=StreamPacer(100.0))
        await engine.start()
        try:
            long = encode_sampling(SamplingParams(max_tokens=200, temperature=0.0, detokenize=False, ignore_eos=True))
            params = encode_sampling(SamplingParams(max_tokens=10, temperature=0.0, detokenize=False, ignore_eos=True))
            running = engine.generate(EngineRequest("running", [5, 6, 7], long, None))
            first = await anext(running)
            queued = [asyncio.ensure_future(anext(engine.generate(EngineRequest(f"q{i}", [5, 6, i], params, None)))) for i in range(20)]
            await asyncio.sleep(0.05)  # the running request's 200 steps take 0.4 s
            assert engine.pacer.active == 1  # the running stream alone
            rest = [d async for d in running]
            assert sum(len(d.token_ids) for d in [first, *rest]) == 200
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_vllm_streams_are_paced_only_from_their_first_output():
    """Decode requests still waiting for their KV (or queued) send nothing: counted as paced
    streams, twenty of them held the one running stream 0.2 s between deltas at 100 items/s."""
    from types import SimpleNamespace

    from serve_app.engines.vllm_runner import VLLMRunner

    class FakeLLM:
        async def generate(self, prompt, params, request_id, priority=0):
            if request_id != "running":
                await asyncio.Event().wait()  # its KV never comes
            for i in range(10):
                await asyncio.sleep(0.01)
                done = i == 9
                completion = SimpleNamespace(token_ids=[i], logprobs=None, finish_reason="length" if done else None, stop_reason=None)
                yield SimpleNamespace(outputs=[completion], finished=done, num_cached_tokens=0)

    async def main() -> None:
        runner = VLLMRunner("decode-0", "decode", {}, pacer=StreamPacer(100.0))
        runner.llm = FakeLLM()
        params = encode_sampling(SamplingParams(max_tokens=10, temperature=0.0, detokenize=False))
        waiting = [asyncio.ensure_future(anext(runner.generate(EngineRequest(f"w{i}", [1, 2], params, None)))) for i in range(20)]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        deltas = [d async for d in runner.generate(EngineRequest("running", [1, 2], params, None))]
        took = time.monotonic() - started
        assert sum(len(d.token_ids) for d in deltas) == 10 and took < 0.5, (took, len(deltas))
        assert runner.pacer.active == 0
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(main())
