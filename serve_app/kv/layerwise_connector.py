"""Decode-first, layer-by-layer KV push for vLLM on the CPU (what vllm-ascend's
MooncakeLayerwiseConnector does on NPUs), as an out-of-tree vLLM v1 KV connector.

Load it with ``kv_transfer_config = {"kv_connector": "LayerwisePushConnector",
"kv_connector_module_path": "serve_app.kv.layerwise_connector", "kv_role": "kv_consumer" (decode)
| "kv_producer" (prefill), "kv_port": <decode listen port>}``.

The protocol, for one request (an *attempt*, keyed by the router's attempt id that travels as
``kv_transfer_params["request_id"]``):

1. Decode gets the request with ``do_remote_prefill``. Its scheduler-side connector reports the
   uncached prompt tokens as loaded asynchronously; once vLLM has allocated their blocks it POSTs
   its KV parameters to ``kv_transfer_params["metaserver"]`` (keys of MooncakeLayerwiseConnector:
   ``request_id, do_remote_prefill, do_remote_decode, remote_block_ids, remote_block_size,
   remote_engine_id, remote_host, remote_port, remote_tp_size, remote_cached_tokens``).
   ``remote_block_ids`` lists all of the request's blocks, prefix-cached ones included;
   ``remote_cached_tokens`` says how many leading tokens decode already holds.
2. Prefill gets the prompt with those parameters. In each attention layer's
   ``save_kv_layer`` (that is, as soon as the layer is computed, not after the forward) its worker
   copies the layer's KV of the blocks decode lacks and sends it over TCP to decode's worker. After
   the prompt's last chunk it sends ``done`` with the number of frames sent.
3. Decode's worker queues frames as they arrive and writes them into its KV cache at the step
   boundary (``start_load_kv``), into the request's own blocks only, and only while the request is
   still waiting; once every frame is in, vLLM schedules the request, which computes only its
   last prompt position (to get logits) and samples the first token.
4. A ``failed`` frame, or no completion before ``recv_timeout_s``, fails the request
   (``failed_recving``): vLLM finishes it with an error and frees its blocks. An aborted request
   is dropped from the worker before any later frame could be written.

``kv_connector_extra_config``: ``recv_timeout_s`` (default 60) and ``allow_debug_faults``
(default false). The latter lets a request inject faults through its kv_transfer_params, for the
tests: ``debug_corrupt_kv`` (prefill pushes noise instead of the KV, proving decode really uses
what it receives), ``debug_push_delay_s`` (prefill sleeps after each layer's push, to kill it
mid-push) and ``debug_skip_metaserver`` (decode never calls back).

Scheduler-side methods run in the engine-core process; worker-side ones in the worker process.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from serve_app.kv.transport import Frame, FrameSender, FrameServer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pd_serve.kv")

METASERVER_RETRIES = 3
METASERVER_TIMEOUT_S = 10.0
EARLY_FRAME_TTL_S = 120.0
SETTLED_MEMORY = 4096


# ---------------------------------------------------------------------------- plain values
@dataclass
class RecvSpec:
    """Decode: a request whose KV is coming; its blocks are written only while it waits."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    timeout_s: float


@dataclass
class SendSpec:
    """Prefill: what to push during this step's forward, for one request."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    local_block_ids: list[int]
    remote_block_ids: list[int]
    num_tokens: int
    last_chunk: bool
    corrupt: bool = False
    push_delay_s: float = 0.0
    error: str | None = None


@dataclass
class LayerwiseMetadata(KVConnectorMetadata):
    recv: list[RecvSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    # Requests finished (or aborted) since the last step: the decode worker forgets them before
    # writing anything, since the scheduler may already have handed their blocks to others.
    finished: list[str] = field(default_factory=list)


@dataclass
class LayerwiseStats(KVConnectorStats):
    """Per-transfer records, keyed by attempt id, shipped worker -> scheduler -> frontend."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data.get("transfers", {}))
        merged.update(other.data.get("transfers", {}))
        self.data = {"transfers": merged}
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"transfers": len(self.data.get("transfers", {}))}

    def is_empty(self) -> bool:
        return not self.data.get("transfers")


