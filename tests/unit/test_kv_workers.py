"""The connector's workers over real loopback TCP, with small CPU tensors as the KV caches:
the decode worker's receive path (what it writes, when, and what it refuses) and the prefill
worker's push.

Every refusal test checks three things: the bad frame fails only the transfer it authenticated
for (or none, when it could not authenticate), it does so at once (well before the deadline),
and every other transfer still lands bit for bit.
"""

from __future__ import annotations

import re
import socket
import time

import pytest
import torch

from serve_app.engines.records import push_timeline, receive_timeline
from serve_app.kv.consumer import ConsumerWorker
from serve_app.kv.metadata import LayerwiseMetadata, LayerwiseStats, RecvSpec, SendSpec
from serve_app.kv.producer import FrameSender, ProducerWorker
from serve_app.kv.wire import KIND_LAYER, MAGIC, PREAMBLE, WIRE_VERSION, encode_frame, tensor_bytes
from tests.support.kv_helpers import (
    HOST,
    KV_SHAPE,
    LAYERS,
    Peer,
    arm,
    assert_caches_equal,
    compat,
    expected_after,
    free_port,
    layer_data,
    patterned_caches,
    poll_until,
    port_of,
    settings,
    snapshot,
    wait_for,
)

FAST_S = 2.0  # "at once": far below the 30 s deadline every test arms with


@pytest.fixture
def consumer():
    worker = ConsumerWorker(settings())
    worker.register_kv_caches(patterned_caches(seed=1))
    yield worker
    worker.close()


@pytest.fixture
def peers(consumer):
    opened: list[Peer] = []

    def open_peer() -> Peer:
        peer = Peer(port_of(consumer))
        opened.append(peer)
        return peer

    yield open_peer
    for peer in opened:
        peer.close()


def deliver(peer: Peer, tid: str, secret: str, block_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    data = layer_data(len(block_ids), seed)
    peer.layers(tid, secret, block_ids, data)
    peer.done(tid, secret, frames=len(LAYERS))
    return data


def settle(consumer: ConsumerWorker, req_id: str) -> tuple[set[str], set[str], float]:
    started = time.monotonic()
    finished, failed = poll_until(consumer, req_id, timeout=FAST_S)
    return finished, failed, time.monotonic() - started


# ---------------------------------------------------------------------------- the good path
def test_consumer_writes_received_layers_into_named_blocks(consumer, peers):
    before = snapshot(consumer.kv.layers)
    secret = arm(consumer, "req-1", "t-1", [2, 5, 6], num_tokens=8)  # 6 is writable, not needed (a lookahead block)
    peer = peers()
    data = layer_data(2, seed=1)
    peer.layers("t-1", secret, [5, 2], data)  # any order within the request's blocks
    peer.done("t-1", secret, frames=2)
    finished, failed = poll_until(consumer, "req-1")
    assert finished == {"req-1"} and failed == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [5, 2], data))
    records = consumer.take_records()
    rec = records["t-1"]
    assert rec["outcome"] == "done" and rec["error"] is None
    assert (rec["tokens_received"], rec["frames_received"], rec["layers_received"]) == (8, 2, 2)
    assert rec["bytes_received"] == 2 * 2 * KV_SHAPE[1] * KV_SHAPE[2] * KV_SHAPE[3] * 4
    assert rec["armed_at"] <= rec["first_layer_at"] <= rec["last_layer_at"] <= rec["settled_at"]
    assert consumer.take_records() == {}
    assert consumer.results() == (set(), set())  # reported once


def test_frames_that_came_during_a_forward_are_written_and_reported_at_its_end(consumer, peers):
    """vLLM asks for finished receives after the step's forward: a transfer whose last frame came
    in meanwhile is reported then, not a step later (one more decode step of TTFT)."""
    before = snapshot(consumer.kv.layers)
    secret = arm(consumer, "req-1", "t-1", [3, 4])
    data = deliver(peers(), "t-1", secret, [3, 4], seed=9)
    wait_for(lambda: len(consumer._queue) == 3)  # both layers and the done frame, none written
    assert_caches_equal(consumer.kv.layers, before)
    assert consumer.results() == ({"req-1"}, set())  # no on_step in between
    assert_caches_equal(consumer.kv.layers, expected_after(before, [3, 4], data))


