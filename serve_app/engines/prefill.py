"""The prefill deployment: computes a prompt's KV for a disaggregated attempt."""

from __future__ import annotations

from ray import serve

from serve_app.engines.server import EngineServer
from serve_app.protocol import EngineRequest, PrefillResult


class InjectedPrefillFault(RuntimeError):
    """Raised on request when the app runs with ``debug_faults`` (tests only)."""


@serve.deployment
class Prefill(EngineServer):
    async def run(self, request: EngineRequest) -> PrefillResult:
        """Run the prompt with ``max_tokens=1``. The connector pushes each layer's KV to the decode
        engine named in ``kv_transfer_params`` as it is computed; the one token sampled here is
        discarded (decode samples the first token itself)."""
        params = request.kv_transfer_params or {}
        target = params.get("debug_prefill_raise")
        if self.spec.debug_faults and (target is True or target == self.spec.name):
            self.runner.requests.put(request.request_id, {"fault": "injected"})
            raise InjectedPrefillFault(f"{self.spec.name}: injected prefill failure")
        finish_reason = None
        async for delta in self.runner.generate(request):
            finish_reason = delta.finish_reason
        if finish_reason not in ("stop", "length"):
            raise RuntimeError(f"{self.spec.name}: prefill of {request.request_id} ended with {finish_reason!r}")
        return PrefillResult(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            finish_reason=finish_reason,
        )
