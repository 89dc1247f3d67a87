"""The decode deployment: streams an attempt's tokens and, for a disaggregated attempt, first
the ``KVReady`` its connector's metaserver callback produced."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from serve_app.config.backends import EngineSpec, PoolSpec
from serve_app.engines.metaserver import MetaserverRelay, with_relay
from serve_app.engines.records import receive_timeline
from serve_app.engines.server import EngineServer
from serve_app.wire.protocol import MOVED, EngineEvent, EngineRequest, KVReady, TokenDelta

logger = logging.getLogger("pd_serve.engine")

# How long the DEBUG receive timeline waits for the connector's record of the transfer (it rides
# with the engine's stats, throttled to a few per second).
RECEIVE_RECORD_WAIT_S = 5.0


def moved() -> TokenDelta:
    """The answer of a stopping replica: no token, and the router resumes the attempt on another
    decode engine (``stop_reason`` ``moved``)."""
    return TokenDelta([], finish_reason="stop", stop_reason=MOVED)


@serve.deployment
class Decode(EngineServer):
    async def __init__(self, spec: EngineSpec | PoolSpec, drain_s: float = 0.0) -> None:
        await super().__init__(spec, drain_s)
        self.relay = MetaserverRelay()
        await self.relay.start()
        self._timelines: set[asyncio.Task] = set()

    async def generate(self, request: EngineRequest, replica: str | None = None) -> AsyncIterator[EngineEvent]:
        self.pinned(replica)
        if self.draining:  # Serve is stopping this replica: the router resumes it on another
            # (not counted as a call: the drain's quiet second still comes while routers ask)
            yield moved()
            return
        self.calls_started = time.monotonic()
        last: float | None = None
        # Closed with this generator, at once: its own close aborts the engine request.
        async with contextlib.aclosing(self._generate(request)) as events:
            async for event in events:
                if isinstance(event, KVReady) and self.draining:
                    # Stopping while the request waited for its KV: "moved" now, before a prefill
                    # engine computes and pushes a prompt this engine would cut at its first token.
                    yield moved()
                    return
                if isinstance(event, TokenDelta):
                    # The gap between this stream's outputs per token it brought: the autoscaler's
                    # decode latency signal (streams are paced, several tokens to an output, so
                    # the gap alone would grow with the streams running, whatever the engine's pace).
                    now = time.monotonic()
                    if last is not None and event.token_ids:
                        self.latency.add(now, (now - last) / len(event.token_ids))
                    last = now
                    if self.draining and event.finish_reason in (None, "abort"):
                        # The stream ends here, with what it has; closing it frees its KV. (An
                        # abort while draining is the drain's deadline: server.py.)
                        yield dataclasses.replace(event, finish_reason="stop", stop_reason=MOVED)
                        return
                yield event

    async def _generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        params = request.kv_transfer_params
        prompt_tokens = len(request.prompt_token_ids)
        if not params or not params.get("do_remote_prefill"):
            counted = False
            # Closed with this generator, at once: the engine aborts the request then, not when
            # the garbage collector finalises the runner's stream.
            async with contextlib.aclosing(self.runner.generate(request)) as stream:
                async for delta in stream:
                    if not counted and isinstance(delta, TokenDelta):
                        counted = True
                        self.count_prompt(prompt_tokens, delta.num_cached_tokens)
                    yield delta
            return
        kv_ready, callback_url = self.relay.expect(request.request_id)
        request.kv_transfer_params = with_relay(params, callback_url)
        stream = self.runner.generate(request)
        next_delta: asyncio.Future = asyncio.ensure_future(anext(stream))
        try:
            # KVReady comes first, unless the engine needed no KV (whole prompt cached locally)
            # or failed: then its output comes first and no callback will.
            await asyncio.wait({kv_ready, next_delta}, return_when=asyncio.FIRST_COMPLETED)
            counted = False
            transfer_id = None
            if kv_ready.done() and not kv_ready.cancelled():
                ready = kv_ready.result()
                # What the prefix cache held; the rest is pushed.
                self.count_prompt(prompt_tokens, int(ready.get("remote_cached_tokens") or 0))
                counted = True
                transfer_id = str(ready.get("request_id") or request.request_id)
                yield KVReady(ready)
            while True:
                try:
                    delta = await next_delta
                except StopAsyncIteration:
                    return
                if not counted and isinstance(delta, TokenDelta):
                    counted = True  # no KVReady: the cache held the whole prompt (or the engine failed)
                    self.count_prompt(prompt_tokens, delta.num_cached_tokens)
                if transfer_id is not None and isinstance(delta, TokenDelta):
                    self._log_receive(transfer_id, time.time())
                    transfer_id = None
                yield delta
                next_delta = asyncio.ensure_future(anext(stream))
        finally:
            self.relay.forget(request.request_id)
            if not next_delta.done():
                # Cancelling the engine stream aborts the request and frees its blocks.
                next_delta.cancel()
            with contextlib.suppress(BaseException):
                await next_delta  # retrieve its outcome, so no error is left unobserved
            await stream.aclose()

    def _log_receive(self, transfer_id: str, first_token_at: float) -> None:
        """At DEBUG, once the transfer's record is in: its receive timeline (records.py)."""
        if not (self.spec.push_records and logger.isEnabledFor(logging.DEBUG)):
            return

        async def log() -> None:
            record = await self.runner.transfer_record(transfer_id, RECEIVE_RECORD_WAIT_S)
            if record is not None:
                logger.debug(receive_timeline(transfer_id, record, first_token_at), extra={"pd_transfer": transfer_id})

        task = asyncio.get_running_loop().create_task(log())
        self._timelines.add(task)
        task.add_done_callback(self._timelines.discard)

    def _stop_now(self) -> None:
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.close()
        super()._stop_now()
