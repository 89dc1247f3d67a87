"""The decode deployment: streams an attempt's tokens. For a disaggregated attempt the router's
KV parameters name the prefill replica's relay as the metaserver callback: the decode engine's
connector posts its blocks there once it has allocated them, and waits for their KV."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ray import serve

from serve_app.engines.server import EngineServer
from serve_app.protocol import EngineEvent, EngineRequest


@serve.deployment
class Decode(EngineServer):
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        # Closing the stream (the router cancels the attempt) closes the engine's: it aborts the
        # request and frees its blocks.
        async with contextlib.aclosing(self.runner.generate(request)) as events:
            async for event in events:
                yield event