@dataclass
class _Settings:
    host: str
    port: int
    engine_id: str
    block_size: int
    tp_size: int
    recv_timeout_s: float
    allow_debug_faults: bool
    is_producer: bool

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig") -> "_Settings":
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        extra = ktc.kv_connector_extra_config or {}
        return cls(
            host=os.environ.get("VLLM_HOST_IP") or "127.0.0.1",
            port=int(ktc.kv_port),
            engine_id=str(ktc.engine_id),
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            recv_timeout_s=float(extra.get("recv_timeout_s", 60.0)),
            allow_debug_faults=bool(extra.get("allow_debug_faults", False)),
            is_producer=bool(ktc.is_kv_producer),
        )


# ---------------------------------------------------------------------------- the connector
class LayerwisePushConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        settings = _Settings.from_config(vllm_config)
        if settings.tp_size != 1:
            raise ValueError("LayerwisePushConnector supports tensor_parallel_size=1 (the CPU backend)")
        self._settings = settings
        self._scheduler = _SchedulerSide(settings) if role == KVConnectorRole.SCHEDULER else None
        self._worker: _ProducerWorker | _ConsumerWorker | None = None
        if role == KVConnectorRole.WORKER:
            self._worker = _ProducerWorker(settings) if settings.is_producer else _ConsumerWorker(settings, vllm_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LayerwiseStats(data=dict(data or {}))

    # ---- scheduler side (engine-core process) -------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: "Request") -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.forget(request.request_id)
        # Prefill copied every layer out during the forward and decode drops the request from its
        # worker before reusing anything: the blocks can go back to the pool now.
        return False, None

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._scheduler is not None:
            for req_id in connector_output.finished_recving or ():
                self._scheduler.forget(req_id)

    # ---- worker side (worker process) -------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if isinstance(self._worker, _ConsumerWorker):
            self._worker.on_step(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A waiting request is not scheduled until all its layers are in: nothing to wait for.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if isinstance(self._worker, _ProducerWorker):
            self._worker.push_layer(self._metadata(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if isinstance(self._worker, _ProducerWorker) and self.has_connector_metadata():
            self._worker.finish_step(self._metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if isinstance(self._worker, _ConsumerWorker):
            return self._worker.results()
        return KVConnectorTransferResults()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        records = self._worker.take_records()
        return LayerwiseStats(data={"transfers": records}) if records else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _metadata(self) -> LayerwiseMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LayerwiseMetadata)
        return meta


# ---------------------------------------------------------------------------- scheduler side
@dataclass
class _SendPlan:
    transfer_id: str
    host: str
    port: int
    remote_block_ids: list[int]
    prompt_len: int
    next_token: int  # the first prompt position not pushed yet
    corrupt: bool
    push_delay_s: float


class _SchedulerSide:
    def __init__(self, settings: _Settings) -> None:
        self.s = settings
        self._new_recv: list[RecvSpec] = []
        self._sending: dict[str, _SendPlan] = {}
        self._poster = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-metaserver")

    # Decode ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.s.is_producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.s.is_producer or not params or not params.get("do_remote_prefill"):
            return
        # Arm once: vLLM may call this again after the transfer, for new blocks.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return  # the whole prompt was cached locally: no transfer, no KVReady
        block_ids = list(blocks.get_block_ids()[0])
        cached = request.num_prompt_tokens - num_external_tokens
        transfer_id = str(params.get("request_id") or request.request_id)
        self._new_recv.append(
            RecvSpec(request.request_id, transfer_id, block_ids, num_external_tokens, self.s.recv_timeout_s)
        )
        body = {
            "token_ids": [],
            "request_id": transfer_id,
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": block_ids,
            "remote_block_size": self.s.block_size,
            "remote_engine_id": self.s.engine_id,
            "remote_host": self.s.host,
            "remote_port": self.s.port,
            "remote_tp_size": self.s.tp_size,
            "remote_cached_tokens": cached,
        }
        url = params.get("metaserver")
        if params.get("debug_skip_metaserver") and self.s.allow_debug_faults:
            logger.warning("request %s: metaserver callback skipped (injected fault)", transfer_id)
        elif url:
            self._poster.submit(_post_metaserver, str(url), body)
        else:
            logger.warning("request %s asks for remote prefill but names no metaserver", transfer_id)

    # Prefill ---------------------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not self.s.is_producer or not params or not params.get("do_remote_decode") or not params.get("remote_host"):
            return
        self._sending[request.request_id] = _SendPlan(
            transfer_id=str(params.get("request_id") or request.request_id),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            remote_block_ids=[int(b) for b in params.get("remote_block_ids") or []],
            prompt_len=request.num_prompt_tokens,
            next_token=int(params.get("remote_cached_tokens") or 0),
            corrupt=bool(params.get("debug_corrupt_kv")) and self.s.allow_debug_faults,
            push_delay_s=float(params.get("debug_push_delay_s") or 0.0) if self.s.allow_debug_faults else 0.0,
        )

    def build_connector_meta(self, so: "SchedulerOutput", kv_cache_manager: Any) -> LayerwiseMetadata:
        meta = LayerwiseMetadata(recv=self._new_recv, finished=sorted(so.finished_req_ids))
        self._new_recv = []
        if self._sending:
            computed_before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, scheduled in so.num_scheduled_tokens.items():
                plan = self._sending.get(req_id)
                if plan is None or plan.next_token >= plan.prompt_len:
                    continue
                end = min(computed_before.get(req_id, 0) + scheduled, plan.prompt_len)
                if end <= plan.next_token:
                    continue
                meta.send.append(self._send_spec(req_id, plan, end, kv_cache_manager))
                plan.next_token = end
        return meta

    def _send_spec(self, req_id: str, plan: _SendPlan, end: int, kv_cache_manager: Any) -> SendSpec:
        bs = self.s.block_size
        first, last = plan.next_token // bs, (end - 1) // bs
        local = list(kv_cache_manager.get_block_ids(req_id)[0])
        error = None
        if last >= len(plan.remote_block_ids) or last >= len(local):
            error = f"block list too short: need {last + 1}, remote {len(plan.remote_block_ids)}, local {len(local)}"
        return SendSpec(
            req_id=req_id,
            transfer_id=plan.transfer_id,
            host=plan.host,
            port=plan.port,
            local_block_ids=local[first : last + 1],
            remote_block_ids=plan.remote_block_ids[first : last + 1],
            num_tokens=end - plan.next_token,
            last_chunk=end >= plan.prompt_len,
            corrupt=plan.corrupt,
            push_delay_s=plan.push_delay_s,
            error=error,
        )

    def forget(self, req_id: str) -> None:
        self._sending.pop(req_id, None)


def _post_metaserver(url: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    for attempt in range(1, METASERVER_RETRIES + 1):
        try:
            req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=METASERVER_TIMEOUT_S) as resp:
                resp.read()
            return
        except Exception as exc:  # retried, then logged: the router's deadline covers the rest
            if attempt == METASERVER_RETRIES:
                logger.warning("metaserver %s unreachable for %s: %r", url, body.get("request_id"), exc)
            else:
                time.sleep(0.05 * attempt)


# ---------------------------------------------------------------------------- worker side
class _KVCaches:
    """The worker's per-layer KV tensors, addressed by the scheduler's block ids."""

    def __init__(self) -> None:
        self.layers: dict[str, torch.Tensor] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = dict(kv_caches)

    def read(self, layer: str, block_ids: list[int]) -> torch.Tensor:
        kv = self.layers[layer]
        return kv.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=kv.device))

    def write(self, layer: str, block_ids: list[int], data: torch.Tensor) -> None:
        kv = self.layers[layer]
        if tuple(data.shape[1:]) != tuple(kv.shape[1:]) or data.shape[0] != len(block_ids):
            raise ValueError(f"layer {layer}: got {tuple(data.shape)} for {len(block_ids)} blocks of {tuple(kv.shape[1:])}")
        kv.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=kv.device), data.to(kv.dtype))