def test_consumer_frames_before_arming_are_applied_once_armed(consumer, peers):
    before = snapshot(consumer.kv.layers)
    peer = peers()
    data = deliver(peer, "t-1", "secret-of-t-1", [6, 7], seed=7)
    wait_for(lambda: len(consumer._early.get("t-1", [])) == 3)
    assert_caches_equal(consumer.kv.layers, before)  # nothing written before arming
    arm(consumer, "req-1", "t-1", [6, 7])
    assert consumer.results() == ({"req-1"}, set())
    assert_caches_equal(consumer.kv.layers, expected_after(before, [6, 7], data))
    assert "t-1" not in consumer._early and consumer._early_bytes == 0


def test_a_transfer_whose_early_frames_connection_ended_fails_when_armed(consumer, peers):
    """Its producer's connection sent some frames before arming and then ended: that end failed
    what was bound to the connection then, not this transfer, so arming fails it at once
    instead of leaving it to its deadline."""
    peer = peers()
    secret_a = arm(consumer, "req-a", "t-a", [1])
    peer.layer("t-a", secret_a, [1], layer_data(1, seed=3)["l0"])  # the connection is trusted now
    peer.layer("t-b", "secret-of-t-b", [4], layer_data(1, seed=4)["l0"])  # early: t-b is not armed
    wait_for(lambda: len(consumer._early.get("t-b", [])) == 1)
    peer.close()
    assert poll_until(consumer, "req-a") == ({"req-a"}, {"req-a"})
    arm(consumer, "req-b", "t-b", [4])
    finished, failed, took = settle(consumer, "req-b")
    assert failed == {"req-b"} and took < FAST_S
    assert "ended before the transfer did" in consumer.take_records()["t-b"]["error"]


def test_early_frames_complete_before_their_connection_ended_still_land(consumer, peers):
    """Every frame and the done frame came before arming, then the connection closed: nothing
    is missing, so the transfer lands."""
    before = snapshot(consumer.kv.layers)
    peer = peers()
    data = deliver(peer, "t-1", "secret-of-t-1", [6, 7], seed=8)
    wait_for(lambda: len(consumer._early.get("t-1", [])) == 3)
    peer.close()
    time.sleep(0.1)
    arm(consumer, "req-1", "t-1", [6, 7])
    assert consumer.results() == ({"req-1"}, set())
    assert_caches_equal(consumer.kv.layers, expected_after(before, [6, 7], data))


def test_consumer_failed_frame_fails_it(consumer, peers):
    secret = arm(consumer, "req-1", "t-1", [2, 5])
    peers().failed("t-1", secret, "prefill died")
    finished, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"} and finished == {"req-1"}
    assert consumer.take_records()["t-1"]["error"] == "prefill died"


def test_consumer_missing_layer_fails_it(consumer, peers):
    secret = arm(consumer, "req-1", "t-1", [2, 5])
    peer = peers()
    peer.layer("t-1", secret, [2, 5], layer_data(2, seed=3)["l0"])
    peer.done("t-1", secret, frames=1)
    _, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"}
    assert "1 of 2 layers" in consumer.take_records()["t-1"]["error"]


def test_consumer_deadline_fails_it(consumer):
    arm(consumer, "req-1", "t-1", [2, 5], timeout_s=0.01)
    finished, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"} and finished == {"req-1"}
    assert "no complete KV" in consumer.take_records()["t-1"]["error"]


def test_consumer_abort_while_waiting_reports_finished_and_drops_late_frames(consumer, peers):
    before = snapshot(consumer.kv.layers)
    secret = arm(consumer, "req-1", "t-1", [2, 5])
    consumer.on_step(LayerwiseMetadata(finished=["req-1"]))
    assert consumer.results() == ({"req-1"}, set())
    assert consumer.take_records()["t-1"]["outcome"] == "aborted"
    # Late frames for the aborted transfer, then a second transfer on the same connection.
    peer = peers()
    deliver(peer, "t-1", secret, [2, 5], seed=4)
    secret2 = arm(consumer, "req-2", "t-2", [0])
    data2 = deliver(peer, "t-2", secret2, [0], seed=5)
    finished, failed = poll_until(consumer, "req-2")
    assert finished == {"req-2"} and failed == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [0], data2))
    assert "t-1" not in consumer._early  # not kept for a later arming either
    assert set(consumer.take_records()) == {"t-2"}


