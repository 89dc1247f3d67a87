"""What an engine replica needs of the engine it owns: the seam between the Serve deployments
(engines/server.py, prefill.py, decode.py) and the engines behind them, vLLM's ``AsyncLLM``
(engines/vllm_runner.py) or the mock engine (engines/mock_runner.py). Both satisfy this Protocol;
tests/unit/test_runner_protocol.py checks it, so a method one of them lacks fails there and not
at a replica's first call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from serve_app.engines.records import Recent
from serve_app.wire.protocol import EngineRejected, EngineRequest, EngineStats, Role, TokenDelta


@runtime_checkable
class EngineRunner(Protocol):
    name: str
    role: Role
    # Recent requests' records by request id (prompt tokens not computed, outcome): ``inspect``.
    requests: Recent

    async def start(self) -> None:
        """Start the engine (its processes, its KV side channel); the replica is up after it."""

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineRejected]:
        """The request's output as coalesced deltas; closing the iterator early aborts it."""

    async def abort(self, request_id: str) -> None: ...

    def held(self) -> list[str]:
        """The ids of the requests the engine holds (those ``stats().inflight`` counts)."""

    async def check_health(self) -> None:
        """Raise when the engine is dead (Serve then restarts the replica)."""

    def stats(self) -> EngineStats:
        """The cheap load report the routers poll and the autoscaling metrics are made of."""

    def transfers(self) -> dict[str, Any]:
        """Recent KV transfers' records by transfer id (the connector's)."""

    async def transfer_record(self, transfer_id: str, timeout_s: float) -> dict[str, Any] | None:
        """One transfer's record, once the connector has reported it (None after the timeout)."""

    def shutdown(self) -> None: ...
