"""The prefill worker's half of the layerwise push (worker process).

During the forward, right after each attention layer wrote this step's KV (``save_kv_layer``),
the layer's blocks that the decode engine lacks are sent to it: one frame per layer and request,
carrying the transfer's secret. In the prompt's last chunk, a ``done`` frame that says how many
layer frames were sent follows the last layer's frame at once: the rest of the forward (the last
layer's MLP, the final norm, the logits, the sampled token that nobody reads) writes no KV, and
the decode engine, which computes its own first token, need not wait for it (on a 2,048-token
prompt of the medium benchmark model that tail is about a tenth of the prefill). A transfer that
did not see every layer in its last step (a model whose attention layers are not all ones with
a cache of their own) gets its done frame after the forward instead. A push that broke sends
``failed`` (when decode is reachable at all), and either way the transfer's record says so,
which is how ``Prefill.run`` learns of it.

A push counts as done only once decode acknowledged its done frame (an ``ack`` frame back on the
same connection, wire version 2): ``sendall`` returning only means the bytes are in this host's
kernel buffer, and a receiver that never read them (no slot, a dead worker) would otherwise be
reported as a delivered push while decode waits out its deadline. The step's done frames all go
out first and their acks are then awaited together, up to ``ack_timeout_s``; a negative ack, a
connection that ends, or no ack in time fail the push, which the router then retries at once.
One connection per destination carries every concurrent transfer to it, so acks name their
transfer and a reader thread per connection files them for whoever waits.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from serve_app.kv.caches import KVCaches
from serve_app.kv.metadata import LayerwiseMetadata, SendSpec, Settings, new_record
from serve_app.kv.wire import (
    KIND_DONE,
    KIND_FAILED,
    KIND_LAYER,
    TO_PREFILL,
    AckHeader,
    WireError,
    check_ack_sizes,
    encode_frame,
    parse_ack,
    printable,
    read_preamble,
    recv_exact,
    side_channel_socket,
    tensor_bytes,
)

logger = logging.getLogger("pd_serve.kv")

SEND_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0
SWEEP_INTERVAL_S = 1.0  # how often the sender closes connections whose decode end has gone
# A destination that failed a send twice (on a fresh connection too) fails the sends of the next
# seconds at once: each would stall the prefill forward for the timeouts above, for every
# transfer of the batch to that host.
FAILED_DESTINATION_S = 5.0
ACK_MEMORY = 4096  # acks kept per connection until their transfer's done frame asks for them
DEAD_MEMORY = 4096  # transfers failed mid-prompt whose later chunks are skipped


class Link:
    """One connection to a decode engine's side channel, and the acks read back on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._cond = threading.Condition()
        self._acks: OrderedDict[str, AckHeader] = OrderedDict()  # transfer -> its answer, until taken
        self.dead: str | None = None  # why no more acks can come
        threading.Thread(target=self._read, name="kv-ack-reader", daemon=True).start()

    def _read(self) -> None:
        why = "the decode engine closed the connection"
        try:
            poller = select.poll()  # not select(): a worker's descriptors can pass FD_SETSIZE
            poller.register(self.sock, select.POLLIN)
            while True:
                # Idle for as long as it likes between acks (the socket's timeout is for sends
                # and for a frame that stalls halfway).
                poller.poll()
                pre = read_preamble(self.sock, TO_PREFILL)
                if pre is None:
                    break
                check_ack_sizes(pre)
                self._file(parse_ack(recv_exact(self.sock, pre.header_len)))
        except (WireError, OSError, ValueError) as exc:
            why = f"the ack stream broke: {exc}"
        finally:
            with self._cond:
                self.dead = self.dead or why
                self._cond.notify_all()

    def _file(self, ack: AckHeader) -> None:
        with self._cond:
            self._acks[ack.transfer] = ack
            while len(self._acks) > ACK_MEMORY:  # answers nobody asked for (yet) stay bounded
                self._acks.popitem(last=False)
            self._cond.notify_all()

    def wait_ack(self, transfer: str, deadline: float) -> str | None:
        """None once decode acknowledged ``transfer``; why not, on a negative ack, a dead
        connection or the deadline (``time.monotonic``)."""
        with self._cond:
            while True:
                ack = self._acks.pop(transfer, None)
                if ack is not None:
                    return None if ack.ok else f"the decode engine failed the transfer: {ack.reason or 'no reason given'}"
                if self.dead is not None:
                    return f"no acknowledgement: {self.dead}"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "the decode engine did not acknowledge the transfer in time"
                self._cond.wait(remaining)

    def close(self) -> None:
        with self._cond:
            self.dead = self.dead or "closed by the sender"
            self._cond.notify_all()
        for how in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):
            try:
                how()
            except OSError:
                pass