def test_consumer_abort_drops_frames_already_queued(consumer, peers):
    """Frames that arrived, but were not written yet, when the abort reaches the worker."""
    before = snapshot(consumer.kv.layers)
    secret = arm(consumer, "req-1", "t-1", [2, 5])
    peers().layers("t-1", secret, [2, 5], layer_data(2, seed=6))
    wait_for(lambda: len(consumer._queue) == 2)
    consumer.on_step(LayerwiseMetadata(finished=["req-1"]))
    assert consumer.results() == ({"req-1"}, set())
    assert_caches_equal(consumer.kv.layers, before)


def test_consumer_finished_unknown_request_is_not_reported(consumer):
    consumer.on_step(LayerwiseMetadata(finished=["never-armed"]))
    assert consumer.results() == (set(), set())


# ---------------------------------------------------------------------------- refusals
def two_transfers(consumer):
    """t-good (on its own connection) and t-bad (whose producer misbehaves), both armed."""
    good = arm(consumer, "req-good", "t-good", [0, 1])
    bad = arm(consumer, "req-bad", "t-bad", [4, 5])
    return good, bad


def assert_good_lands(consumer, peers, secret, before) -> None:
    data = deliver(peers(), "t-good", secret, [0, 1], seed=40)
    finished, failed = poll_until(consumer, "req-good")
    assert "req-good" in finished and "req-good" not in failed
    assert_caches_equal({k: v[[0, 1]] for k, v in consumer.kv.layers.items()}, data)
    untouched = [b for b in range(KV_SHAPE[0]) if b not in (0, 1)]
    for name in LAYERS:
        assert torch.equal(consumer.kv.layers[name][untouched], before[name][untouched])


def assert_failed_at_once(consumer, req_id: str, match: str) -> None:
    finished, failed, took = settle(consumer, req_id)
    assert req_id in failed and took < FAST_S
    tid = "t-" + req_id.split("-", 1)[1]
    assert match in consumer.take_records()[tid]["error"]


