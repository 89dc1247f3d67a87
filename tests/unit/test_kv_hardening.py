"""The KV side channel against a stranger who can reach its port (issue 31): connection slots,
the handshake deadline, acknowledged pushes, the early-frame table, what reaches the logs, and the
engine core's doorbell. Real loopback sockets throughout; no assertion on how long anything took.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from serve_app.kv.consumer import FRAME_OVERHEAD, ConsumerWorker
from serve_app.kv.metadata import LayerwiseMetadata, SendSpec, Settings
from serve_app.kv.producer import ProducerWorker
from serve_app.kv.wakeup import Doorbell, DoorbellRinger
from serve_app.kv.wire import KIND_LAYER, encode_frame, tensor_bytes
from tests.support.kv_helpers import (
    HOST,
    KV_SHAPE,
    LAYERS,
    WAIT_S,
    Peer,
    arm,
    compat,
    layer_data,
    patterned_caches,
    poll_until,
    port_of,
    settings,
    wait_for,
)

BLOCK_BYTES = KV_SHAPE[1] * KV_SHAPE[2] * KV_SHAPE[3] * 4


def make_consumer(**overrides) -> ConsumerWorker:
    worker = ConsumerWorker(settings(**overrides))
    worker.register_kv_caches(patterned_caches(seed=1))
    return worker


@pytest.fixture
def opened() -> Iterator[list]:
    """Everything a test opens (peers, workers), closed at its end whatever happened."""
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close()


def consumer_with(opened: list, **overrides) -> ConsumerWorker:
    worker = make_consumer(**overrides)
    opened.append(worker)
    return worker


def peer_of(opened: list, worker: ConsumerWorker) -> Peer:
    peer = Peer(port_of(worker))
    opened.append(peer)
    return peer


def producer_of(opened: list, **overrides) -> ProducerWorker:
    worker = ProducerWorker(settings(is_producer=True, **overrides))
    worker.register_kv_caches(patterned_caches(seed=2))
    opened.append(worker)
    return worker


def spec_for(port: int, tid: str, secret: str, remote: list[int], local: list[int] | None = None) -> SendSpec:
    return SendSpec(
        req_id=f"p-{tid}",
        transfer_id=tid,
        secret=secret,
        host=HOST,
        port=port,
        local_block_ids=local or remote,
        remote_block_ids=remote,
        num_tokens=4 * len(remote),
        last_chunk=True,
    )


def push(producer: ProducerWorker, *specs: SendSpec) -> dict[str, dict]:
    """One prefill step that pushes every layer of ``specs`` and ends them; their records."""
    meta = LayerwiseMetadata(send=list(specs))
    for name in LAYERS:
        producer.push_layer(meta, name, producer.kv.layers[name])
    producer.finish_step(meta)
    return producer.take_records()


def push_in_thread(producer: ProducerWorker, *specs: SendSpec) -> tuple[threading.Thread, dict]:
    records: dict = {}
    thread = threading.Thread(target=lambda: records.update(push(producer, *specs)), daemon=True)
    thread.start()
    return thread, records


# ---------------------------------------------------------------------------- connections
def test_an_idle_connection_is_closed_at_the_handshake_deadline(opened):
    worker = consumer_with(opened, handshake_timeout_s=0.3)
    idle = peer_of(opened, worker)
    assert idle.closed_by_peer()
    assert worker.server.handshake_timeouts == 1
    assert worker.counters()["handshake_timeouts"] == 1


def test_a_trickling_connection_is_closed_at_the_handshake_deadline(opened):
    """A byte at a time never makes a frame header: the deadline is on the whole header, not on
    each read."""
    worker = consumer_with(opened, handshake_timeout_s=0.5)
    slow = peer_of(opened, worker)
    stop = threading.Event()
    trickle = threading.Thread(target=send_slowly, args=([slow], stop, 0.1), daemon=True)
    trickle.start()
    try:
        assert slow.closed_by_peer()
    finally:
        stop.set()
        trickle.join(WAIT_S)
    assert worker.server.handshake_timeouts == 1


def test_the_pending_pool_evicts_its_oldest_and_a_producer_gets_in(opened):
    """Before the fix, 4 idle connections against 4 slots refused every push."""
    worker = consumer_with(opened, max_connections=4, max_pending_connections=4, handshake_timeout_s=30.0)
    idle = [peer_of(opened, worker) for _ in range(4)]
    wait_for(lambda: len(worker.server._pending) == 4)
    secret = arm(worker, "d-1", "t-1", [2, 3])
    records = push(producer_of(opened), spec_for(port_of(worker), "t-1", secret, [2, 3]))
    assert records["t-1"]["outcome"] == "done", records
    finished, failed = poll_until(worker, "d-1")
    assert finished == {"d-1"} and failed == set()
    assert idle[0].closed_by_peer()  # the oldest made way
    assert not idle[1].closed_by_peer(timeout_s=0.2)
    assert worker.server.refused_connections == 1


def test_pending_connections_are_bounded_per_peer_address(opened):
    worker = consumer_with(opened, max_pending_connections=10, max_pending_per_peer=2, handshake_timeout_s=30.0)
    first, second = peer_of(opened, worker), peer_of(opened, worker)
    wait_for(lambda: len(worker.server._pending) == 2)
    peer_of(opened, worker)
    assert first.closed_by_peer()
    assert not second.closed_by_peer(timeout_s=0.2)
    assert len(worker.server._pending) == 2


def test_authenticated_connections_are_bounded_per_peer_address(opened):
    worker = consumer_with(opened, max_connections=5, max_connections_per_peer=1)
    one = arm(worker, "d-1", "t-1", [1])
    two = arm(worker, "d-2", "t-2", [2])
    first = peer_of(opened, worker)
    first.layer("t-1", one, [1], layer_data(1, seed=1)["l0"])
    wait_for(lambda: len(worker.server._trusted) == 1)
    second = peer_of(opened, worker)
    second.layer("t-2", two, [2], layer_data(1, seed=2)["l0"])
    assert second.closed_by_peer()
    assert not first.closed_by_peer(timeout_s=0.2)
    assert worker.server.refused_connections == 1


def test_refused_connections_are_logged_once_per_interval_with_a_count(opened, caplog):
    worker = consumer_with(opened, max_connections=1, max_pending_connections=1, max_pending_per_peer=1, handshake_timeout_s=30.0)
    caplog.set_level(logging.WARNING, logger="pd_serve.kv")
    peers = [peer_of(opened, worker) for _ in range(20)]
    for peer in peers[:-1]:
        assert peer.closed_by_peer()
    # (Other tests' workers may still log their transfers' ends meanwhile: only the receiver's
    # lines about connections count here.)
    mine = f"kv receiver on port {worker.server.address[1]}:"
    # One record reaches caplog twice where an earlier test left a second capturing handler: count records, not deliveries.
    records = list({id(r): r for r in caplog.records}.values())
    lines = [m for m in (r.getMessage() for r in records) if m.startswith(mine) and "connection" in m]
    assert worker.server.refused_connections == 19
    assert len(lines) == 1, lines  # the first, with a count; the rest wait for the next interval
    assert "1 connection(s)" in lines[0]


def send_slowly(peers: list[Peer], stop: threading.Event, every_s: float) -> None:
    """A byte on each connection every ``every_s``, until stopped or every one is closed."""
    alive = list(peers)
    while alive and not stop.wait(every_s):
        for peer in list(alive):
            try:
                peer.sock.send(b"P")
            except OSError:
                alive.remove(peer)


@pytest.mark.parametrize(
    "pool",
    [
        {},  # the default pools: 64 strangers push each other out
        {"max_pending_connections": 80, "max_pending_per_peer": 80},  # room for all: the deadline closes them
    ],
    ids=["evicting", "deadline"],
)
def test_idle_and_slow_strangers_do_not_keep_transfers_out(opened, pool):
    """32 idle and 32 trickling connections against a decode engine's KV port (what the issue
    found refused every push): transfers still complete, acknowledged, and every stranger's
    connection is closed."""
    worker = consumer_with(opened, handshake_timeout_s=2.0, **pool)
    idle = [peer_of(opened, worker) for _ in range(32)]
    slow = [peer_of(opened, worker) for _ in range(32)]
    stop = threading.Event()
    trickle = threading.Thread(target=send_slowly, args=(slow, stop, 1.0), daemon=True)
    trickle.start()
    try:
        held = min(64, pool.get("max_pending_per_peer", worker.s.max_pending_per_peer))
        wait_for(lambda: len(worker.server._pending) == held)  # the strangers are in
        producer = producer_of(opened)
        port = port_of(worker)
        for round_ in range(3):
            specs = []
            for i, blocks in enumerate(([0, 1], [2, 3])):
                tid = f"t-{round_}-{i}"
                specs.append(spec_for(port, tid, arm(worker, f"d-{round_}-{i}", tid, blocks), blocks))
            records = push(producer, *specs)
            assert {tid: r["outcome"] for tid, r in records.items()} == {s.transfer_id: "done" for s in specs}, records
            finished, failed = poll_until(worker, f"d-{round_}-0")
            if f"d-{round_}-1" not in finished:
                finished, failed = poll_until(worker, f"d-{round_}-1")
            assert failed == set()
        for peer in idle + slow:
            assert peer.closed_by_peer()
    finally:
        stop.set()
        trickle.join(WAIT_S)
    assert worker.server.handshake_timeouts > 0
    (shared,) = worker.server._trusted  # the producer's one connection carried every transfer
    assert shared.bound == set() and worker._early == {} and worker._early_bytes == 0  # nothing left held


# ---------------------------------------------------------------------------- acknowledgements
class SilentReceiver:
    """A port that reads everything and never answers (a receiver that never got the bytes to
    its worker): before acks, a push into it counted as done."""

    def __init__(self, close_after_s: float | None = None) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.close_after_s = close_after_s
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        conn.settimeout(self.close_after_s)
        try:
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_push_nobody_acknowledges_is_a_failed_push(opened):
    receiver = SilentReceiver()
    opened.append(receiver)
    records = push(producer_of(opened, ack_timeout_s=0.3), spec_for(receiver.port, "t-1", "s", [1]))
    rec = records["t-1"]
    assert rec["outcome"] == "failed" and "acknowledge" in rec["error"]
    assert rec["layers_pushed"] == len(LAYERS)  # the frames went out; nobody said they arrived


def test_a_receiver_that_hangs_up_fails_the_push_without_waiting_for_the_deadline(opened):
    receiver = SilentReceiver(close_after_s=0.1)
    opened.append(receiver)
    records = push(producer_of(opened, ack_timeout_s=60.0), spec_for(receiver.port, "t-1", "s", [1]))
    assert records["t-1"]["outcome"] == "failed" and "no acknowledgement" in records["t-1"]["error"]


def test_a_transfer_decode_gave_up_on_gets_a_negative_ack(opened):
    worker = consumer_with(opened)
    secret = arm(worker, "d-1", "t-1", [1])
    worker.on_step(LayerwiseMetadata(finished=["d-1"]))  # aborted before prefill pushed
    records = push(producer_of(opened, ack_timeout_s=60.0), spec_for(port_of(worker), "t-1", secret, [1]))
    assert records["t-1"]["outcome"] == "failed" and "failed the transfer" in records["t-1"]["error"]


def test_a_done_frame_that_announces_missing_frames_is_refused_at_once(opened):
    """Before acks, decode waited out its deadline for frames that never came."""
    worker = consumer_with(opened)
    secret = arm(worker, "d-1", "t-1", [1])
    peer = peer_of(opened, worker)
    peer.layers("t-1", secret, [1], layer_data(1, seed=3))
    peer.done("t-1", secret, frames=5)
    finished, failed = poll_until(worker, "d-1")
    assert failed == {"d-1"}
    assert "2 of 5 frames" in worker.take_records()["t-1"]["error"]


def test_concurrent_transfers_on_one_connection_get_their_own_acks(opened):
    worker = consumer_with(opened)
    port = port_of(worker)
    good = arm(worker, "d-good", "t-good", [0, 1])
    gone = arm(worker, "d-gone", "t-gone", [4, 5])
    worker.on_step(LayerwiseMetadata(finished=["d-gone"]))
    assert worker.results() == ({"d-gone"}, set())
    producer = producer_of(opened, ack_timeout_s=60.0)
    records = push(producer, spec_for(port, "t-good", good, [0, 1]), spec_for(port, "t-gone", gone, [4, 5]))
    assert records["t-good"]["outcome"] == "done" and "error" not in records["t-good"]
    assert records["t-gone"]["outcome"] == "failed"
    assert len(producer.sender._links) == 1  # one shared connection carried both
    assert poll_until(worker, "d-good") == ({"d-good"}, set())


def test_an_early_push_is_acknowledged_once_it_is_armed(opened):
    """The producer's done frame beat decode's arming: the ack comes when the transfer is armed."""
    worker = consumer_with(opened)
    secret = "secret-of-t-1"
    thread, records = push_in_thread(producer_of(opened, ack_timeout_s=60.0), spec_for(port_of(worker), "t-1", secret, [2]))
    wait_for(lambda: len(worker._early.get("t-1", [])) == len(LAYERS) + 1)
    assert thread.is_alive()  # no ack before decode has the transfer
    arm(worker, "d-1", "t-1", [2], secret=secret)
    thread.join(WAIT_S)
    assert records["t-1"]["outcome"] == "done", records
    assert poll_until(worker, "d-1") == ({"d-1"}, set())


# ---------------------------------------------------------------------------- the early-frame table
def fill_with_strangers(worker: ConsumerWorker, opened: list, transfers: int) -> Peer:
    stranger = peer_of(opened, worker)
    for _ in range(transfers):
        stranger.done(f"rnd-{secrets.token_hex(6)}", "guess", frames=0)
    wait_for(lambda: len(worker._early) == transfers)
    return stranger


def test_a_real_early_frame_waits_out_strangers_that_filled_the_table(opened):
    """Before the fix, the real frame failed its transfer and closed the producer's connection."""
    worker = consumer_with(opened, max_early_transfers=8, early_wait_s=30.0)
    fill_with_strangers(worker, opened, 8)
    producer = peer_of(opened, worker)
    data = layer_data(1, seed=5)
    producer.layers("t-1", "secret-of-t-1", [3], data)
    producer.done("t-1", "secret-of-t-1", frames=len(LAYERS))
    wait_for(lambda: worker._waiting == {} and "t-1" not in worker._early)
    arm(worker, "d-1", "t-1", [3])
    finished, failed = poll_until(worker, "d-1")
    assert finished == {"d-1"} and failed == set()
    assert producer.stays_open(timeout_s=0.2)
    for name in LAYERS:
        assert worker.kv.layers[name][3].equal(data[name][0])


