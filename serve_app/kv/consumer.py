"""The decode worker's half of the layerwise push (worker process): receive, check, write.

Receiving threads (one per connection, at most ``max_connections``) read frames and check each
one before holding its bytes: the wire rules (``wire.py``: version, layout hash, sizes from this
engine's own geometry), then the transfer's secret, then that its blocks are the transfer's own
writable blocks. Checked frames are queued; the worker writes them into the KV cache on its own
thread between forwards (at a step's start, ``on_step``, and at its end, ``results``), and only
while their request still waits, so a late frame can never touch blocks the scheduler has handed
to another request (vLLM keeps the blocks of a request that waits for KV, aborted or not, until
the connector reports its receive over). A receiving thread that queues a transfer's done or failed
frame, or fails transfers, rings the engine core's doorbell (``wakeup.py``), so an idle decode
engine runs the step that settles the transfer at once instead of at its next poll.

Trust: a frame is only ever applied to the transfer it authenticates for. A frame with a wrong
or missing secret is dropped and its connection closed without touching the transfer it names
(whoever sent it cannot know the secret, so it must not be able to fail that transfer either).
A frame that authenticated but breaks a rule (blocks outside the transfer's, wrong size) fails
its transfer at once. A connection that ends, cleanly or not, fails at once every transfer that
was still receiving over it: its producer is gone or out of step, so waiting would only end at
the deadline. Frames for transfers not armed yet (the push beat this worker's step metadata) are
kept, bounded in count and bytes, and checked against the secret once the transfer is armed.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from serve_app.kv.caches import KVCaches
from serve_app.kv.metadata import LayerwiseMetadata, RecvSpec, Settings
from serve_app.kv.wakeup import DoorbellRinger
from serve_app.kv.wire import (
    DoneHeader,
    FailedHeader,
    FrameLimits,
    Header,
    LayerHeader,
    WireError,
    check_sizes,
    discard,
    parse_header,
    read_preamble,
    recv_exact,
)

logger = logging.getLogger("pd_serve.kv")

SETTLED_MEMORY = 4096  # transfer ids remembered after they ended: their late frames are dropped
OVERFLOW_MEMORY = 1024
FRAME_OVERHEAD = 512  # what a queued frame costs besides its payload


class FrameServer:
    """Accepts connections on ``host:port`` and serves each on its own thread with
    ``serve(conn)``; at most ``max_connections`` at once, any more are closed at once."""

    def __init__(self, host: str, port: int, serve: Callable[[socket.socket], None], max_connections: int) -> None:
        self._serve = serve
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.address = self._sock.getsockname()
        self._closed = False
        self.refused_connections = 0
        threading.Thread(target=self._accept, name="kv-recv-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self.refused_connections += 1
                logger.warning("kv receiver: refused a connection from %s: all connection slots are busy", peer)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._run, args=(conn,), name="kv-recv", daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._serve(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


@dataclass
class ReceivedFrame:
    header: Header
    payload: bytearray | None
    received_at: float

    @property
    def payload_len(self) -> int:
        return len(self.payload) if self.payload is not None else 0

    @property
    def size(self) -> int:
        """Bytes it holds, counting a header's share too, so frames without payload count."""
        return FRAME_OVERHEAD + self.payload_len


@dataclass
class Incoming:
    """A transfer this worker is receiving."""

    spec: RecvSpec
    deadline: float
    armed_at: float
    writable: frozenset[int] = frozenset()
    frames: int = 0
    layers: set[str] = field(default_factory=set)
    bytes: int = 0
    expected_frames: int | None = None
    failed: str | None = None
    first_at: float | None = None
    last_at: float | None = None