class _ProducerWorker:
    def __init__(self, settings: _Settings) -> None:
        self.s = settings
        self.kv = _KVCaches()
        self.sender = FrameSender()
        self._frames: dict[str, int] = {}  # transfer -> layer frames sent so far
        self._broken: dict[str, str] = {}  # transfer -> why it cannot continue
        self._records: dict[str, dict[str, Any]] = {}
        self._finished_records: dict[str, dict[str, Any]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches)

    def push_layer(self, meta: LayerwiseMetadata, layer: str, kv_layer: torch.Tensor) -> None:
        """Called inside the attention layer, right after it wrote this step's KV."""
        for spec in meta.send:
            tid = spec.transfer_id
            if spec.error or tid in self._broken:
                continue
            index = torch.tensor(spec.local_block_ids, dtype=torch.long, device=kv_layer.device)
            data = kv_layer.index_select(0, index)  # a copy: the blocks may be freed after this step
            if spec.corrupt:
                data = torch.randn(data.shape, generator=torch.Generator().manual_seed(0)).to(data.dtype)
            header = {"type": "layer", "transfer": tid, "layer": layer, "block_ids": spec.remote_block_ids}
            try:
                self.sender.send(spec.host, spec.port, header, data)
            except Exception as exc:  # never fail the forward: fail the transfer
                self._broken[tid] = f"push to {spec.host}:{spec.port} failed: {exc!r}"
                logger.warning("transfer %s: %s", tid, self._broken[tid])
                continue
            now = time.time()
            self._frames[tid] = self._frames.get(tid, 0) + 1
            record = self._records.setdefault(tid, {"role": "prefill", "layers_pushed": 0, "tokens_pushed": 0, "push_times": []})
            record["layers_pushed"] += 1
            record["push_times"].append(now)
            record.setdefault("first_layer_sent_at", now)
            record["last_layer_sent_at"] = now
            if spec.push_delay_s:
                time.sleep(spec.push_delay_s)  # injected fault: a slow push, to be killed mid-way

    def finish_step(self, meta: LayerwiseMetadata) -> None:
        """After the step's forward: account the step, and close transfers whose prompt is done."""
        now = time.time()
        for spec in meta.send:
            tid = spec.transfer_id
            record = self._records.setdefault(tid, {"role": "prefill", "layers_pushed": 0, "tokens_pushed": 0, "push_times": []})
            record["tokens_pushed"] += spec.num_tokens if not (spec.error or tid in self._broken) else 0
            record["forward_done_at"] = now
            record["steps"] = record.get("steps", 0) + 1
            if not (spec.last_chunk or spec.error or tid in self._broken):
                continue
            reason = spec.error or self._broken.get(tid)
            header = (
                {"type": "failed", "transfer": tid, "reason": reason}
                if reason
                else {"type": "done", "transfer": tid, "frames": self._frames.get(tid, 0), "layers": len(self.kv.layers)}
            )
            try:
                self.sender.send(spec.host, spec.port, header)
            except OSError as exc:
                reason = reason or f"done signal failed: {exc!r}"
            record["outcome"] = "failed" if reason else "done"
            if reason:
                record["error"] = reason
            self._finished_records[tid] = self._records.pop(tid)
            self._frames.pop(tid, None)
            self._broken.pop(tid, None)

    def take_records(self) -> dict[str, dict[str, Any]]:
        records, self._finished_records = self._finished_records, {}
        return records

    def close(self) -> None:
        self.sender.close()