def test_early_bytes_are_reserved_before_the_payload_is_read_and_released_when_it_breaks(opened):
    one_frame = FRAME_OVERHEAD + 2 * BLOCK_BYTES
    worker = consumer_with(opened, max_early_bytes=one_frame)
    slow = peer_of(opened, worker)
    parts = encode_frame(
        KIND_LAYER,
        compat(),
        {"transfer": "t-slow", "secret": "s", "layer": "l0", "block_ids": [0, 1]},
        [tensor_bytes(layer_data(2, 6)["l0"])],
    )
    slow.send([parts[0], parts[1], bytes(parts[2])[:10]])  # header, then 10 bytes of its payload
    wait_for(lambda: worker._early_bytes == one_frame)  # reserved while its payload is still coming
    other = peer_of(opened, worker)
    other.layer("t-other", "s", [0, 1], layer_data(2, seed=7)["l0"])
    assert other.closed_by_peer()  # no room for it: it waited (early_wait_s) and gave up
    assert "t-other" not in worker._early and worker._early_bytes == one_frame
    slow.close()  # the payload never comes: its reservation goes back
    wait_for(lambda: worker._early_bytes == 0 and worker._early == {})


def test_one_connection_cannot_take_the_whole_table(opened):
    worker = consumer_with(opened, max_early_transfers=8, max_early_transfers_per_connection=2)
    greedy = peer_of(opened, worker)
    for i in range(3):
        greedy.done(f"g-{i}", "s", frames=0)
    assert greedy.closed_by_peer()
    assert set(worker._early) == {"g-0", "g-1"}
    other = peer_of(opened, worker)
    other.done("o-1", "s", frames=0)
    wait_for(lambda: "o-1" in worker._early)