def test_oversize_header_fails_only_its_own_transfer_at_once(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, bad = two_transfers(consumer)
    peer = peers()
    peer.layer("t-bad", bad, [4, 5], layer_data(2, seed=41)["l0"])  # authenticates t-bad here
    peer.send([PREAMBLE.pack(MAGIC, WIRE_VERSION, KIND_LAYER, 0, compat(), 1 << 30, 0)])
    assert peer.closed_by_peer()
    assert_failed_at_once(consumer, "req-bad", "header of")
    assert_good_lands(consumer, peers, good, before)


def test_wrong_dtype_is_refused_before_its_bytes_are_read(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, bad = two_transfers(consumer)
    peer = peers()
    peer.layer("t-bad", bad, [4, 5], layer_data(2, seed=42)["l0"])
    half = layer_data(2, seed=42)["l1"].to(torch.bfloat16)  # another dtype: another layout hash
    other = compat() ^ 1
    peer.layer("t-bad", bad, [4, 5], half, layer="l1", compat_hash=other)
    assert peer.closed_by_peer()
    assert_failed_at_once(consumer, "req-bad", "KV layout differs")
    assert_good_lands(consumer, peers, good, before)


def test_short_payload_fails_its_transfer_at_once(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, bad = two_transfers(consumer)
    peer = peers()
    one_block = layer_data(1, seed=43)["l0"]
    peer.layer("t-bad", bad, [4, 5], one_block)  # names two blocks, carries one
    assert peer.closed_by_peer()
    assert_failed_at_once(consumer, "req-bad", "does not hold 2 blocks")
    assert_good_lands(consumer, peers, good, before)


def test_payload_cut_off_mid_frame_fails_its_transfer_at_once(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, bad = two_transfers(consumer)
    peer = peers()
    parts = encode_frame(
        KIND_LAYER,
        compat(),
        {"transfer": "t-bad", "secret": bad, "layer": "l0", "block_ids": [4, 5]},
        [tensor_bytes(layer_data(2, seed=44)["l0"])],
    )
    peer.send(parts[:2] + [bytes(parts[2])[:100]])
    peer.close()
    assert_failed_at_once(consumer, "req-bad", "mid-frame")
    assert_good_lands(consumer, peers, good, before)


@pytest.mark.parametrize("secret", ["", "guess", None])
def test_a_frame_without_the_secret_is_dropped_and_fails_nothing(consumer, peers, secret):
    before = snapshot(consumer.kv.layers)
    good, _ = two_transfers(consumer)
    intruder = peers()
    header = {"transfer": "t-good", "layer": "l0", "block_ids": [0, 1]}
    if secret is not None:
        header["secret"] = secret
    intruder.send(encode_frame(KIND_LAYER, compat(), header, [tensor_bytes(torch.zeros((2, *KV_SHAPE[1:])))]))
    assert intruder.closed_by_peer()
    consumer.on_step(LayerwiseMetadata())
    assert consumer.results() == (set(), set())  # t-good is not failed by someone without its secret
    assert_caches_equal(consumer.kv.layers, before)
    if secret:  # a well-formed frame with a wrong secret is counted as rejected
        assert consumer.rejected_frames == 1
    assert_good_lands(consumer, peers, good, before)


def test_a_frame_for_another_transfer_fails_the_sender_not_the_victim(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, bad = two_transfers(consumer)
    peer = peers()
    peer.layer("t-bad", bad, [4, 5], layer_data(2, seed=45)["l0"])
    peer.layer("t-good", bad, [0, 1], layer_data(2, seed=45)["l1"])  # t-bad's secret, t-good's id
    assert peer.closed_by_peer()
    assert_failed_at_once(consumer, "req-bad", "wrong secret for transfer t-good")
    assert_good_lands(consumer, peers, good, before)


def test_a_frame_for_a_prefix_cached_block_fails_its_transfer(consumer, peers):
    """The scheduler side arms only the blocks after the prefix-cached ones; block 3 here is a
    cached block the request shares, block 4 its own."""
    before = snapshot(consumer.kv.layers)
    good = arm(consumer, "req-good", "t-good", [0, 1])
    bad = arm(consumer, "req-bad", "t-bad", [4])
    peer = peers()
    peer.layer("t-bad", bad, [3, 4], layer_data(2, seed=46)["l0"])
    assert peer.closed_by_peer()
    assert_failed_at_once(consumer, "req-bad", "may not write")
    assert torch.equal(consumer.kv.layers["l0"][3], before["l0"][3])
    assert_good_lands(consumer, peers, good, before)


def test_a_second_arm_of_the_same_id_fails_at_once_and_the_first_lands(consumer, peers):
    before = snapshot(consumer.kv.layers)
    first = arm(consumer, "req-1", "t-1", [0, 1])
    consumer.on_step(LayerwiseMetadata(recv=[RecvSpec("req-2", "t-1", "other", [4, 5], 8, 30.0)]))
    assert consumer.results() == ({"req-2"}, {"req-2"})
    data = deliver(peers(), "t-1", first, [0, 1], seed=47)
    finished, failed = poll_until(consumer, "req-1")
    assert finished == {"req-1"} and failed == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [0, 1], data))
    records = consumer.take_records()
    assert records["t-1"]["outcome"] == "done"
    assert any(key.startswith("t-1#rejected") and r["outcome"] == "failed" for key, r in records.items())


def test_an_id_rejected_by_the_scheduler_side_fails_at_once(consumer):
    spec = RecvSpec("req-1", "t-1", "s", [0], 4, 30.0, rejected="transfer id t-1 is already in use")
    consumer.on_step(LayerwiseMetadata(recv=[spec]))
    assert consumer.results() == ({"req-1"}, {"req-1"})


def test_unarmed_frames_are_bounded_in_transfers():
    worker = ConsumerWorker(settings(max_early_transfers=2))
    worker.register_kv_caches(patterned_caches(seed=1))
    try:
        peer = Peer(port_of(worker))
        for i in range(3):
            peer.done(f"t-{i}", f"secret-of-t-{i}", frames=0)
        assert peer.closed_by_peer()
        assert set(worker._early) == {"t-0", "t-1"}
        # The transfer whose frame was dropped fails at once when it is armed.
        arm(worker, "req-2", "t-2", [0])
        assert worker.results() == ({"req-2"}, {"req-2"})
        assert "early frames dropped" in worker.take_records()["t-2"]["error"]
        peer.close()
        # A stranger's frame dropped so (it names a transfer id, not its secret) fails nothing:
        # the transfer armed later under that id still lands.
        stranger = Peer(port_of(worker))
        stranger.done("t-3", "a guess", frames=0)
        assert stranger.closed_by_peer() and "t-3" in worker._overflowed
        secret = arm(worker, "req-3", "t-3", [1])
        assert worker.results() == (set(), set())
        producer = Peer(port_of(worker))
        data = layer_data(1, seed=5)
        producer.layers("t-3", secret, [1], data)
        producer.done("t-3", secret, frames=len(LAYERS))
        assert poll_until(worker, "req-3") == ({"req-3"}, set())
        stranger.close()
        producer.close()
    finally:
        worker.close()


def test_unarmed_frames_are_bounded_in_bytes():
    one_frame = 2 * KV_SHAPE[1] * KV_SHAPE[2] * KV_SHAPE[3] * 4 + 512
    worker = ConsumerWorker(settings(max_early_bytes=one_frame + 100))
    worker.register_kv_caches(patterned_caches(seed=1))
    try:
        peer = Peer(port_of(worker))
        data = layer_data(2, seed=48)
        peer.layer("t-1", "s", [0, 1], data["l0"])
        peer.layer("t-1", "s", [0, 1], data["l1"], layer="l1")
        assert peer.closed_by_peer()
        assert worker._early_bytes <= one_frame + 100
        peer.close()
    finally:
        worker.close()


def trusted_peer(worker: ConsumerWorker, n: int) -> Peer:
    """A connection that authenticated: it sent a frame with an armed transfer's secret."""
    secret = arm(worker, f"req-auth-{n}", f"t-auth-{n}", [n])
    peer = Peer(port_of(worker))
    peer.layer(f"t-auth-{n}", secret, [n], layer_data(1, seed=60 + n)["l0"])
    return peer


def test_connections_are_bounded():
    """Authenticated connections are bounded: a third producer is refused, and a freed slot is
    reused. (Connections that have not authenticated have a pool of their own, where the oldest
    makes way: tests/unit/test_kv_hardening.py.)"""
    worker = ConsumerWorker(settings(max_connections=2))
    worker.register_kv_caches(patterned_caches(seed=1))
    try:
        kept = [trusted_peer(worker, i) for i in range(2)]
        wait_for(lambda: len(worker.server._trusted) == 2)
        extra = trusted_peer(worker, 2)
        assert extra.closed_by_peer()
        assert worker.server.refused_connections == 1
        kept[0].close()
        wait_for(lambda: len(worker.server._trusted) == 1)
        again = trusted_peer(worker, 3)  # a freed slot is reused
        assert not again.closed_by_peer(timeout_s=0.3)
        assert len(worker.server._trusted) == 2
        for p in (*kept, extra, again):
            p.close()
    finally:
        worker.close()


def test_frames_before_the_caches_are_registered_are_refused():
    worker = ConsumerWorker(settings())
    try:
        peer = Peer(port_of(worker))
        peer.done("t-1", "s", frames=0)
        assert peer.closed_by_peer()
        peer.close()
    finally:
        worker.close()


def test_garbage_on_the_port_closes_only_that_connection(consumer, peers):
    before = snapshot(consumer.kv.layers)
    good, _ = two_transfers(consumer)
    intruder = peers()
    intruder.send([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64])
    assert intruder.closed_by_peer()
    assert_good_lands(consumer, peers, good, before)


def test_a_done_frame_whose_count_matches_does_not_settle_a_transfer_that_lacks_blocks(consumer, peers):
    """Frame counts and layers alone passed a push that lost a chunk and went on: its done frame
    counted only the frames after the loss, and the prompt's first blocks kept another request's
    KV. Every layer must write every block the prompt's tokens fill."""
    before = snapshot(consumer.kv.layers)
    secret = arm(consumer, "req-1", "t-1", [2, 5], num_tokens=8)
    peer = peers()
    peer.layers("t-1", secret, [5], layer_data(1, seed=3))  # block 2 never comes
    peer.done("t-1", secret, frames=2)
    ack = peer.ack()  # prefill is told, not acknowledged
    assert ack.transfer == "t-1" and not ack.ok and "lack some" in ack.reason
    finished, failed = poll_until(consumer, "req-1")
    assert finished == failed == {"req-1"}
    assert "lack some of the prompt's 2 blocks" in consumer.take_records()["t-1"]["error"]
    assert_caches_equal(consumer.kv.layers, before)  # failed before a step wrote its frames


# ---------------------------------------------------------------------------- producer worker
@pytest.fixture
def producer():
    worker = ProducerWorker(settings(is_producer=True))
    worker.register_kv_caches(patterned_caches(seed=2))
    yield worker
    worker.close()


def send_spec(
    port: int, local: list[int], remote: list[int], num_tokens: int, last_chunk: bool, secret: str = "secret-of-t-1", **kw
) -> SendSpec:
    return SendSpec(
        req_id="p-req",
        transfer_id="t-1",
        secret=secret,
        host=HOST,
        port=port,
        local_block_ids=local,
        remote_block_ids=remote,
        num_tokens=num_tokens,
        last_chunk=last_chunk,
        **kw,
    )


def run_step(producer: ProducerWorker, spec: SendSpec) -> None:
    meta = LayerwiseMetadata(send=[spec])
    for name in LAYERS:
        producer.push_layer(meta, name, producer.kv.layers[name])
    producer.finish_step(meta)


def test_producer_pushes_layers_the_consumer_writes(producer, consumer):
    before = snapshot(consumer.kv.layers)
    port = port_of(consumer)
    arm(consumer, "d-req", "t-1", [2, 5], num_tokens=8)
    # Two chunked steps: local block 1 -> remote 2, then local 3 -> remote 5.
    run_step(producer, send_spec(port, [1], [2], 4, last_chunk=False))
    consumer.on_step(LayerwiseMetadata())
    assert consumer.results() == (set(), set())
    run_step(producer, send_spec(port, [3], [5], 4, last_chunk=True))
    finished, failed = poll_until(consumer, "d-req")
    assert finished == {"d-req"} and failed == set()
    sent = {name: producer.kv.layers[name][[1, 3]] for name in LAYERS}
    assert_caches_equal(consumer.kv.layers, expected_after(before, [2, 5], sent))

    rec = producer.take_records()["t-1"]
    assert rec["role"] == "prefill" and rec["outcome"] == "done" and "error" not in rec
    assert rec["layers_pushed"] == 4 == len(rec["push_times"])
    assert rec["tokens_pushed"] == 8 and rec["steps"] == 2
    assert rec["bytes_pushed"] == 4 * KV_SHAPE[1] * KV_SHAPE[2] * KV_SHAPE[3] * 4
    assert rec["first_layer_sent_at"] <= rec["last_layer_sent_at"] <= rec["forward_done_at"] <= rec["acked_at"]
    # The per-layer timeline a prefill engine logs at DEBUG, from the same record.
    line = push_timeline("t-1", rec, since=rec["first_layer_sent_at"])
    sent_at = re.search(r"layers sent at \[(.*?)\] ms", line).group(1).split()
    assert len(sent_at) == 4 and sent_at[0] == "+0.0" and all(float(t) >= 0 for t in sent_at)
    assert "4 layers" in line and "done sent +" in line and "acknowledged +" in line
    assert f"(at {rec['first_layer_sent_at']:.4f}, wall clock)" in line
    assert producer.take_records() == {}
    got = consumer.take_records()["t-1"]
    assert got["frames_received"] == 4
    # The decode side's line, from the consumer's record, against the arming of the receive.
    line = receive_timeline("t-1", got, first_token_at=got["settled_at"] + 0.002)
    pattern = r"first layer in \+([\d.]+) ms, last layer in \+([\d.]+) ms, settled \+([\d.]+) ms, first token in the replica \+([\d.]+) ms"
    first_in, last_in, settled, token = (float(x) for x in re.search(pattern, line).groups())
    assert 0 <= first_in <= last_in <= settled < token and abs(token - settled - 2.0) < 0.11
    assert f"4 frames of {len(LAYERS)} layers" in line and " done;" in line and f"(at {got['armed_at']:.4f}, wall clock)" in line
    assert "never armed" in receive_timeline("t-2", {"outcome": "failed"}, first_token_at=0.0)


def test_the_done_frame_follows_the_last_layer_not_the_forward(producer, consumer):
    """The decode engine can settle the transfer (and compute its first token) while the prefill
    forward is still in its tail: no KV is written after the last attention layer."""
    port = port_of(consumer)
    arm(consumer, "d-req", "t-1", [2])
    meta = LayerwiseMetadata(send=[send_spec(port, [1], [2], 4, last_chunk=True)])
    for name in LAYERS:
        producer.push_layer(meta, name, producer.kv.layers[name])
    # finish_step (the end of the forward) has not run yet.
    finished, failed = poll_until(consumer, "d-req")
    assert finished == {"d-req"} and failed == set()
    producer.finish_step(meta)
    rec = producer.take_records()["t-1"]
    assert rec["outcome"] == "done" and rec["last_layer_sent_at"] <= rec["done_sent_at"] <= rec["forward_done_at"] <= rec["acked_at"]
    assert consumer.take_records()["t-1"]["frames_received"] == len(LAYERS)


def test_a_step_without_every_layer_sends_done_after_the_forward(producer, consumer):
    """No early done frame unless every layer went (decode then fails the missing layer)."""
    port = port_of(consumer)
    arm(consumer, "d-req", "t-1", [2])
    meta = LayerwiseMetadata(send=[send_spec(port, [1], [2], 4, last_chunk=True)])
    for name in LAYERS[:-1]:
        producer.push_layer(meta, name, producer.kv.layers[name])
    time.sleep(0.2)
    consumer.on_step(LayerwiseMetadata())
    assert consumer.results() == (set(), set())  # no done frame yet
    producer.finish_step(meta)
    rec = producer.take_records()["t-1"]
    assert "done_sent_at" not in rec and rec["outcome"] == "failed" and "1 of 2 layers arrived" in rec["error"]


def test_producer_unfinished_transfer_keeps_its_record(producer, consumer):
    arm(consumer, "d-req", "t-1", [2])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 4, last_chunk=False))
    assert producer.take_records() == {}  # only finished transfers are shipped


def test_producer_push_aborted_between_chunks_ends_on_both_sides(producer, consumer):
    """A request aborted after a chunk that was not its last: the prefill worker keeps nothing
    of its transfer, and decode fails it at once instead of at its deadline."""
    arm(consumer, "d-req", "t-1", [2, 5])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 4, last_chunk=False))
    producer.finish_step(LayerwiseMetadata(finished=["p-req"]))
    rec = producer.take_records()["t-1"]
    assert rec["outcome"] == "failed" and "aborted" in rec["error"] and rec["layers_pushed"] == len(LAYERS)
    assert (producer._records, producer._frames, producer._open) == ({}, {}, {})
    finished, failed = poll_until(consumer, "d-req")
    assert failed == {"d-req"} and "aborted" in consumer.take_records()["t-1"]["error"]
    producer.finish_step(LayerwiseMetadata(finished=["p-req"]))  # reported again: nothing left to end
    assert producer.take_records() == {}