@dataclass
class _Incoming:
    spec: RecvSpec
    deadline: float
    armed_at: float
    frames: int = 0
    layers: set[str] = field(default_factory=set)
    expected_frames: int | None = None
    failed: str | None = None
    first_at: float | None = None
    last_at: float | None = None


class _ConsumerWorker:
    def __init__(self, settings: _Settings, vllm_config: "VllmConfig") -> None:
        self.s = settings
        self.kv = _KVCaches()
        self.server = FrameServer(settings.host, settings.port)
        self._waiting: dict[str, _Incoming] = {}  # transfer -> state
        self._by_req: dict[str, str] = {}  # engine request id -> transfer
        self._early: dict[str, list[Frame]] = {}  # frames of transfers not armed yet
        self._settled: OrderedDict[str, None] = OrderedDict()  # recent transfers over: late frames dropped
        self._done: set[str] = set()  # engine request ids: all frames in
        self._failed: set[str] = set()  # engine request ids: transfer failed
        self._records: dict[str, dict[str, Any]] = {}
        logger.info("kv receiver listening on %s:%d", *self.server.address)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches)

    def on_step(self, meta: LayerwiseMetadata) -> None:
        now = time.time()
        for spec in meta.recv:
            self._waiting[spec.transfer_id] = _Incoming(spec=spec, deadline=now + spec.timeout_s, armed_at=now)
            self._by_req[spec.req_id] = spec.transfer_id
        # Drop requests finished (aborted) while waiting before writing anything. vLLM holds the
        # blocks of an aborted request that waits for KV until the connector reports its receive
        # over: report it, now that no frame can land in those blocks any more.
        for req_id in meta.finished:
            tid = self._by_req.pop(req_id, None)
            if tid is not None and tid in self._waiting:
                self._record(self._waiting.pop(tid), "aborted")
                self._done.add(req_id)
        for spec in meta.recv:
            for frame in self._early.pop(spec.transfer_id, []):
                self._apply(frame)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                frame = self.server.inbox.get_nowait()
            except Exception:
                break
            self._apply(frame)

    def _apply(self, frame: Frame) -> None:
        tid = frame.header.get("transfer")
        state = self._waiting.get(tid)
        if state is None:
            if tid not in self._settled:
                # Not armed yet: the push beat this worker's metadata. Keep it until armed.
                self._early.setdefault(tid, []).append(frame)
            return
        kind = frame.header.get("type")
        try:
            if kind == "layer":
                block_ids = [int(b) for b in frame.header["block_ids"]]
                if not set(block_ids) <= set(state.spec.block_ids):
                    raise ValueError(f"frame names blocks {block_ids} outside the request's {state.spec.block_ids}")
                assert frame.tensor is not None
                self.kv.write(frame.header["layer"], block_ids, frame.tensor)
                state.frames += 1
                state.layers.add(frame.header["layer"])
                state.first_at = state.first_at or frame.received_at
                state.last_at = frame.received_at
            elif kind == "done":
                state.expected_frames = int(frame.header["frames"])
            elif kind == "failed":
                state.failed = str(frame.header.get("reason") or "prefill reported a failure")
        except Exception as exc:  # a bad frame fails its request, never the engine
            state.failed = f"bad frame: {exc!r}"
        self._settle(state)

    def _settle(self, state: _Incoming) -> None:
        tid, req_id = state.spec.transfer_id, state.spec.req_id
        if state.failed is None and state.expected_frames is not None and state.frames >= state.expected_frames:
            if len(state.layers) < len(self.kv.layers):
                state.failed = f"{len(state.layers)} of {len(self.kv.layers)} layers arrived"
            else:
                del self._waiting[tid]
                self._done.add(req_id)
                self._record(state, "done")
                return
        if state.failed is not None:
            logger.warning("transfer %s failed: %s", tid, state.failed)
            del self._waiting[tid]
            self._failed.add(req_id)
            self._record(state, "failed")

    def results(self) -> KVConnectorTransferResults:
        self._drain()
        now = time.time()
        for state in list(self._waiting.values()):
            if now > state.deadline:
                state.failed = f"no complete KV within {state.spec.timeout_s:.0f}s"
                self._settle(state)
        for tid in [t for t, frames in self._early.items() if now - frames[0].received_at > EARLY_FRAME_TTL_S]:
            del self._early[tid]
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        # Failed receives are reported as finished too, so vLLM leaves its waiting state.
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def _record(self, state: _Incoming, outcome: str) -> None:
        self._settled[state.spec.transfer_id] = None
        while len(self._settled) > SETTLED_MEMORY:
            self._settled.popitem(last=False)
        self._records[state.spec.transfer_id] = {
            "role": "decode",
            "outcome": outcome,
            "error": state.failed,
            "tokens_received": state.spec.num_tokens if outcome == "done" else 0,
            "frames_received": state.frames,
            "layers_received": len(state.layers),
            "armed_at": state.armed_at,
            "first_layer_at": state.first_at,
            "last_layer_at": state.last_at,
            "settled_at": time.time(),
        }

    def take_records(self) -> dict[str, dict[str, Any]]:
        records, self._records = self._records, {}
        return records

    def close(self) -> None:
        self.server.close()