def test_one_connection_cannot_take_the_whole_byte_budget(opened):
    one_frame = FRAME_OVERHEAD + BLOCK_BYTES
    worker = consumer_with(opened, max_early_bytes=8 * one_frame, max_early_bytes_per_connection=2 * one_frame)
    greedy = peer_of(opened, worker)
    for i in range(3):
        greedy.layer(f"g-{i}", "s", [0], layer_data(1, seed=i)["l0"])
    assert greedy.closed_by_peer()
    assert worker._early_bytes == 2 * one_frame


def test_strangers_frames_expire_and_their_connections_are_closed(opened):
    worker = consumer_with(opened, early_ttl_s=0.3, handshake_timeout_s=30.0)
    stranger = fill_with_strangers(worker, opened, 2)
    stranger.done("t-never", "secret-of-t-never", frames=0)  # its own secret: a late producer's
    assert stranger.closed_by_peer()
    wait_for(lambda: worker._early == {} and worker._early_bytes == 0)
    assert worker.counters()["expired_early_frames"] == 3
    arm(worker, "d-1", "t-never", [1])  # armed after all, too late: its frames are gone, it fails at once
    assert worker.results() == ({"d-1"}, {"d-1"})


def test_a_stranger_trickling_an_early_payload_is_cut_off_and_its_reservation_returned(opened):
    worker = consumer_with(opened, early_ttl_s=0.3, handshake_timeout_s=30.0)
    slow = peer_of(opened, worker)
    header = {"transfer": "t-slow", "secret": "s", "layer": "l0", "block_ids": [0]}
    parts = encode_frame(KIND_LAYER, compat(), header, [tensor_bytes(layer_data(1, 9)["l0"])])
    slow.send([parts[0], parts[1], bytes(parts[2])[:10]])
    wait_for(lambda: worker._early_bytes == FRAME_OVERHEAD + BLOCK_BYTES)
    assert slow.closed_by_peer()
    wait_for(lambda: worker._early_bytes == 0 and worker._early == {})


