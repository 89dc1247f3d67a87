"""The prefill deployment: computes a prompt's KV for a disaggregated attempt."""

from __future__ import annotations

import contextlib
import logging
import time

from ray import serve

from serve_app.engines.records import push_timeline
from serve_app.engines.server import EngineServer
from serve_app.wire.protocol import MOVED, EngineRejected, EngineRequest, PrefillResult

# How long ``run`` waits for its connector's record of the push once the prompt is computed. The
# record rides with the engine stats of the very step that finished the prompt, so it is normally
# there at once; the wait only covers an output batch split across event-loop turns.
PUSH_RECORD_WAIT_S = 5.0

logger = logging.getLogger("pd_serve.engine")


class PrefillFailed(RuntimeError):
    """This attempt's prefill did not deliver the KV; the router retries the attempt at once."""


@serve.deployment
class Prefill(EngineServer):
    async def run(self, request: EngineRequest, replica: str | None = None) -> PrefillResult:
        """Run the prompt with ``max_tokens=1``. The connector pushes each layer's KV to the decode
        engine named in ``kv_transfer_params`` as it is computed; the one token sampled here is
        discarded (decode samples the first token itself). Raises ``PrefillFailed`` when the
        engine did not finish the prompt or the push broke, so the router need not wait for the
        decode engine's receive deadline to learn it."""
        self.pinned(replica)
        if self.draining:
            # Serve is stopping this replica and a router has not heard yet: it takes the prompt
            # to another prefill engine and chooses this one for nothing new. Not counted as a
            # call, so the drain's quiet second still comes while routers keep asking.
            return PrefillResult(request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids), finish_reason=MOVED)
        arrived = self.calls_started = time.monotonic()
        arrived_wall = time.time()  # the connector's push times are wall clock
        tokens = len(request.prompt_token_ids)
        self._prompt_tokens += tokens  # queued or computing: the autoscaler's prefill signal
        finish_reason = None
        counted = False
        try:
            # Closed with this call however it ends, at once (not when the collector finalises it).
            async with contextlib.aclosing(self.runner.generate(request)) as events:
                async for event in events:
                    if isinstance(event, EngineRejected):
                        raise PrefillFailed(f"{self.spec.name}: refused {request.request_id}: {event.message}")
                    if not counted:  # the first output says what the prefix cache held
                        counted = True
                        self.count_prompt(tokens, event.num_cached_tokens)
                    finish_reason = event.finish_reason
        finally:
            self._prompt_tokens -= tokens
            # Every call, also one cancelled (a router's deadline, a client gone) or failed: under
            # overload those are the slowest, and leaving them out would read as an idle pool.
            now = time.monotonic()
            self.latency.add(now, now - arrived)
        if finish_reason in (None, "abort") and self.draining:
            # Aborted at the drain's deadline (server.py): the router resumes it elsewhere, as a move.
            return PrefillResult(request_id=request.request_id, num_prompt_tokens=tokens, finish_reason=MOVED)
        if finish_reason not in ("stop", "length"):
            raise PrefillFailed(f"{self.spec.name}: prefill of {request.request_id} ended with {finish_reason!r}")
        record = None
        if self.spec.push_records:
            transfer_id = str((request.kv_transfer_params or {}).get("request_id") or request.request_id)
            record = await self.runner.transfer_record(transfer_id, PUSH_RECORD_WAIT_S)
            if record is not None:
                self._observe_push(record)
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(push_timeline(transfer_id, record, arrived_wall), extra={"pd_transfer": transfer_id})
                if record.get("outcome") != "done":
                    raise PrefillFailed(f"{self.spec.name}: KV push of {transfer_id} failed: {record.get('error')}")
        return PrefillResult(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            finish_reason=finish_reason,
            push=record,
        )

    def _observe_push(self, record: dict) -> None:
        tags = {"engine": self.spec.name}
        if record.get("outcome") != "done":
            self._metrics.push_failures.inc(tags=tags)
            return
        self._metrics.pushes.inc(tags=tags)
        pushed = int(record.get("bytes_pushed") or 0)
        if pushed > 0:  # the mock engine's pushes carry no bytes
            self._metrics.push_bytes.inc(pushed, tags=tags)
            self.kv_bytes_pushed_total += pushed
        first = record.get("first_layer_sent_at")
        last = record.get("last_layer_sent_at") or record.get("forward_done_at")
        if first is not None and last is not None:
            self._metrics.push_time.observe(max(0.0, float(last) - float(first)), tags=tags)
