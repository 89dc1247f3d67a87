"""The decode deployment: streams an attempt's tokens (and, disaggregated, its KVReady first)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from serve_app.engines.server import EngineServer
from serve_app.protocol import EngineEvent, EngineRequest


@serve.deployment
class Decode(EngineServer):
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        async for delta in self.runner.generate(request):
            yield delta