def test_a_trusted_connection_is_not_closed_when_a_transfer_it_sent_early_expires(opened):
    """A producer whose transfer decode never armed (the request was dropped before arming) keeps
    its connection for its other transfers."""
    worker = consumer_with(opened, early_ttl_s=0.3)
    secret = arm(worker, "d-1", "t-1", [1])
    producer = peer_of(opened, worker)
    producer.layer("t-1", secret, [1], layer_data(1, seed=8)["l0"])
    producer.done("t-unarmed", "s", frames=0)
    wait_for(lambda: worker.counters()["expired_early_frames"] == 1)
    assert not producer.closed_by_peer(timeout_s=0.2)


# ---------------------------------------------------------------------------- logs
def test_peer_supplied_text_never_reaches_a_log_line_raw(opened, caplog):
    caplog.set_level(logging.DEBUG, logger="pd_serve.kv")
    worker = consumer_with(opened)
    secret = arm(worker, "d-1", "t-1", [1])
    peer = peer_of(opened, worker)
    peer.failed("t-1", secret, "boom\nCRITICAL forged line")
    poll_until(worker, "d-1")
    forged = peer_of(opened, worker)
    forged.done("t-2\nCRITICAL forged line", "s", frames=0)
    assert forged.closed_by_peer()
    worker.server.refusals.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert any("forged" in m for m in messages), messages
    assert all("\n" not in m for m in messages), messages