class FrameSender:
    """One connection per destination, opened on first use and reopened once after a failure
    (or when its ack reader saw it end). Used from the worker's thread only."""

    def __init__(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._links: dict[tuple[str, int], Link] = {}
        self._next_sweep = 0.0
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}  # destination -> (until, why)

    def send(self, host: str, port: int, parts: list[bytes | memoryview]) -> Link:
        """Send one encoded frame; returns the connection it went on (where its ack will come).
        Raises OSError when the destination cannot be reached."""
        self._sweep()
        key = (host, port)
        failed = self._failed.get(key)
        if failed is not None:
            if time.monotonic() < failed[0]:
                raise ConnectionError(f"{host}:{port} failed a send in the last {FAILED_DESTINATION_S:g} s: {failed[1]}")
            del self._failed[key]
        for attempt in range(2):
            link = self._links.get(key)
            try:
                if link is None or link.dead is not None:
                    self.drop(key)
                    link = self._connect(key)
                for part in parts:
                    link.sock.sendall(part)
                return link
            except OSError as exc:
                self.drop(key)
                if attempt == 1:
                    self._failed[key] = (time.monotonic() + FAILED_DESTINATION_S, repr(exc))
                    raise
        raise AssertionError("unreachable")

    def _connect(self, key: tuple[str, int]) -> Link:
        conn = socket.create_connection(key, timeout=min(CONNECT_TIMEOUT_S, self.timeout_s))
        try:
            conn.settimeout(self.timeout_s)
            side_channel_socket(conn)
            link = Link(conn)
        except BaseException:
            conn.close()
            raise
        self._conns[key], self._links[key] = conn, link
        return link

    def _sweep(self) -> None:
        """Close the connections whose other end has gone (a decode engine that stopped: its
        successor listens on another port, so nothing would send on them again), at most once a
        second. Here, in the sending thread, not in their ack readers: a socket is closed only
        where it is used."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        for key in [key for key, link in self._links.items() if link.dead is not None]:
            self.drop(key)
        for key in [key for key, (until, _) in self._failed.items() if until <= now]:
            del self._failed[key]

    def drop(self, key: tuple[str, int]) -> None:
        self._conns.pop(key, None)
        link = self._links.pop(key, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for key in list(self._links):
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
        self._step_layers: dict[str, set[str]] = {}  # transfer -> layers pushed in this step
        self._done_sent: dict[str, Link] = {}  # transfer -> where its done frame went, this step
        self._open: dict[str, SendSpec] = {}  # engine request id -> its transfer's latest chunk, until it ends
        # Transfers that failed before their prompt's last chunk: its later chunks send nothing (a
        # push that went on after a lost chunk would end with a done frame counting only the
        # frames after it), until its last chunk; one whose request is aborted meanwhile sends
        # no more chunks and is forgotten among the oldest (DEAD_MEMORY).
        self._dead: OrderedDict[str, None] = OrderedDict()

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
            if spec.error or tid in self._broken or tid in self._dead:
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
            pushed = self._step_layers.setdefault(tid, set())
            pushed.add(layer)
            if spec.last_chunk and len(pushed) == len(self.kv.layers):
                self._send_done(spec)

    def _send_done(self, spec: SendSpec) -> None:
        """The done frame of a transfer whose every layer is sent, now, not after the forward."""
        tid = spec.transfer_id
        parts = encode_frame(KIND_DONE, self.compat, {"transfer": tid, "secret": spec.secret, "frames": self._frames.get(tid, 0)})
        try:
            self._done_sent[tid] = self.sender.send(spec.host, spec.port, parts)
        except Exception as exc:  # never fail the forward: fail the transfer
            self._broken[tid] = f"done signal failed: {exc!r}"
            return
        self._records[tid]["done_sent_at"] = time.time()

    def finish_step(self, meta: LayerwiseMetadata) -> None:
        """After the step's forward: account the step, and close transfers whose prompt is done
        (once decode acknowledged them: module docstring)."""
        now = time.time()
        awaiting: list[tuple[SendSpec, Link]] = []
        self._end_aborted(meta)
        for spec in meta.send:
            tid = spec.transfer_id
            if tid in self._dead:
                if spec.last_chunk:
                    del self._dead[tid]
                continue
            self._open[spec.req_id] = spec
            record = self._records.setdefault(tid, new_record("prefill"))
            record["tokens_pushed"] += spec.num_tokens if not (spec.error or tid in self._broken) else 0
            record["forward_done_at"] = now
            record["steps"] = record.get("steps", 0) + 1
            if not (spec.last_chunk or spec.error or tid in self._broken):
                continue
            if tid in self._done_sent:
                awaiting.append((spec, self._done_sent[tid]))
                continue
            reason = spec.error or self._broken.get(tid)
            if reason:
                parts = self._failed_frame(spec, reason)
            else:
                parts = encode_frame(KIND_DONE, self.compat, {"transfer": tid, "secret": spec.secret, "frames": self._frames.get(tid, 0)})
            try:
                link = self.sender.send(spec.host, spec.port, parts)
            except OSError as exc:
                reason = reason or f"done signal failed: {exc!r}"
            if reason:
                self._finish(spec, reason)
            else:
                awaiting.append((spec, link))
        self._step_layers.clear()
        self._done_sent.clear()
        deadline = time.monotonic() + self.s.ack_timeout_s
        for spec, link in awaiting:
            problem = link.wait_ack(spec.transfer_id, deadline)
            if problem is not None:
                logger.warning("transfer %s: push failed: %s", spec.transfer_id, printable(problem))
            self._finish(spec, problem)

    def _end_aborted(self, meta: LayerwiseMetadata) -> None:
        """Requests that finished between chunks of their push (aborted): their transfer ends
        here, and decode hears of it now rather than at its receive deadline."""
        for req_id in meta.finished:
            spec = self._open.get(req_id)
            if spec is None:
                continue
            reason = "the prefill request was aborted before its push ended"
            try:
                self.sender.send(spec.host, spec.port, self._failed_frame(spec, reason))
            except OSError:
                pass  # decode fails it at its deadline
            self._finish(spec, reason)
            self._dead.pop(spec.transfer_id, None)  # its request is over: no chunk follows

    def _failed_frame(self, spec: SendSpec, reason: str) -> list[bytes | memoryview]:
        return encode_frame(KIND_FAILED, self.compat, {"transfer": spec.transfer_id, "secret": spec.secret, "reason": reason})

    def _finish(self, spec: SendSpec, reason: str | None) -> None:
        tid = spec.transfer_id
        self._open.pop(spec.req_id, None)
        if reason and not spec.last_chunk:
            self._dead[tid] = None
            while len(self._dead) > DEAD_MEMORY:  # requests aborted mid-prompt never send a last chunk
                self._dead.popitem(last=False)
        record = self._records.pop(tid)
        record["outcome"] = "failed" if reason else "done"
        if reason:
            record["error"] = reason
        else:
            record["acked_at"] = time.time()
        self._finished_records[tid] = record
        self._frames.pop(tid, None)
        self._broken.pop(tid, None)

    def take_records(self) -> dict[str, dict[str, Any]]:
        records, self._finished_records = self._finished_records, {}
        return records

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.sender.close()
