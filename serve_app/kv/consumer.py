"""The decode worker's half of the layerwise push (worker process): receive, check, write.

Receiving threads (one per connection) read frames and check each one before holding its bytes:
the wire rules (``wire.py``: version, layout hash, sizes from this engine's own geometry), then the
transfer's secret, then that its blocks are the transfer's own writable blocks. Checked frames are
queued; the worker writes them into the KV cache on its own thread between forwards (when vLLM
starts the step's KV loads, ``on_step``: on vLLM 0.32 after the forward, unless the step has
synchronous loads; and at the step's end, ``results``), and only while their request still waits, so a
late frame can never touch blocks the scheduler has handed to another request (vLLM keeps the
blocks of a request that waits for KV, aborted or not, until the connector reports its receive
over). A receiving thread that queues a frame (a layer, done or failed frame) or fails transfers
rings the engine core's doorbell (``wakeup.py``), so an idle decode engine runs the step that
writes the layer or settles the transfer at once: layers are written while prefill computes the
next ones, and the engine core does not poll its worker in between.

Trust: a frame is only ever applied to the transfer it authenticates for. A frame with a wrong
or missing secret is dropped and its connection closed without touching the transfer it names
(whoever sent it cannot know the secret, so it must not be able to fail that transfer either).
A frame that authenticated but breaks a rule (blocks outside the transfer's, wrong size) fails
its transfer at once. A connection that ends, cleanly or not, fails at once every transfer that
was still receiving over it: its producer is gone or out of step, so waiting would only end at
the deadline.

Acknowledgement: when a transfer's done frame has come and authenticated, and every frame it
announces is in, the receiving thread answers with an ``ack`` frame on the same connection; a
transfer this worker fails gets a negative ack on every connection it was bound to, and a done
frame for a transfer that is over here gets one too. Prefill reports a push delivered only on
that ack (``producer.py``), so a push into a receiver that never read it is a push failure the
router retries, not a done transfer that decode waits out its deadline for.

Connections: anyone who reaches the port can connect, and only a frame with a transfer's secret
tells a producer from a stranger. So connections live in two pools. A new connection is
*pending*: it must send a well-formed first frame header within ``handshake_timeout_s`` or it is
closed (idle and trickling connections alike), and the pending pool is bounded in all and per
peer address by evicting its oldest member (one that has not sent a frame header first) rather
than refusing the newcomer: strangers can only push each other out, and a producer, which sends
its first frame at once, is in the pool for a round trip before it authenticates. A connection
that sent a frame carrying an armed transfer's secret is *trusted* and leaves the pending pool;
trusted connections are bounded in all and per peer (``max_connections``,
``max_connections_per_peer``), refusals past those close the connection. Refused, evicted and
timed-out connections are logged once per interval with a count, never once each.

Early frames: frames of transfers not armed yet (the push beat this worker's step metadata) are
kept and checked against the secret once the transfer is armed. Nobody can authenticate them
before that, so the table is the one thing a stranger can fill. Its bounds are enforced on bytes
*reserved before the payload is read* (a frame's payload buffer is allocated only once its bytes
fit), released on every path (stored and later armed, expired, or the read failed), in all and
per connection, so one connection cannot take it all. When there is no room, the reading thread
does not fail the frame: it waits, up to ``early_wait_s``, for its transfer to be armed (then the
frame needs no room at all) or for room. A producer's transfer is armed within a step or so, so
its frames get through even while strangers hold the table; a stranger's ids are never armed, so
its frames expire after ``early_ttl_s``, and a connection that never authenticated is closed
when they do. Only a transfer still unarmed after the wait loses its frames (and the connection
that waited is closed, failing what it carried): it is then failed at once when armed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import select
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
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
    Preamble,
    WireError,
    check_sizes,
    discard,
    encode_ack,
    parse_header,
    printable,
    read_preamble,
    recv_exact,
    side_channel_socket,
)

logger = logging.getLogger("pd_serve.kv")

SETTLED_MEMORY = 4096  # transfer ids remembered after they ended: their late frames are dropped
OVERFLOW_MEMORY = 1024
OVERFLOW_SECRETS = 4  # secrets remembered per transfer whose early frames were dropped
FRAME_OVERHEAD = 512  # what a queued frame costs besides its payload
TICK_S = 0.1  # how often deadlines (handshakes, early frames) are checked
FRAME_READ_S = 30.0  # the longest a frame may take from its first byte to its last (not between frames)
ACCEPT_RETRY_S = 0.05  # after a failed accept (EMFILE, ENOBUFS): wait, then go on accepting
LOG_INTERVAL_S = 10.0  # at most one line per interval about refused or broken connections


class EveryInterval:
    """A warning about many similar events as one line per interval with their count: whoever can
    reach the port must not be able to flood the log by connecting in a loop."""

    def __init__(self, what: str, port: int, interval_s: float = LOG_INTERVAL_S) -> None:
        self.what = what
        self.port = port
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._count = 0
        self._latest = ""
        self._next_at = 0.0

    def note(self, reason: str) -> None:
        with self._lock:
            self._count += 1
            self._latest = printable(reason, 300)
        self.flush()

    def flush(self) -> None:
        """Log what was noted since the last line, if the interval is over."""
        now = time.monotonic()
        with self._lock:
            if not self._count or now < self._next_at:
                return
            count, latest = self._count, self._latest
            self._count, self._next_at = 0, now + self.interval_s
        logger.warning(
            "kv receiver on port %d: %s %d connection(s) (latest: %s); next report in %.0fs at most",
            self.port,
            self.what,
            count,
            latest,
            self.interval_s,
        )


@dataclass(eq=False)
class Conn:
    """One accepted connection. ``handshaken``/``trusted``/``closed`` are flags any thread may
    read; ``bound``, ``early_tids`` and ``early_bytes`` belong to the consumer's lock."""

    sock: socket.socket
    peer: str
    deadline: float  # monotonic: a frame header must be in by then, or trust earned
    handshaken: bool = False  # sent a well-formed frame header
    trusted: bool = False  # sent a frame with an armed transfer's secret
    closed: bool = False
    admitting: bool = False  # its reading thread waits for room or for an arming
    # monotonic: the frame being read (from its first byte) must be in by then; None between frames
    frame_deadline: float | None = None
    bound: set[str] = field(default_factory=set)  # transfers that authenticated on it
    early_tids: set[str] = field(default_factory=set)  # unarmed transfers it holds frames (or a reservation) of
    early_bytes: int = 0
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def shut(self) -> None:
        """Close it from any thread: its reading thread's next read ends."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_now(self, data: bytes) -> bool:
        """Send a small frame without blocking; a peer that does not read its acks (its buffer
        is full) is cut off rather than allowed to stall the thread that answers it."""
        with self.send_lock:
            if self.closed:
                return False
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except OSError:
                sent = -1
        if sent == len(data):
            return True
        self.shut()
        return False


class FrameServer:
    """Accepts connections on ``host:port`` and serves each on its own thread with
    ``serve(conn)``, keeping the pending and trusted pools described in the module docstring.
    ``tick`` is called every ``TICK_S`` from the server's own thread."""

    def __init__(self, settings: Settings, serve: Callable[[Conn], None], tick: Callable[[], None] | None = None) -> None:
        self.s = settings
        self._serve = serve
        self._tick = tick
        self._lock = threading.Lock()
        self._pending: dict[Conn, None] = {}  # insertion order: oldest first
        self._trusted: set[Conn] = set()
        self._stop = threading.Event()
        self.refused_connections = 0  # over a trusted limit, or evicted from the pending pool
        self.handshake_timeouts = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((settings.host, settings.port))
        self._sock.listen(64)
        self.address = self._sock.getsockname()
        self.refusals = EveryInterval("refused or timed out", self.address[1])
        threading.Thread(target=self._accept, name="kv-recv-accept", daemon=True).start()
        threading.Thread(target=self._watch, name="kv-recv-deadlines", daemon=True).start()

    # ---------------------------------------------------------------- pools
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return  # closed by close()
                # Out of descriptors or buffers, or a connection that failed while queued: the
                # next one may do; this thread is the only way in.
                self.refusals.note(f"accept failed: {exc!r}")
                self._stop.wait(ACCEPT_RETRY_S)
                continue
            conn = Conn(sock=sock, peer=str(addr[0]), deadline=time.monotonic() + self.s.handshake_timeout_s)
            with self._lock:
                victim = self._room_for(conn.peer)
                self._pending[conn] = None
            if victim is not None:
                victim.shut()
                self.refusals.note(f"evicted a pending connection from {victim.peer} for a newer one")
            try:
                side_channel_socket(sock)
                threading.Thread(target=self._run, args=(conn,), name="kv-recv", daemon=True).start()
            except (OSError, RuntimeError):
                self._forget(conn)
                sock.close()

    def _room_for(self, peer: str) -> Conn | None:
        """The pending connection that makes way for a new one from ``peer``, if the pool is full."""
        same = [c for c in self._pending if c.peer == peer]
        if len(same) >= self.s.max_pending_per_peer:
            victim = self._oldest(same)
        elif len(self._pending) >= self.s.max_pending_connections:
            victim = self._oldest(list(self._pending))
        else:
            return None
        del self._pending[victim]
        self.refused_connections += 1
        return victim

    @staticmethod
    def _oldest(conns: list[Conn]) -> Conn:
        """The oldest of those that have not even sent a frame header, else the oldest."""
        return next((c for c in conns if not c.handshaken), conns[0])

    def promote(self, conn: Conn) -> bool:
        """Move ``conn`` into the trusted pool; False (and the connection closed) past its limits."""
        with self._lock:
            if conn.trusted:
                return True
            if conn.closed:
                return False
            peers = sum(1 for c in self._trusted if c.peer == conn.peer)
            self._pending.pop(conn, None)
            if len(self._trusted) < self.s.max_connections and peers < self.s.max_connections_per_peer:
                self._trusted.add(conn)
                conn.trusted = True
                return True
            self.refused_connections += 1
        conn.shut()
        limits = f"{self.s.max_connections} in all, {self.s.max_connections_per_peer} per address"
        self.refusals.note(f"refused an authenticated connection from {conn.peer}: at its limit ({limits})")
        return False

    def _forget(self, conn: Conn) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._trusted.discard(conn)

    def _run(self, conn: Conn) -> None:
        try:
            with conn.sock:
                self._serve(conn)
        finally:
            conn.closed = True
            self._forget(conn)

    # ---------------------------------------------------------------- deadlines
    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            self._close_late(time.monotonic())
            self.refusals.flush()
            if self._tick is not None:
                try:
                    self._tick()
                except Exception:  # a bug of ours must not stop the deadlines
                    logger.exception("kv receiver: deadline check failed")

    def _close_late(self, now: float) -> None:
        """Close pending connections past their deadline: no frame header yet, or one that
        holds nothing that waits for an arming either (its frames were dropped or expired); and
        any connection whose frame begun has not come in whole within ``FRAME_READ_S``."""
        with self._lock:
            late = [c for c in self._pending if now > c.deadline and not (c.handshaken and (c.early_tids or c.admitting))]
            for conn in late:
                del self._pending[conn]
            self.handshake_timeouts += len(late)
            stalled = [c for c in (*self._pending, *self._trusted) if c.frame_deadline is not None and now > c.frame_deadline]
        for conn in late:
            conn.shut()
            self.refusals.note(f"closed a connection from {conn.peer} that did not authenticate within {self.s.handshake_timeout_s:g}s")
        for conn in stalled:
            conn.shut()
            self.refusals.note(f"closed a connection from {conn.peer} whose frame did not come in whole within {FRAME_READ_S:g}s")

    def close(self) -> None:
        self._stop.set()
        for how in (lambda: self._sock.shutdown(socket.SHUT_RDWR), self._sock.close):
            try:
                how()
            except OSError:
                pass
        with self._lock:
            conns = [*self._pending, *self._trusted]
            self._pending.clear()
            self._trusted.clear()
        for conn in conns:
            conn.shut()