# ---------------------------------------------------------------------------- the doorbell
def test_datagrams_without_the_doorbells_token_wake_nothing():
    bell = Doorbell()
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ringer = DoorbellRinger()
    try:
        for payload in (b"\x01", b"", bell.token.encode()[:-1], b"x" * 64):
            stranger.sendto(payload, ("127.0.0.1", bell.port))
        for _ in range(200):
            stranger.sendto(b"\x01", ("127.0.0.1", bell.port))
        assert bell.wait(0.2) is False  # a flood of strays: the wait lasts its interval
        assert bell.stray_datagrams >= 204
        ringer.aim(bell.port, "not-the-token")
        ringer.ring()
        assert bell.wait(0.05) is False
        ringer.aim(bell.port, bell.token)
        ringer.ring()
        assert bell.wait(WAIT_S) is True
    finally:
        stranger.close()
        ringer.close()
        bell.close()


def test_each_doorbell_has_its_own_token():
    first, second = Doorbell(), Doorbell()
    try:
        assert first.token != second.token and len(first.token) >= 32
    finally:
        first.close()
        second.close()


def test_settings_read_every_limit_from_the_connector_config():
    from types import SimpleNamespace

    from serve_app.wire.kv_limits import EXTRA_LIMITS

    # A value of its own for every limit the config may set, none of them a default.
    extra = {name: (100 + i if kind is int else 100.5 + i) for i, (name, kind) in enumerate(EXTRA_LIMITS.items())}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_port=1, engine_id="e", is_kv_producer=False),
        cache_config=SimpleNamespace(block_size=4),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(max_model_len=32),
    )
    s = Settings.from_config(config)
    assert {name: getattr(s, name) for name in EXTRA_LIMITS} == extra
    config.kv_transfer_config.kv_connector_extra_config = {"ack_timeout_s": 3}
    s = Settings.from_config(config)
    assert s.ack_timeout_s == 3.0 and s.max_connections == 32 and s.early_wait_s == 5.0  # defaults where nothing is said


