"""The mock engine's stream ends with the delta that says how it ended, whenever that happens."""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from serve_app.engines.mock_runner import MockCosts, MockEngine
from serve_app.wire.protocol import EngineRequest
from serve_app.wire.sampling import encode_sampling


def test_an_ending_while_the_consumer_is_away_still_reaches_it() -> None:
    """A request finished (here: aborted) while its generator waits at a ``yield`` must still send
    that final delta: a stream that just stops reads to the router as a broken engine."""

    async def main() -> None:
        engine = MockEngine("decode-0", "decode", MockCosts(0.0, 0.001, 10_000, 8), None, recompute=True)
        await engine.start()
        try:
            params = encode_sampling(SamplingParams(max_tokens=1000, temperature=0.0, detokenize=False))
            stream = engine.generate(EngineRequest("r1", [5, 6, 7], params, None))
            first = await anext(stream)
            assert first.token_ids and first.finish_reason is None
            await engine.abort("r1")  # the consumer has not asked for the next delta yet
            await asyncio.sleep(0.01)
            last = await asyncio.wait_for(anext(stream), 5)
            while last.finish_reason is None:
                last = await asyncio.wait_for(anext(stream), 5)
            assert last.finish_reason == "abort"
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            assert engine.stats().inflight == 0
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_request_aborted_during_its_prefill_never_joins_the_batch() -> None:
    """An abort while the engine pays for the prompt finishes the request; it must not then run
    (and hold KV) as if nothing happened."""

    async def main() -> None:
        engine = MockEngine("decode-0", "decode", MockCosts(0.001, 0.001, 100_000, 8), None, recompute=True)
        await engine.start()
        try:
            params = encode_sampling(SamplingParams(max_tokens=1000, temperature=0.0, detokenize=False))
            stream = engine.generate(EngineRequest("r1", list(range(1, 201)), params, None))  # a 0.2 s prefill
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.1)
            await engine.abort("r1")
            assert (await asyncio.wait_for(first, 5)).finish_reason == "abort"
            await asyncio.sleep(0.2)  # past the prefill's end
            assert engine.stats().num_running == 0
            await stream.aclose()
            assert engine.stats().inflight == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
