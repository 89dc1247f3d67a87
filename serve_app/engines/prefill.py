"""The prefill deployment: computes a prompt's KV for a disaggregated attempt."""

from __future__ import annotations

from ray import serve

from serve_app.engines.server import EngineServer
from serve_app.protocol import EngineRequest, PrefillResult


@serve.deployment
class Prefill(EngineServer):
    async def run(self, request: EngineRequest) -> PrefillResult:
        """Run the prompt with ``max_tokens=1``; the KV reaches the decode engine through the
        connector, and the one sampled token is discarded (decode samples the first token)."""
        finish_reason = None
        async for delta in self.runner.generate(request):
            finish_reason = delta.finish_reason
        return PrefillResult(
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            finish_reason=finish_reason,
        )