def _layer_frame(transfer: str = "x") -> list:
    header = {"transfer": transfer, "secret": "s", "layer": "l0", "block_ids": [0]}
    return encode_frame(KIND_LAYER, compat(), header, [tensor_bytes(layer_data(1, 9)["l0"])])


def test_the_sender_closes_its_connection_to_a_decode_engine_that_went_away():
    """A decode engine stops (its successor listens on another port): the prefill side's
    connection to it is closed and forgotten at its next sends, not kept for the worker's life."""
    from serve_app.kv.producer import SWEEP_INTERVAL_S, FrameSender

    gone, staying = ConsumerWorker(settings()), ConsumerWorker(settings())
    for worker in (gone, staying):
        worker.register_kv_caches(patterned_caches(seed=1))
    sender = FrameSender(timeout_s=2.0)
    try:
        link = sender.send(HOST, port_of(gone), _layer_frame())
        gone.close()
        wait_for(lambda: link.dead is not None)
        time.sleep(SWEEP_INTERVAL_S)
        sender.send(HOST, port_of(staying), _layer_frame())  # any later send sweeps
        assert link.sock.fileno() == -1 and (HOST, port_of(gone)) not in sender._links
    finally:
        sender.close()
        staying.close()


def test_both_ends_of_the_side_channel_probe_a_silent_peer():
    """Keepalive on both ends: a connection to a host lost without a word ends within about a
    minute, freeing its transfers and its place among the peer's connections."""
    from serve_app.kv.producer import FrameSender

    worker = ConsumerWorker(settings())
    worker.register_kv_caches(patterned_caches(seed=1))
    sender = FrameSender(timeout_s=2.0)
    try:
        link = sender.send(HOST, port_of(worker), _layer_frame())
        server = worker.server
        wait_for(lambda: server._pending or server._trusted)
        with server._lock:
            accepted = [conn.sock for conn in [*server._pending, *server._trusted]]
        for sock in [link.sock, *accepted]:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
    finally:
        sender.close()
        worker.close()


