"""The prefill worker's half of the layerwise push (worker process).

During the forward, right after each attention layer wrote this step's KV (``save_kv_layer``),
the layer's blocks that the decode engine lacks are sent to it: one frame per layer and request,
carrying the transfer's secret. After the prompt's last chunk a ``done`` frame says how many
layer frames were sent; a push that broke sends ``failed`` instead (when decode is reachable at
all), and either way the transfer's record says so, which is how ``Prefill.run`` learns of it.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import torch

from serve_app.kv.caches import KVCaches
from serve_app.kv.metadata import LayerwiseMetadata, SendSpec, Settings, new_record
from serve_app.kv.wire import KIND_DONE, KIND_FAILED, KIND_LAYER, encode_frame, tensor_bytes

logger = logging.getLogger("pd_serve.kv")

SEND_TIMEOUT_S = 10.0


class FrameSender:
    """One connection per destination, opened on first use and reopened once after a failure."""

    def __init__(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}

    def send(self, host: str, port: int, parts: list[bytes | memoryview]) -> None:
        """Send one encoded frame; raises OSError when the destination cannot be reached."""
        key = (host, port)
        for attempt in range(2):
            conn = self._conns.get(key)
            try:
                if conn is None:
                    conn = socket.create_connection(key, timeout=self.timeout_s)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._conns[key] = conn
                for part in parts:
                    conn.sendall(part)
                return
            except OSError:
                self.drop(key)
                if attempt == 1:
                    raise

    def drop(self, key: tuple[str, int]) -> None:
        conn = self._conns.pop(key, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        for key in list(self._conns):
            self.drop(key)


class ProducerWorker:
    def __init__(self, settings: Settings, sender: FrameSender | None = None) -> None:
        self.s = settings
        self.kv = KVCaches()
        self.sender = sender or FrameSender()
        self._frames: dict[str, int] = {}  # transfer -> layer frames sent so far
        self._broken: dict[str, str] = {}  # transfer -> why it cannot continue
        self._records: dict[str, dict[str, Any]] = {}
        self._finished_records: dict[str, dict[str, Any]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches, self.s.block_size)

    @property
    def compat(self) -> int:
        assert self.kv.geometry is not None, "KV caches not registered"
        return self.kv.geometry.compat

    def layer_payload(self, meta: LayerwiseMetadata, spec: SendSpec, layer: str, kv_layer: torch.Tensor) -> torch.Tensor:
        """This layer's blocks to send for ``spec``: a copy, since the blocks may be freed and
        reused once this step is over. (Test subclasses override it to inject faults.)"""
        index = torch.tensor(spec.local_block_ids, dtype=torch.long, device=kv_layer.device)
        return kv_layer.index_select(0, index)

    def push_layer(self, meta: LayerwiseMetadata, layer: str, kv_layer: torch.Tensor) -> None:
        """Called inside the attention layer, right after it wrote this step's KV."""
        for spec in meta.send:
            tid = spec.transfer_id
            if spec.error or tid in self._broken:
                continue
            data = self.layer_payload(meta, spec, layer, kv_layer).contiguous()
            header = {"transfer": tid, "secret": spec.secret, "layer": layer, "block_ids": spec.remote_block_ids}
            try:
                self.sender.send(spec.host, spec.port, encode_frame(KIND_LAYER, self.compat, header, [tensor_bytes(data)]))
            except Exception as exc:  # never fail the forward: fail the transfer
                self._broken[tid] = f"push to {spec.host}:{spec.port} failed: {exc!r}"
                logger.warning("transfer %s: %s", tid, self._broken[tid])
                continue
            now = time.time()
            self._frames[tid] = self._frames.get(tid, 0) + 1
            record = self._records.setdefault(tid, new_record("prefill"))
            record["pushed_to"] = f"{spec.host}:{spec.port}"  # the decode engine's side channel
            record["layers_pushed"] += 1
            record["bytes_pushed"] += data.numel() * data.element_size()
            record["push_times"].append(now)
            record.setdefault("first_layer_sent_at", now)
            record["last_layer_sent_at"] = now

    def finish_step(self, meta: LayerwiseMetadata) -> None:
        """After the step's forward: account the step, and close transfers whose prompt is done."""
        now = time.time()
        for spec in meta.send:
            tid = spec.transfer_id
            record = self._records.setdefault(tid, new_record("prefill"))
            record["tokens_pushed"] += spec.num_tokens if not (spec.error or tid in self._broken) else 0
            record["forward_done_at"] = now
            record["steps"] = record.get("steps", 0) + 1
            if not (spec.last_chunk or spec.error or tid in self._broken):
                continue
            reason = spec.error or self._broken.get(tid)
            if reason:
                parts = encode_frame(KIND_FAILED, self.compat, {"transfer": tid, "secret": spec.secret, "reason": reason})
            else:
                parts = encode_frame(KIND_DONE, self.compat, {"transfer": tid, "secret": spec.secret, "frames": self._frames.get(tid, 0)})
            try:
                self.sender.send(spec.host, spec.port, parts)
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

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.sender.close()