def test_producer_error_spec_fails_the_consumer(producer, consumer):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "d-req", "t-1", [2, 5])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 8, last_chunk=False, error="block list too short"))
    finished, failed = poll_until(consumer, "d-req")
    assert failed == {"d-req"}
    assert consumer.take_records()["t-1"]["error"] == "block list too short"
    assert_caches_equal(consumer.kv.layers, before)
    rec = producer.take_records()["t-1"]
    assert (rec["outcome"], rec["error"], rec["layers_pushed"], rec["tokens_pushed"]) == ("failed", "block list too short", 0, 0)


def test_producer_unreachable_decode_fails_the_transfer(producer):
    run_step(producer, send_spec(free_port(), [1], [2], 4, last_chunk=False))
    rec = producer.take_records()["t-1"]
    assert rec["outcome"] == "failed" and "push to" in rec["error"]
    assert rec["layers_pushed"] == 0 and rec["tokens_pushed"] == 0


def test_producer_with_the_wrong_secret_is_not_applied(producer, consumer):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "d-req", "t-1", [2])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 4, last_chunk=True, secret="not-the-secret"))
    wait_for(lambda: consumer.rejected_frames >= 1)
    consumer.on_step(LayerwiseMetadata())
    assert_caches_equal(consumer.kv.layers, before)