def test_a_decode_host_that_stops_reading_costs_one_send_timeout_not_one_per_transfer(monkeypatch):
    """A decode host that accepts but never reads (wedged, or lost behind a firewall): the first
    transfer to it fails after the send timeouts; the others of the batch fail at once instead of
    stalling the prefill forward for as long again each; a while later it is tried again."""
    import serve_app.kv.producer as producer

    monkeypatch.setattr(producer, "FAILED_DESTINATION_S", 0.5)
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    sender = producer.FrameSender(timeout_s=0.3)
    big = [b"\0" * (64 << 20)]  # more than the socket buffers hold
    try:
        took = []
        for _ in range(3):  # three transfers of one step to the same host
            started = time.monotonic()
            with pytest.raises(OSError):
                sender.send(HOST, port, big)
            took.append(time.monotonic() - started)
        assert took[0] >= 0.5 and max(took[1:]) < 0.1, took
        time.sleep(0.6)
        started = time.monotonic()
        with pytest.raises(OSError):
            sender.send(HOST, port, big)
        assert time.monotonic() - started >= 0.5  # tried again, on a fresh connection
    finally:
        sender.close()
        listener.close()
        for conn in accepted:
            conn.close()


def test_the_receiver_goes_on_accepting_after_a_failed_accept(monkeypatch):
    """One accept() error (out of descriptors, a connection that failed in the queue) ended the
    accept thread for good: every later push waited out its acknowledgement and failed."""
    import errno

    real = socket.socket.accept
    calls = []

    def accept(sock):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(sock)

    monkeypatch.setattr(socket.socket, "accept", accept)
    consumer = ConsumerWorker(settings())
    consumer.register_kv_caches(patterned_caches(seed=1))
    try:
        peer = Peer(port_of(consumer))
        peer.send([b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64])  # not a frame: a served connection is closed at once
        assert peer.closed_by_peer(timeout_s=2.0)
        assert len(calls) >= 2
    finally:
        consumer.close()


def test_a_producer_that_stalls_halfway_through_a_frame_is_cut_off(monkeypatch):
    """Nothing bounded a frame once begun: a producer stalled halfway (a hung prefill process on a
    live host, which keepalive never ends) held its thread and connection for good, and its
    transfer waited out its deadline (the handshake deadline and the early frames' expiry leave
    an authenticated connection alone)."""
    from serve_app.kv import consumer as consumer_module

    monkeypatch.setattr(consumer_module, "FRAME_READ_S", 0.5)
    consumer = ConsumerWorker(settings())
    consumer.register_kv_caches(patterned_caches(seed=1))
    try:
        secret = arm(consumer, "d-1", "t-1", [0, 1])
        data = layer_data(2, seed=3)
        peer = Peer(port_of(consumer))
        peer.layer("t-1", secret, [0, 1], data[LAYERS[0]], layer=LAYERS[0])  # authenticated: a producer's
        header = {"transfer": "t-1", "secret": secret, "layer": LAYERS[1], "block_ids": [0, 1]}
        frame = b"".join(bytes(part) for part in encode_frame(KIND_LAYER, compat(), header, [tensor_bytes(data[LAYERS[1]])]))
        peer.send([frame[: len(frame) - BLOCK_BYTES]])  # the next frame but its last block, then nothing
        started = time.monotonic()
        assert peer.closed_by_peer(timeout_s=5.0)
        finished, failed = poll_until(consumer, "d-1")
        assert failed == {"d-1"} and time.monotonic() - started < 5.0  # not the 30 s receive deadline
    finally:
        consumer.close()