@dataclass
class ReceivedFrame:
    header: Header
    payload: bytearray | None
    received_at: float
    conn: Conn | None = None  # where it came from: where its ack goes

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
    # The blocks the prompt's pushed tokens fill, each of which every layer's frames must name
    # before the done frame is answered (frame counts alone pass a push that lost a chunk and
    # went on): checked where it is answered (``_missing``), so every queued frame is then one of
    # a whole push.
    needed: frozenset[int] = frozenset()
    frames: int = 0
    layers: set[str] = field(default_factory=set)
    bytes: int = 0
    expected_frames: int | None = None
    failed: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    received: int = 0  # layer frames admitted (queued), written or not
    received_layers: set[str] = field(default_factory=set)
    received_blocks: dict[str, set[int]] = field(default_factory=dict)  # layer -> blocks admitted
    conns: list[Conn] = field(default_factory=list)  # where it authenticated: where its acks go
    acked: bool = False


class ConsumerWorker:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.kv = KVCaches()
        self.limits: FrameLimits | None = None
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # early-table room freed, or a transfer armed
        self._closing = False
        self._waiting: dict[str, Incoming] = {}  # transfer -> state
        self._by_req: dict[str, str] = {}  # engine request id -> transfer
        self._queue: deque[tuple[Incoming, ReceivedFrame]] = deque()  # checked, not written yet
        self._early: dict[str, list[ReceivedFrame]] = {}  # frames of transfers not armed yet
        self._early_since: dict[str, float] = {}  # transfer -> when its first early bytes were reserved (monotonic)
        self._early_reading: dict[str, list[Conn]] = {}  # transfer -> connections reading an early payload of it
        self._early_bytes = 0  # stored and reserved
        # transfer -> (why its early frames were dropped, digests of the secrets they carried)
        self._overflowed: OrderedDict[str, tuple[str, set[bytes]]] = OrderedDict()
        self._settled: OrderedDict[str, None] = OrderedDict()  # recent transfers over: late frames dropped
        self._done: set[str] = set()  # engine request ids: all frames in
        self._failed: set[str] = set()  # engine request ids: transfer failed
        self._records: dict[str, dict[str, Any]] = {}
        self._outbox: list[tuple[Conn, bytes]] = []  # acks to send once the lock is released
        self.doorbell = DoorbellRinger()  # the engine core's, once a step's metadata named it
        self.rejected_frames = 0  # frames refused: wrong secret, rules broken, over the early bounds
        self.broken_connections = 0  # connections closed because a frame broke the protocol
        self.expired_early_frames = 0  # frames of transfers never armed in time
        self._broken_log = EveryInterval("closed after a bad frame", settings.port)
        self.server = FrameServer(settings, self._serve, tick=self._tick)
        self._broken_log.port = self.server.address[1]
        logger.info("kv receiver listening on %s:%d", *self.server.address[:2])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv.register(kv_caches, self.s.block_size)
        assert self.kv.geometry is not None
        self.limits = FrameLimits(max_blocks=self.s.max_blocks, block_bytes=self.kv.geometry.block_bytes)

    # ------------------------------------------------------------------ receiving threads
    def _serve(self, conn: Conn) -> None:
        """Read frames from one connection until it ends or breaks a rule. Between frames it may
        idle as long as it likes (keepalive ends a lost host's); a frame begun must be in within
        ``FRAME_READ_S`` (the wait for early-table room included): a sender that stalls halfway
        (a hung prefill process on a live host) would otherwise hold this thread, its slot and
        any early reservation for good."""
        reason = "the sender closed the connection"
        try:
            poller = select.poll()  # not select(): a worker's descriptors can pass FD_SETSIZE
            poller.register(conn.sock, select.POLLIN)
            while True:
                conn.frame_deadline = None
                poller.poll()
                # From its first byte, a frame must be in within FRAME_READ_S (the deadlines'
                # thread closes the connection past it): no socket timeout, which would make
                # send_now wait for room to write.
                conn.frame_deadline = time.monotonic() + FRAME_READ_S
                pre = read_preamble(conn.sock)
                if pre is None:
                    return
                header = self._read_header(conn, pre)
                action = self._admit(conn, header, pre.payload_len)
                if action == "drop":
                    discard(conn.sock, pre.payload_len)
                elif action == "early":
                    self._receive_early(conn, header, pre.payload_len)
                else:
                    payload = recv_exact(conn.sock, pre.payload_len) if pre.payload_len else None
                    self._deliver(conn, ReceivedFrame(header, payload, time.time(), conn))
                self._send_acks()
        except WireError as exc:
            reason = f"bad frame: {exc}"
            if not conn.closed:
                self.broken_connections += 1
                self._broken_log.note(f"{conn.peer}: {exc}")
        except OSError as exc:
            reason = f"connection failed: {exc!r}"
        except Exception as exc:  # a bug of ours: still close cleanly and fail what depended on it
            reason = f"receiver error: {exc!r}"
            logger.exception("kv receiver: unexpected error")
        finally:
            conn.closed = True
            self._fail_bound(conn, reason)
            self._send_acks()

    def _read_header(self, conn: Conn, pre: Preamble) -> Header:
        geometry, limits = self.kv.geometry, self.limits
        if geometry is None or limits is None:
            raise WireError("KV caches are not registered yet")
        if pre.compat != geometry.compat:
            raise WireError("the sender's KV layout differs from this engine's (dtype, block size or shape)")
        check_sizes(pre, limits)
        header = parse_header(pre.kind, recv_exact(conn.sock, pre.header_len))
        conn.handshaken = True
        return header

    def _admit(self, conn: Conn, header: Header, payload_len: int) -> str:
        """'queue' (an armed transfer's frame, authenticated and checked), 'early' (its transfer
        is not armed yet; its bytes are reserved in the early table) or 'drop' (its transfer is
        over); raises WireError to close the connection, after failing the transfer when the
        frame authenticated for it. Without room for an early frame, waits for its arming or for
        room (module docstring)."""
        tid, size = header.transfer, FRAME_OVERHEAD + payload_len
        deadline: float | None = None
        with self._lock:
            conn.admitting = True
            try:
                while True:
                    state = self._waiting.get(tid)
                    if state is not None:
                        self._accept_from(conn, state, header, payload_len)
                        return "queue"
                    if tid in self._settled:
                        self._answer_late(conn, header)
                        return "drop"
                    problem = self._frame_problem(header, payload_len, None)
                    if problem is not None:
                        raise WireError(problem)
                    if conn.trusted and self._overflowed_with(tid, header.secret):
                        return self._drop_overflowed(conn, header)  # it fails when armed; the connection's others go on
                    now = time.monotonic()
                    self._expire_early(now)
                    why = self._no_room(conn, tid, size)
                    if why is None:
                        self._reserve(conn, tid, size)
                        return "early"
                    deadline = deadline if deadline is not None else now + self.s.early_wait_s
                    if conn.closed or self._closing:
                        raise WireError("the receiver closed the connection")
                    if now >= deadline:
                        why = f"{why} for {self.s.early_wait_s:g}s"
                        if conn.trusted:
                            # A producer's connection carries its other transfers to this engine
                            # too: only this frame's transfer fails (when it is armed).
                            self._remember_overflow(tid, why, [header.secret])
                            self.rejected_frames += 1
                            return self._drop_overflowed(conn, header)
                        self._overflow(tid, why, header.secret)
                    self._room.wait(min(TICK_S, deadline - now))
            finally:
                conn.admitting = False

    def _accept_from(self, conn: Conn, state: Incoming, header: Header, payload_len: int) -> None:
        """An armed transfer's frame from ``conn``: authenticated (which makes the connection a
        trusted one), bound to it, and checked; raises WireError otherwise."""
        self._authenticate(state, header)
        if not self.server.promote(conn):
            raise WireError("the receiver has no connection slot for this producer")
        self._bind(conn, state)
        self._check(state, header, payload_len)

    def _bind(self, conn: Conn, state: Incoming) -> None:
        conn.bound.add(state.spec.transfer_id)
        if conn not in state.conns:
            state.conns.append(conn)

    def _answer_late(self, conn: Conn, header: Header) -> None:
        """A done frame for a transfer that is over here still gets its answer, so its producer
        does not wait out the ack deadline."""
        if isinstance(header, DoneHeader):
            self._outbox.append((conn, self._ack(header.transfer, False, "the transfer is over on the decode engine")))

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

    def _overflow(self, tid: str, why: str, secret: str) -> None:
        self._remember_overflow(tid, why, [secret])
        self.rejected_frames += 1
        raise WireError(why)

    def _deliver(self, conn: Conn, frame: ReceivedFrame) -> None:
        """A frame read in full: queued for its armed transfer, or dropped if it is over."""
        with self._lock:
            tid = frame.header.transfer
            state = self._waiting.get(tid)
            if state is not None:
                # Armed while its payload was being read: check it as an armed frame now.
                self._accept_from(conn, state, frame.header, frame.payload_len)
                self._take(state, frame)
                # A step has work now: a layer to write while prefill computes the next one, or a
                # transfer to settle. The engine core need not wait for its poll.
                self.doorbell.ring()
            elif tid in self._settled:
                self._answer_late(conn, frame.header)

    def _take(self, state: Incoming, frame: ReceivedFrame) -> None:
        """Queue an authenticated, checked frame; a done frame is answered here, where it is
        known whether every frame it announces came."""
        self._queue.append((state, frame))
        header = frame.header
        if isinstance(header, LayerHeader):
            state.received += 1
            state.received_layers.add(header.layer)
            state.received_blocks.setdefault(header.layer, set()).update(header.block_ids)
        elif isinstance(header, DoneHeader):
            missing = self._missing(state, header.frames)
            if missing is not None:
                self._fail(state, missing)
            elif not state.acked and frame.conn is not None:
                state.acked = True
                self._outbox.append((frame.conn, self._ack(state.spec.transfer_id, True)))

    def _missing(self, state: Incoming, frames: int) -> str | None:
        if state.received < frames:
            return f"{state.received} of {frames} frames arrived before the done frame"
        if len(state.received_layers) < len(self.kv.layers):
            return f"{len(state.received_layers)} of {len(self.kv.layers)} layers arrived"
        short = sum(1 for layer in self.kv.layers if not state.needed <= state.received_blocks.get(layer, set()))
        return f"{short} of {len(self.kv.layers)} layers lack some of the prompt's {len(state.needed)} blocks" if short else None

    def _ack(self, tid: str, ok: bool, reason: str = "") -> bytes:
        geometry = self.kv.geometry
        assert geometry is not None
        return encode_ack(geometry.compat, tid, ok, reason)

    def _send_acks(self) -> None:
        """Send the acks queued under the lock; never while holding it."""
        if not self._outbox:  # read without the lock: one queued meanwhile goes with the next tick
            return
        with self._lock:
            out, self._outbox = self._outbox, []
        for conn, data in out:
            conn.send_now(data)

    def _fail_bound(self, conn: Conn, reason: str) -> None:
        failed = False
        with self._lock:
            for tid in list(conn.bound):
                state = self._waiting.get(tid)
                if state is not None and state.failed is None:
                    self._fail(state, reason)
                    failed = True
            conn.bound.clear()
            self._room.notify_all()
        if failed:
            self.doorbell.ring()

    # ------------------------------------------------------------------ the early table
    def _no_room(self, conn: Conn, tid: str, size: int) -> str | None:
        """Why an early frame of ``size`` bytes for ``tid`` from ``conn`` does not fit, or None."""
        s = self.s
        if tid not in self._early and len(self._early) >= s.max_early_transfers:
            return f"more than {s.max_early_transfers} transfers arrived before being armed"
        if tid not in conn.early_tids and len(conn.early_tids) >= s.max_early_transfers_per_connection:
            return f"more than {s.max_early_transfers_per_connection} unarmed transfers from one connection"
        if self._early_bytes + size > s.max_early_bytes:
            return f"frames of unarmed transfers exceed {s.max_early_bytes} bytes"
        if conn.early_bytes + size > s.max_early_bytes_per_connection:
            return f"frames of unarmed transfers from one connection exceed {s.max_early_bytes_per_connection} bytes"
        return None

    def _reserve(self, conn: Conn, tid: str, size: int) -> None:
        self._early.setdefault(tid, [])
        self._early_since.setdefault(tid, time.monotonic())
        self._early_reading.setdefault(tid, []).append(conn)
        self._early_bytes += size
        conn.early_bytes += size
        conn.early_tids.add(tid)

    def _receive_early(self, conn: Conn, header: Header, payload_len: int) -> None:
        """Read the payload whose bytes ``_admit`` reserved, then keep the frame (or, if its
        transfer was armed meanwhile, deliver it); the reservation is released on every path."""
        size = FRAME_OVERHEAD + payload_len
        try:
            payload = recv_exact(conn.sock, payload_len) if payload_len else None
        except BaseException:
            with self._lock:
                self._read_done(header.transfer, conn)
                self._release(conn, header.transfer, size)
            raise
        frame = ReceivedFrame(header, payload, time.time(), conn)
        with self._lock:
            tid = header.transfer
            self._read_done(tid, conn)
            if tid in self._early and tid not in self._waiting and tid not in self._settled:
                self._early[tid].append(frame)  # its reservation becomes its share of the table
                return
            self._release(conn, tid, size)
        self._deliver(conn, frame)

    def _read_done(self, tid: str, conn: Conn) -> None:
        readers = self._early_reading.get(tid, [])
        if conn in readers:
            readers.remove(conn)
        if not readers:
            self._early_reading.pop(tid, None)

    def _release(self, conn: Conn, tid: str, size: int) -> None:
        """Give back a reservation that did not become a kept frame."""
        self._early_bytes -= size
        conn.early_bytes -= size
        frames = self._early.get(tid)
        if frames is not None and not frames and tid not in self._early_reading:
            del self._early[tid]
            frames = None
        if frames is None and tid not in self._early_reading:
            self._early_since.pop(tid, None)
        if not any(f.conn is conn for f in frames or ()):
            conn.early_tids.discard(tid)
        self._room.notify_all()

    def _pop_early(self, tid: str) -> list[ReceivedFrame]:
        """Take a transfer's kept frames out of the table (reservations still being read stay
        counted until their read ends)."""
        frames = self._early.pop(tid, [])
        if tid not in self._early_reading:
            self._early_since.pop(tid, None)
        for frame in frames:
            self._early_bytes -= frame.size
            if frame.conn is not None:
                frame.conn.early_bytes -= frame.size
                frame.conn.early_tids.discard(tid)
        self._room.notify_all()
        return frames

    def _expire_early(self, now: float) -> None:
        """Drop the frames of transfers not armed within ``early_ttl_s`` and close the
        connections that sent them without ever authenticating: only strangers send frames for
        ids that are never armed."""
        expired = [t for t, since in self._early_since.items() if now - since > self.s.early_ttl_s]
        for tid in expired:
            if tid in self._early_reading:
                # A payload still coming after all that time: a trickle. A stranger's is cut off
                # (its read fails and gives its reservation back); expiry waits for the rest.
                for conn in self._early_reading[tid]:
                    self._shut_stranger(conn)
                continue
            self._early_since.pop(tid, None)
            frames = self._pop_early(tid)
            self.expired_early_frames += len(frames)
            self._remember_overflow(tid, f"not armed within {self.s.early_ttl_s:g}s of its first frame", [f.header.secret for f in frames])
            for conn in {id(f.conn): f.conn for f in frames if f.conn is not None}.values():
                self._shut_stranger(conn)

    def _shut_stranger(self, conn: Conn) -> None:
        """Close a connection that never authenticated and sent frames for a transfer never armed."""
        if not conn.trusted and not conn.closed:
            conn.shut()
            self.server.refusals.note(f"closed a connection from {conn.peer} whose frames named transfers never armed")

    def _drop_overflowed(self, conn: Conn, header: Header) -> str:
        """Drop a frame of a transfer whose early frames were dropped; its done frame is answered
        now, so that its producer does not wait out its acknowledgement."""
        if isinstance(header, DoneHeader):
            why = self._overflowed[header.transfer][0]
            self._outbox.append((conn, self._ack(header.transfer, False, f"its frames were dropped: {why}")))
        return "drop"

    def _overflowed_with(self, tid: str, secret: str) -> bool:
        """Whether frames of ``tid`` carrying ``secret`` were dropped unarmed already."""
        record = self._overflowed.get(tid)
        return record is not None and _digest(secret) in record[1]

    def _remember_overflow(self, tid: str, why: str, secrets: Iterable[str]) -> None:
        """Remember that frames naming ``tid`` were dropped unarmed, and the secrets they carried:
        only frames with the transfer's own secret fail it when it is armed (a stranger who knows
        or guesses a transfer id must not be able to fail it in advance)."""
        why, digests = self._overflowed.pop(tid, (why, set()))
        for secret in secrets:
            if len(digests) < OVERFLOW_SECRETS:
                digests.add(_digest(secret))
        self._overflowed[tid] = (why, digests)
        while len(self._overflowed) > OVERFLOW_MEMORY:
            self._overflowed.popitem(last=False)

    def _tick(self) -> None:
        """From the server's deadline thread: expire early frames and wake waiting readers, so
        neither depends on this engine running steps."""
        with self._lock:
            self._expire_early(time.monotonic())
            self._room.notify_all()
        self._send_acks()
        self._broken_log.flush()

    # ------------------------------------------------------------------ worker thread
    def on_step(self, meta: LayerwiseMetadata) -> None:
        """Where vLLM starts the step's KV loads (on 0.32 after the forward, which a waiting
        request's blocks do not take part in): forget finished requests, arm new receives,
        write what came."""
        self.doorbell.aim(meta.wake_port, meta.wake_token)
        with self._lock:
            # Drop requests finished (aborted) while waiting before writing anything. vLLM holds
            # the blocks of an aborted request that waits for KV until the connector reports its
            # receive over: report it, now that no frame can land in those blocks any more.
            for req_id in meta.finished:
                tid = self._by_req.pop(req_id, None)
                if tid is not None and tid in self._waiting:
                    state = self._waiting.pop(tid)
                    self._nack(state, "aborted by the decode engine")
                    self._settle_as(state, "aborted")
                    self._done.add(req_id)
            for spec in meta.recv:
                self._arm(spec)
            self._write_queued()
        self._send_acks()

    def _write_queued(self) -> None:
        while self._queue:
            state, frame = self._queue.popleft()
            self._apply(state, frame)

    def _arm(self, spec: RecvSpec) -> None:
        tid = spec.transfer_id
        now = time.time()
        needed = frozenset(spec.block_ids[: -(-spec.num_tokens // self.s.block_size)])
        state = Incoming(spec=spec, deadline=now + spec.timeout_s, armed_at=now, writable=frozenset(spec.block_ids), needed=needed)
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
        self._room.notify_all()  # a reading thread may wait for this very arming
        frames = self._pop_early(tid)
        overflowed = self._overflowed.pop(tid, None)
        if overflowed is not None and _digest(spec.secret) in overflowed[1]:
            self._fail(state, f"early frames dropped: {overflowed[0]}")
            return
        ended = done = False
        for frame in frames:
            if self._waiting.get(tid) is not state:
                break  # failed by an earlier frame of the same batch
            if self._take_early(state, frame):
                ended |= frame.conn is not None and frame.conn.closed
                done |= isinstance(frame.header, DoneHeader)
        if ended and not done and self._waiting.get(tid) is state:
            # Its producer's connection ended before arming: nothing more comes over it, and
            # that connection's own end found no transfer bound to it to fail.
            self._fail(state, "the connection its first frames came over ended before the transfer did")

    def _take_early(self, state: Incoming, frame: ReceivedFrame) -> bool:
        """A kept frame of a transfer just armed: checked as if it came now; one that does not
        authenticate is dropped (and its connection, a stranger's, closed). Whether it was taken."""
        conn = frame.conn
        try:
            self._authenticate(state, frame.header)
            if conn is not None and not conn.closed and self.server.promote(conn):
                self._bind(conn, state)
            self._check(state, frame.header, frame.payload_len)
        except WireError:
            if conn is not None and not conn.trusted:
                conn.shut()
            return False  # dropped (and, for bad blocks, the transfer failed)
        self._take(state, frame)
        return True

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

    def _nack(self, state: Incoming, reason: str) -> None:
        """Tell the producer, on every connection the transfer authenticated on, that it failed
        here (once per transfer, and never after it was acknowledged)."""
        if state.acked:
            return
        state.acked = True
        if self.kv.geometry is None:
            return
        data = self._ack(state.spec.transfer_id, False, reason)
        self._outbox.extend((conn, data) for conn in state.conns if not conn.closed)

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
            logger.warning("transfer %s failed: %s", tid, printable(state.failed))
            del self._waiting[tid]
            self._by_req.pop(req_id, None)
            self._failed.add(req_id)
            self._nack(state, state.failed)
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
            self._expire_early(time.monotonic())
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        self._send_acks()
        return done | failed, failed

    # ------------------------------------------------------------------ records
    def _settle_as(self, state: Incoming, outcome: str) -> None:
        for conn in state.conns:  # a producer's connection outlives many transfers
            conn.bound.discard(state.spec.transfer_id)
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
            "handshake_timeouts": self.server.handshake_timeouts,
            "expired_early_frames": self.expired_early_frames,
        }

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._room.notify_all()
        self.server.close()
        self.doorbell.close()


def _digest(secret: str) -> bytes:
    """What is kept of a secret a dropped frame carried: enough to recognise it, not to use it."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