def test_producer_pushes_bfloat16_kv():
    worker = ProducerWorker(settings(is_producer=True))
    receiver = ConsumerWorker(settings())
    try:
        caches = patterned_caches(seed=3, dtype=torch.bfloat16)
        worker.register_kv_caches(caches)
        receiver.register_kv_caches({k: torch.zeros(KV_SHAPE, dtype=torch.bfloat16) for k in LAYERS})
        arm(receiver, "d-req", "t-1", [2])
        run_step(worker, send_spec(port_of(receiver), [1], [2], 4, last_chunk=True))
        finished, failed = poll_until(receiver, "d-req")
        assert failed == set()
        for name in LAYERS:
            assert torch.equal(receiver.kv.layers[name][2], caches[name][1])
    finally:
        worker.close()
        receiver.close()


def test_frame_sender_reconnects_once_after_a_broken_connection(consumer):
    sender = FrameSender(timeout_s=2.0)
    try:
        port = port_of(consumer)
        sender.send(
            HOST,
            port,
            encode_frame(
                KIND_LAYER,
                compat(),
                {"transfer": "x", "secret": "s", "layer": "l0", "block_ids": [0]},
                [tensor_bytes(torch.zeros((1, *KV_SHAPE[1:])))],
            ),
        )
        conn = sender._conns[(HOST, port)]
        conn.shutdown(socket.SHUT_RDWR)
        secret = arm(consumer, "d-req", "t-2", [3])
        data = layer_data(1, seed=50)
        for name in LAYERS:
            sender.send(
                HOST,
                port,
                encode_frame(
                    KIND_LAYER, compat(), {"transfer": "t-2", "secret": secret, "layer": name, "block_ids": [3]}, [tensor_bytes(data[name])]
                ),
            )
        sender.send(HOST, port, encode_frame(2, compat(), {"transfer": "t-2", "secret": secret, "frames": 2}))
        finished, failed = poll_until(consumer, "d-req")
        assert finished == {"d-req"} and failed == set()
    finally:
        sender.close()