def test_an_unarmed_transfers_overflow_on_a_producers_connection_fails_that_transfer_only():
    """A producer sends every transfer to one decode engine over one connection: an unarmed
    transfer whose frames found no room in the early table closed it, and every armed transfer
    on it failed too."""
    consumer = ConsumerWorker(settings(early_wait_s=0.3, max_early_bytes_per_connection=2000))
    consumer.register_kv_caches(patterned_caches(seed=1))
    peer = Peer(port_of(consumer))
    try:
        s1 = arm(consumer, "d-1", "t-1", [0, 1])
        data = layer_data(2, seed=3)
        peer.layer("t-1", s1, [0, 1], data[LAYERS[0]], layer=LAYERS[0])  # t-1 armed: the connection is a producer's
        for _ in range(3):  # t-2 not armed yet: its frames overflow the connection's share
            peer.layer("t-2", "secret-of-t-2", [4, 5], data[LAYERS[0]], layer=LAYERS[0])
        peer.done("t-2", "secret-of-t-2", frames=3)
        ack = peer.ack(timeout_s=2.0)  # answered at once: its producer does not wait out the ack
        assert ack.transfer == "t-2" and not ack.ok and "dropped" in ack.reason
        peer.layer("t-1", s1, [0, 1], data[LAYERS[1]], layer=LAYERS[1])
        peer.done("t-1", s1, frames=2)
        finished, failed = poll_until(consumer, "d-1")
        assert finished == {"d-1"} and failed == set()
        ack = peer.ack()
        assert ack.transfer == "t-1" and ack.ok
        assert peer.stays_open(timeout_s=0.2)
        arm(consumer, "d-2", "t-2", [4, 5], secret="secret-of-t-2")
        finished, failed = poll_until(consumer, "d-2")
        assert failed == {"d-2"} and "for 0.3s" in consumer.take_records()["t-2"]["error"]
    finally:
        consumer.close()


def test_an_ack_to_a_producer_that_reads_none_cuts_it_off_without_blocking(opened):
    """Acks go out from the connection's reading thread and from the decode worker's step, so
    sending one must never wait for room: a producer that reads none of its acks is cut off.
    (A socket timeout on served connections once made every such send wait up to 30 s, the
    worker's step with it.)"""
    consumer = consumer_with(opened)
    secret = arm(consumer, "d-1", "t-1", [0, 1])
    data = layer_data(2, seed=3)
    peer = peer_of(opened, consumer)
    peer.layer("t-1", secret, [0, 1], data[LAYERS[0]], layer=LAYERS[0])  # authenticated: a producer's
    wait_for(lambda: len(consumer.server._trusted) == 1)
    (conn,) = consumer.server._trusted
    # The producer reads nothing: fill the way back (the consumer's send buffer and the
    # producer's receive buffer) through a second handle on the socket, one without a timeout.
    # Full once a send finds no room even after the acks in flight have freed what they could.
    with socket.socket(fileno=os.dup(conn.sock.fileno())) as back:
        wrote = True
        while wrote:
            wrote = False
            time.sleep(0.05)
            try:
                while True:
                    back.send(b"\0" * 65536, socket.MSG_DONTWAIT)
                    wrote = True
            except BlockingIOError:
                pass
    peer.layer("t-1", secret, [0, 1], data[LAYERS[1]], layer=LAYERS[1])
    peer.done("t-1", secret, frames=2)
    # The worker's step goes on meanwhile. The transfer settles done or, where the cut-off
    # connection's end comes first, failed, as the producer without its ack reports the push.
    finished, _ = poll_until(consumer, "d-1")
    assert finished == {"d-1"}
    wait_for(lambda: conn.closed)  # its ack found no room: cut off, not waited for
