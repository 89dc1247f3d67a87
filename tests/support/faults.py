"""Fault injection for the engine tests, kept out of serve_app's request paths.

Test apps are built with ``FAULTS`` (``build_app(args, FAULTS)``): their engines load
``FaultyConnector`` (a subclass of the real connector, by module path) and run as
``FaultyPrefill`` deployments. A request asks for a fault through its own prompt: token ids that
start with ``MARKER``, then the fault's code, then how many attempts it applies to (attempt n
of a request has an id ending in ``-n``). Every other request runs exactly as in production.

This module is imported inside Ray replicas and vLLM's engine processes: Ray puts the test
driver's working directory (the repo root) on their ``sys.path``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from ray import serve

from serve_app.app import Plugins
from serve_app.engines.prefill import Prefill, PrefillFailed
from serve_app.kv.layerwise_connector import LayerwisePushConnector
from serve_app.kv.metadata import LayerwiseMetadata, SendSpec
from serve_app.kv.producer import ProducerWorker
from serve_app.kv.scheduler_side import SchedulerSide
from serve_app.wire.protocol import EngineRequest, EngineStats, PrefillResult

logger = logging.getLogger("pd_serve.tests.faults")

MARKER = [7, 3, 7, 3, 7]
CORRUPT_KV = 901  # prefill pushes noise instead of the KV (proves decode uses what it receives)
PUSH_DELAY = 902  # prefill sleeps PUSH_DELAY_S after each layer's push (to be killed mid-push)
SKIP_METASERVER = 903  # decode never calls the metaserver back
PREFILL_RAISE = 904  # the prefill deployment raises before running the engine
BREAK_PUSH = 905  # prefill pushes to a port nobody listens on: the push breaks
PREFILL_UNHEALTHY = 906  # the prefill replica reports itself unhealthy for UNHEALTHY_S after this prompt
UNHEALTHY_S = 4.0
PUSH_DELAY_S = 1.5


def faulty_prompt(code: int, prompt: list[int], attempts: int = 1) -> list[int]:
    """``prompt`` with a request for fault ``code`` on its first ``attempts`` attempts."""
    return [*MARKER, code, 10 + attempts, *prompt]


def fault_of(prompt_token_ids: Any, attempt_id: str) -> int | None:
    """The fault this attempt asked for, if any."""
    ids = list(prompt_token_ids[: len(MARKER) + 2])
    if ids[: len(MARKER)] != MARKER or len(ids) < len(MARKER) + 2:
        return None
    code, attempts = ids[len(MARKER)], ids[len(MARKER) + 1] - 10
    try:
        number = int(attempt_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None
    return code if number <= attempts else None


class FaultyMetadata(LayerwiseMetadata):
    """The real metadata plus, per transfer, the fault its producer should inject."""

    faults: dict[str, int]


class FaultySchedulerSide(SchedulerSide):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._faults: dict[str, int] = {}
        self._skip_post = False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        self._skip_post = fault_of(request.prompt_token_ids, str(params.get("request_id", ""))) == SKIP_METASERVER
        try:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
        finally:
            self._skip_post = False

    def submit_post(self, url: str, body: dict[str, Any]) -> None:
        if self._skip_post:
            logger.warning("request %s: metaserver callback skipped (injected fault)", body.get("request_id"))
            return
        super().submit_post(url, body)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        plan = self._sending.get(request.request_id)
        if plan is not None:
            code = fault_of(request.prompt_token_ids, plan.transfer_id)
            if code in (CORRUPT_KV, PUSH_DELAY, BREAK_PUSH):
                self._faults[plan.transfer_id] = code

    def build_connector_meta(self, so: Any, kv_cache_manager: Any) -> LayerwiseMetadata:
        meta = super().build_connector_meta(so, kv_cache_manager)
        faulty = FaultyMetadata(
            recv=meta.recv, send=meta.send, finished=meta.finished, wake_port=meta.wake_port, wake_token=meta.wake_token
        )
        faulty.faults = {s.transfer_id: self._faults[s.transfer_id] for s in meta.send if s.transfer_id in self._faults}
        return faulty


class FaultyProducer(ProducerWorker):
    def layer_payload(self, meta: LayerwiseMetadata, spec: SendSpec, layer: str, kv_layer: torch.Tensor) -> torch.Tensor:
        data = super().layer_payload(meta, spec, layer, kv_layer)
        if getattr(meta, "faults", {}).get(spec.transfer_id) == CORRUPT_KV:
            data = torch.randn(data.shape, generator=torch.Generator().manual_seed(0)).to(data.dtype)
        return data

    def push_layer(self, meta: LayerwiseMetadata, layer: str, kv_layer: torch.Tensor) -> None:
        for spec in meta.send:
            if getattr(meta, "faults", {}).get(spec.transfer_id) == BREAK_PUSH:
                spec.port = 1  # nothing listens there: the connection is refused
        super().push_layer(meta, layer, kv_layer)
        if PUSH_DELAY in getattr(meta, "faults", {}).values():
            time.sleep(PUSH_DELAY_S)


class FaultyConnector(LayerwisePushConnector):
    scheduler_side_cls = FaultySchedulerSide
    producer_cls = FaultyProducer


class _FaultyPrefill(Prefill.func_or_class):  # type: ignore[misc]
    _unhealthy_until = 0.0

    async def run(self, request: EngineRequest, replica: str | None = None) -> PrefillResult:
        fault = fault_of(request.prompt_token_ids, request.request_id)
        if fault == PREFILL_RAISE:
            self.runner.requests.put(request.request_id, {"fault": "injected"})
            raise PrefillFailed(f"{self.spec.name}: injected prefill failure")
        if fault == PREFILL_UNHEALTHY:
            self._unhealthy_until = time.monotonic() + UNHEALTHY_S
        return await super().run(request, replica)

    async def stats(self, replica: str | None = None) -> EngineStats:
        stats = await super().stats(replica)
        if time.monotonic() < self._unhealthy_until:
            stats.healthy = False
        return stats


FaultyPrefill = serve.deployment(_FaultyPrefill)

FAULTS = Plugins(prefill_cls=FaultyPrefill, kv_connector=f"{__name__}:FaultyConnector")