# ---------------------------------------------------------------------------- stats
def test_layerwise_stats_aggregate_merges_transfers():
    a = LayerwiseStats(data={"transfers": {"t-1": {"outcome": "done"}, "t-2": {"outcome": "failed"}}})
    b = LayerwiseStats(data={"transfers": {"t-2": {"outcome": "done"}, "t-3": {"outcome": "aborted"}}})
    assert a.aggregate(b) is a
    assert a.data == {"transfers": {"t-1": {"outcome": "done"}, "t-2": {"outcome": "done"}, "t-3": {"outcome": "aborted"}}}
    assert a.reduce() == {"transfers": 3}
    assert not a.is_empty()
    empty = LayerwiseStats()
    assert empty.is_empty() and empty.reduce() == {"transfers": 0}
    assert empty.aggregate(LayerwiseStats()).data == {"transfers": {}}
    a.reset()
    assert a.is_empty() and a.data == {}


def test_connector_build_kv_connector_stats():
    from serve_app.kv.layerwise_connector import LayerwisePushConnector

    stats = LayerwisePushConnector.build_kv_connector_stats({"transfers": {"t": {}}})
    assert isinstance(stats, LayerwiseStats) and stats.reduce() == {"transfers": 1}
    assert LayerwisePushConnector.build_kv_connector_stats(None).is_empty()