class ConsumerWorker:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.kv = KVCaches()
        self.limits: FrameLimits | None = None
        self._lock = threading.Lock()
        self._waiting: dict[str, Incoming] = {}  # transfer -> state
        self._by_req: dict[str, str] = {}  # engine request id -> transfer
        self._queue: deque[tuple[Incoming, ReceivedFrame]] = deque()  # checked, not written yet
        self._early: dict[str, list[ReceivedFrame]] = {}  # frames of transfers not armed yet
        self._early_bytes = 0
        self._overflowed: OrderedDict[str, str] = OrderedDict()  # transfer -> why its early frames were dropped
        self._settled: OrderedDict[str, None] = OrderedDict()  # recent transfers over: late frames dropped
        self._done: set[str] = set()  # engine request ids: all frames in
        self._failed: set[str] = set()  # engine request ids: transfer failed
        self._records: dict[str, dict[str, Any]] = {}
        self.doorbell = DoorbellRinger()  # the engine core's, once a step's metadata named it
        self.rejected_frames = 0  # frames refused: wrong secret, rules broken, over the early bounds
        self.broken_connections = 0  # connections closed because a frame broke the protocol
        self.server = FrameServer(settings.host, settings.port, self._serve, settings.max_connections)
        logger.info("kv receiver listening on %s:%d", *self.server.address[:2])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches, self.s.block_size)
        assert self.kv.geometry is not None
        self.limits = FrameLimits(max_blocks=self.s.max_blocks, block_bytes=self.kv.geometry.block_bytes)

    # ------------------------------------------------------------------ receiving threads
    def _serve(self, conn: socket.socket) -> None:
        """Read frames from one connection until it ends or breaks a rule."""
        bound: set[str] = set()  # transfers that authenticated on this connection
        reason = "the sender closed the connection"
        try:
            while True:
                pre = read_preamble(conn)
                if pre is None:
                    return
                geometry, limits = self.kv.geometry, self.limits
                if geometry is None or limits is None:
                    raise WireError("KV caches are not registered yet")
                if pre.compat != geometry.compat:
                    raise WireError("the sender's KV layout differs from this engine's (dtype, block size or shape)")
                check_sizes(pre, limits)
                header = parse_header(pre.kind, recv_exact(conn, pre.header_len))
                action = self._admit(header, pre.payload_len, bound)
                if action == "drop":
                    discard(conn, pre.payload_len)
                    continue
                payload = recv_exact(conn, pre.payload_len) if pre.payload_len else None
                self._deliver(ReceivedFrame(header, payload, time.time()), bound)
        except WireError as exc:
            reason = f"bad frame: {exc}"
            self.broken_connections += 1
            logger.warning("kv receiver: closing a connection: %s", exc)
        except OSError as exc:
            reason = f"connection failed: {exc!r}"
        except Exception as exc:  # a bug of ours: still close cleanly and fail what depended on it
            reason = f"receiver error: {exc!r}"
            logger.exception("kv receiver: unexpected error")
        finally:
            self._fail_bound(bound, reason)

    def _admit(self, header: Header, payload_len: int, bound: set[str]) -> str:
        """'queue' (an armed transfer's frame, authenticated and checked), 'early' (its transfer
        is not armed yet) or 'drop' (its transfer is over); raises WireError to close the
        connection, after failing the transfer when the frame authenticated for it."""
        with self._lock:
            tid = header.transfer
            state = self._waiting.get(tid)
            if state is not None:
                self._authenticate(state, header)
                bound.add(tid)
                self._check(state, header, payload_len)
                return "queue"
            if tid in self._settled:
                return "drop"
            problem = self._frame_problem(header, payload_len, None)
            if problem is not None:
                raise WireError(problem)
            if tid not in self._early and len(self._early) >= self.s.max_early_transfers:
                self._overflow(tid, f"more than {self.s.max_early_transfers} transfers arrived before being armed")
            if self._early_bytes + FRAME_OVERHEAD + payload_len > self.s.max_early_bytes:
                self._overflow(tid, f"frames of unarmed transfers exceed {self.s.max_early_bytes} bytes")
            return "early"

    def _frame_problem(self, header: Header, payload_len: int, writable: frozenset[int] | None) -> str | None:
        """What is wrong with a frame for this engine (and for a transfer that may write only
        ``writable``), or None."""
        if not isinstance(header, LayerHeader):
            return None
        geometry, limits = self.kv.geometry, self.limits
        assert geometry is not None and limits is not None
        if header.layer not in self.kv.layers:
            return f"unknown layer {header.layer!r}"
        if len(header.block_ids) > limits.max_blocks:
            return f"{len(header.block_ids)} blocks is more than a request can have ({limits.max_blocks})"
        if payload_len != len(header.block_ids) * geometry.block_bytes:
            return f"payload of {payload_len} bytes does not hold {len(header.block_ids)} blocks of {geometry.block_bytes} bytes"
        if writable is not None and not set(header.block_ids) <= writable:
            return f"frame names blocks {sorted(set(header.block_ids) - writable)} this transfer may not write"
        return None

    def _authenticate(self, state: Incoming, header: Header) -> None:
        if not hmac.compare_digest(header.secret.encode(), state.spec.secret.encode()):
            self.rejected_frames += 1
            raise WireError(f"wrong secret for transfer {header.transfer}")

    def _check(self, state: Incoming, header: Header, payload_len: int) -> None:
        """An authenticated frame that breaks a rule fails its own transfer at once."""
        problem = self._frame_problem(header, payload_len, state.writable)
        if problem is not None:
            self.rejected_frames += 1
            self._fail(state, f"bad frame: {problem}")
            self.doorbell.ring()
            raise WireError(f"transfer {header.transfer}: {problem}")

    def _overflow(self, tid: str, why: str) -> None:
        self._overflowed[tid] = why
        while len(self._overflowed) > OVERFLOW_MEMORY:
            self._overflowed.popitem(last=False)
        self.rejected_frames += 1
        raise WireError(why)

    def _deliver(self, frame: ReceivedFrame, bound: set[str]) -> None:
        with self._lock:
            tid = frame.header.transfer
            state = self._waiting.get(tid)
            if state is not None:
                # Armed while its payload was being read: check it as an armed frame now.
                self._authenticate(state, frame.header)
                bound.add(tid)
                self._check(state, frame.header, frame.payload_len)
                self._queue.append((state, frame))
                if not isinstance(frame.header, LayerHeader):
                    # Its transfer can be settled now: the engine core need not wait for its poll.
                    self.doorbell.ring()
            elif tid not in self._settled:
                self._early.setdefault(tid, []).append(frame)
                self._early_bytes += frame.size

    def _fail_bound(self, bound: set[str], reason: str) -> None:
        failed = False
        with self._lock:
            for tid in bound:
                state = self._waiting.get(tid)
                if state is not None and state.failed is None:
                    self._fail(state, reason)
                    failed = True
        if failed:
            self.doorbell.ring()

    # ------------------------------------------------------------------ worker thread
    def on_step(self, meta: LayerwiseMetadata) -> None:
        """At the step boundary: forget finished requests, arm new receives, write what came."""
        self.doorbell.port = meta.wake_port
        with self._lock:
            # Drop requests finished (aborted) while waiting before writing anything. vLLM holds
            # the blocks of an aborted request that waits for KV until the connector reports its
            # receive over: report it, now that no frame can land in those blocks any more.
            for req_id in meta.finished:
                tid = self._by_req.pop(req_id, None)
                if tid is not None and tid in self._waiting:
                    self._settle_as(self._waiting.pop(tid), "aborted")
                    self._done.add(req_id)
            for spec in meta.recv:
                self._arm(spec)
            self._write_queued()

    def _write_queued(self) -> None:
        while self._queue:
            state, frame = self._queue.popleft()
            self._apply(state, frame)

    def _arm(self, spec: RecvSpec) -> None:
        tid = spec.transfer_id
        now = time.time()
        state = Incoming(spec=spec, deadline=now + spec.timeout_s, armed_at=now, writable=frozenset(spec.block_ids))
        if spec.rejected is None and (tid in self._waiting or tid in self._settled):
            spec.rejected = f"transfer id {tid} was armed before on this engine"
        if spec.rejected is not None:
            # The transfer already armed under this id keeps its state and its record.
            state.failed = spec.rejected
            self._failed.add(spec.req_id)
            logger.warning("request %s: %s", spec.req_id, spec.rejected)
            self._records[f"{tid}#rejected:{spec.req_id}"] = self._record_of(state, "failed")
            return
        self._waiting[tid] = state
        self._by_req[spec.req_id] = tid
        if tid in self._overflowed:
            self._fail(state, f"early frames dropped: {self._overflowed.pop(tid)}")
            return
        for frame in self._early.pop(tid, []):
            self._early_bytes -= frame.size
            if self._waiting.get(tid) is not state:
                continue  # failed by an earlier frame of the same batch
            try:
                self._authenticate(state, frame.header)
                self._check(state, frame.header, frame.payload_len)
            except WireError:
                continue  # dropped (and, for bad blocks, the transfer failed)
            self._queue.append((state, frame))

    def _apply(self, state: Incoming, frame: ReceivedFrame) -> None:
        if self._waiting.get(state.spec.transfer_id) is not state:
            return  # settled (aborted, failed) since it was queued
        header = frame.header
        try:
            if isinstance(header, LayerHeader):
                geometry = self.kv.geometry
                assert geometry is not None and frame.payload is not None
                data = torch.frombuffer(frame.payload, dtype=torch.uint8).view(geometry.dtype)
                self.kv.write(header.layer, list(header.block_ids), data.reshape((len(header.block_ids), *geometry.block_shape)))
                state.frames += 1
                state.bytes += frame.payload_len
                state.layers.add(header.layer)
                state.first_at = state.first_at or frame.received_at
                state.last_at = frame.received_at
            elif isinstance(header, DoneHeader):
                state.expected_frames = header.frames
            elif isinstance(header, FailedHeader):
                state.failed = header.reason
        except Exception as exc:  # a bad frame fails its request, never the engine
            state.failed = f"bad frame: {exc!r}"
        self._settle(state)

    def _fail(self, state: Incoming, reason: str) -> None:
        state.failed = state.failed or reason
        self._settle(state)

    def _settle(self, state: Incoming) -> None:
        tid, req_id = state.spec.transfer_id, state.spec.req_id
        if self._waiting.get(tid) is not state:
            return
        if state.failed is None and state.expected_frames is not None and state.frames >= state.expected_frames:
            if len(state.layers) < len(self.kv.layers):
                state.failed = f"{len(state.layers)} of {len(self.kv.layers)} layers arrived"
            else:
                del self._waiting[tid]
                self._by_req.pop(req_id, None)
                self._done.add(req_id)
                self._settle_as(state, "done")
                return
        if state.failed is not None:
            logger.warning("transfer %s failed: %s", tid, state.failed)
            del self._waiting[tid]
            self._by_req.pop(req_id, None)
            self._failed.add(req_id)
            self._settle_as(state, "failed")

    def results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) engine request ids since the last call; failed ones are in both,
        so vLLM leaves its waiting state for them.

        Called at the end of every step: frames that arrived during its forward are written
        now, so a transfer whose last frame came in is reported with this step's output and its
        request decodes in the next step, not one step later."""
        now = time.time()
        with self._lock:
            self._write_queued()
            for state in list(self._waiting.values()):
                if now > state.deadline:
                    self._fail(state, f"no complete KV within {state.spec.timeout_s:.0f}s")
            for tid in [t for t, frames in self._early.items() if now - frames[0].received_at > self.s.recv_timeout_s]:
                self._early_bytes -= sum(f.size for f in self._early.pop(tid))
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done | failed, failed

    # ------------------------------------------------------------------ records
    def _settle_as(self, state: Incoming, outcome: str) -> None:
        self._settled[state.spec.transfer_id] = None
        while len(self._settled) > SETTLED_MEMORY:
            self._settled.popitem(last=False)
        self._record(state, outcome)

    def _record(self, state: Incoming, outcome: str) -> None:
        self._records[state.spec.transfer_id] = self._record_of(state, outcome)

    def _record_of(self, state: Incoming, outcome: str) -> dict[str, Any]:
        return {
            "role": "decode",
            "outcome": outcome,
            "error": state.failed,
            "tokens_received": state.spec.num_tokens if outcome == "done" else 0,
            "frames_received": state.frames,
            "layers_received": len(state.layers),
            "bytes_received": state.bytes,
            "armed_at": state.armed_at,
            "first_layer_at": state.first_at,
            "last_layer_at": state.last_at,
            "settled_at": time.time(),
        }

    def take_records(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            records, self._records = self._records, {}
        return records

    def counters(self) -> dict[str, int]:
        """Cumulative counts of what the side channel refused, for operators."""
        return {
            "rejected_frames": self.rejected_frames,
            "broken_connections": self.broken_connections,
            "refused_connections": self.server.refused_connections,
        }

    def close(self) -> None:
        self.server.close()
        self.doorbell.close()
