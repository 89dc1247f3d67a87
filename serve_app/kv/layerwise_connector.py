"""Decode-first, layer-by-layer KV push for vLLM on the CPU (what vllm-ascend's
MooncakeLayerwiseConnector does on NPUs), as an out-of-tree vLLM v1 KV connector.

Load it with ``kv_transfer_config = {"kv_connector": "LayerwisePushConnector",
"kv_connector_module_path": "serve_app.kv.layerwise_connector", "kv_role": "kv_consumer" (decode)
| "kv_producer" (prefill), "kv_port": <decode listen port>}``.

This class is only the facade vLLM talks to. The work is split by role and process, as in
vLLM's own connectors:

* ``scheduler_side.SchedulerSide`` (engine-core process): decides what to receive and to push,
  posts decode's KV parameters to the metaserver;
* ``producer.ProducerWorker`` (prefill worker process): pushes each layer as it is computed;
* ``consumer.ConsumerWorker`` (decode worker process): receives, checks and writes;
* ``wire`` (both workers): the versioned frame format; ``metadata``: the plain values passed
  between them;
* ``wakeup`` (decode): the engine core's doorbell, rung when a transfer can be settled, so an
  engine whose requests all wait for KV does not poll for them.

The protocol of one transfer is described in docs/design.md ("The KV side channel").
``kv_connector_extra_config`` keys: ``recv_timeout_s`` (set by pd-serve from the router's
deadlines), ``kv_host`` (the address decode's side channel listens on and posts), and the side
channel's limits, named and defaulted as in ``metadata.Settings``: ``max_connections``,
``max_connections_per_peer``, ``max_pending_connections``, ``max_pending_per_peer``,
``handshake_timeout_s``, ``max_early_transfers``, ``max_early_bytes``,
``max_early_transfers_per_connection``, ``max_early_bytes_per_connection``, ``early_wait_s``,
``early_ttl_s``, ``ack_timeout_s``.

Test-only behaviour (fault injection) lives in subclasses in the tests, which swap in their own
``scheduler_side_cls`` / ``producer_cls`` / ``consumer_cls``; nothing here reads a fault flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from serve_app.kv.consumer import ConsumerWorker
from serve_app.kv.metadata import LayerwiseMetadata, LayerwiseStats, Settings
from serve_app.kv.producer import ProducerWorker
from serve_app.kv.scheduler_side import SchedulerSide
from serve_app.kv.wakeup import Doorbell, install_core_wait
from serve_app.runtime.private_symbols import check

# The base class's hooks for its subclasses that are not part of its documented interface.
SYMBOLS = (
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1._get_connector_metadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1._kv_cache_manager",
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class LayerwisePushConnector(KVConnectorBase_V1):
    scheduler_side_cls: type[SchedulerSide] = SchedulerSide
    producer_cls: type[ProducerWorker] = ProducerWorker
    consumer_cls: type[ConsumerWorker] = ConsumerWorker

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        # Nothing to stand aside to: without these the connector cannot move KV at all, so the
        # engine does not start, and says which symbol changed.
        problems = [problem for name in SYMBOLS if (problem := check(name)) is not None]
        if problems:
            raise RuntimeError(f"LayerwisePushConnector does not support this vLLM: {'; '.join(problems)}")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        settings = Settings.from_config(vllm_config)
        if settings.tp_size != 1:
            raise ValueError("LayerwisePushConnector supports tensor_parallel_size=1 (the CPU backend)")
        self.settings = settings
        self.scheduler_side = self._make_scheduler_side(settings) if role == KVConnectorRole.SCHEDULER else None
        self.worker: ProducerWorker | ConsumerWorker | None = None
        self._reported_counters: dict[str, int] = {}
        if role == KVConnectorRole.WORKER:
            self.worker = self.producer_cls(settings) if settings.is_producer else self.consumer_cls(settings)

    def _make_scheduler_side(self, settings: Settings) -> SchedulerSide:
        doorbell = None
        if not settings.is_producer:
            # Decode: its engine core waits on this doorbell between forward-less steps instead
            # of polling its worker every millisecond (kv/wakeup.py).
            doorbell = Doorbell()
            if not install_core_wait(doorbell):
                doorbell.close()
                doorbell = None
        return self.scheduler_side_cls(settings, doorbell=doorbell)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LayerwiseStats(data=dict(data or {}))

    # ---- scheduler side (engine-core process) -------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_side is not None
        self.scheduler_side.forget(request.request_id)
        # Prefill copied every layer out during the forward and decode drops the request from its
        # worker before reusing anything: the blocks can go back to the pool now.
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.on_connector_output(connector_output)

    # ---- worker side (worker process) -------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if isinstance(self.worker, ConsumerWorker):
            self.worker.on_step(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A waiting request is not scheduled until all its layers are in: nothing to wait for.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if isinstance(self.worker, ProducerWorker):
            self.worker.push_layer(self._metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if isinstance(self.worker, ProducerWorker) and self.has_connector_metadata():
            self.worker.finish_step(self._metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if isinstance(self.worker, ConsumerWorker):
            finished, failed = self.worker.results()
            return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)
        return KVConnectorTransferResults()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        records = self.worker.take_records()
        counters = self.worker.counters()
        if not records and counters == self._reported_counters:
            return None
        self._reported_counters = counters
        return LayerwiseStats(data={"transfers": records, **({"counters": counters} if counters else {})})

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()

    def _metadata(self) -> LayerwiseMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LayerwiseMetadata)
        return meta