def test_a_push_that_failed_before_its_last_chunk_sends_nothing_more(producer, consumer):
    """A chunk whose sends failed (the destination in its fast-fail window: decode heard
    nothing) ended the transfer's state, and the next chunk pushed on as if it were new: its done
    frame counted only its own frames, decode settled the transfer with the first chunk's blocks
    never written, and prefill's second record said "done"."""

    class FailingFirst(FrameSender):
        failing = True

        def send(self, host, port, parts):
            if self.failing:
                raise ConnectionError("failed a send in the last 5 s")
            return super().send(host, port, parts)

    producer.sender = sender = FailingFirst()
    before = snapshot(consumer.kv.layers)
    port = port_of(consumer)
    arm(consumer, "d-req", "t-1", [2, 5], num_tokens=8)
    run_step(producer, send_spec(port, [1], [2], 4, last_chunk=False))
    assert producer.take_records()["t-1"]["outcome"] == "failed"
    sender.failing = False
    run_step(producer, send_spec(port, [3], [5], 4, last_chunk=True))
    assert producer.take_records() == {}  # no second record to say otherwise
    time.sleep(0.2)
    consumer.on_step(LayerwiseMetadata())
    assert consumer.results() == (set(), set())  # still waiting: its deadline (or the router) ends it
    assert_caches_equal(consumer.kv.layers, before)
    # The transfer's last chunk ended it here: an id the router never reuses is not kept.
    assert "t-1" not in producer._dead
