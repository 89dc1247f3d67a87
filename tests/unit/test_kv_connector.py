"""The layer-wise KV push connector, driven by hand: no vLLM engine, no Ray.

The scheduler side gets small stand-ins for vLLM's Request, KVCacheBlocks, kv_cache_manager and
SchedulerOutput; the worker sides run over real loopback TCP (FrameServer / FrameSender) with
small CPU tensors as the per-layer KV caches.
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import serve_app.kv.layerwise_connector as lc
from serve_app.kv.layerwise_connector import (
    LayerwiseMetadata,
    LayerwiseStats,
    RecvSpec,
    SendSpec,
    _ConsumerWorker,
    _ProducerWorker,
    _SchedulerSide,
    _Settings,
)
from serve_app.kv.transport import FrameSender, FrameServer, encode, read_frame

HOST = "127.0.0.1"
BS = 4  # block size: easy arithmetic
KV_SHAPE = (8, 2, BS, 6)  # per layer: 8 blocks of (k/v, block_size, head dim)
LAYERS = ("l0", "l1")
WAIT_S = 5.0


# ---------------------------------------------------------------------------- helpers
def settings(**overrides) -> _Settings:
    values = dict(
        host=HOST,
        port=0,
        engine_id="engine-d",
        block_size=BS,
        tp_size=1,
        recv_timeout_s=5.0,
        allow_debug_faults=False,
        is_producer=False,
    )
    values.update(overrides)
    return _Settings(**values)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def fake_request(request_id: str, params: dict | None, prompt: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, num_prompt_tokens=prompt)


class FakeBlocks:
    """vLLM's KVCacheBlocks: one KV cache group."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)

    def get_block_ids(self) -> tuple[list[int]]:
        return (list(self.ids),)


class FakeKVCacheManager:
    def __init__(self, blocks: dict[str, list[int]]) -> None:
        self.blocks = blocks

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return (list(self.blocks[req_id]),)


def sched_output(new=(), cached=(), scheduled=None, finished=()) -> SimpleNamespace:
    """new / cached: (req_id, num_computed_tokens) pairs; scheduled: req_id -> tokens this step."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], num_computed_tokens=[n for _, n in cached]),
        num_scheduled_tokens=dict(scheduled or {}),
        finished_req_ids=set(finished),
    )


@pytest.fixture
def posts(monkeypatch):
    """Captures the metaserver POSTs the scheduler side submits to its thread pool."""
    calls: list[tuple[str, dict]] = []
    event = threading.Event()

    def fake_post(url, body):
        calls.append((url, body))
        event.set()

    monkeypatch.setattr(lc, "_post_metaserver", fake_post)
    return SimpleNamespace(calls=calls, event=event)


def drain_posts(sched: _SchedulerSide) -> None:
    """Wait for every submitted POST to have run."""
    sched._poster.shutdown(wait=True)


def patterned_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(KV_SHAPE, generator=g) for name in LAYERS}


def layer_data(n_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {name: torch.randn((n_blocks, *KV_SHAPE[1:]), generator=g) for name in LAYERS}


def snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in caches.items()}


def expected_after(before: dict[str, torch.Tensor], block_ids: list[int], data: dict[str, torch.Tensor]):
    out = snapshot(before)
    for name, tensor in data.items():
        out[name][block_ids] = tensor
    return out


def assert_caches_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), f"layer {name} differs"


def poll_until(worker: _ConsumerWorker, req_id: str, timeout: float = WAIT_S) -> tuple[set[str], set[str]]:
    """Call results() until req_id is reported finished; returns everything reported so far."""
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = worker.results()
        finished |= res.finished_recving
        failed |= res.failed_recving
        if req_id in finished:
            return finished, failed
        time.sleep(0.002)
    raise AssertionError(f"{req_id} not reported within {timeout}s (finished={finished}, failed={failed})")


def wait_for(predicate, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.002)
    raise AssertionError("condition not met in time")


@pytest.fixture
def consumer():
    worker = _ConsumerWorker(settings(), None)
    worker.register_kv_caches(patterned_caches(seed=1))
    yield worker
    worker.close()


@pytest.fixture
def sender():
    s = FrameSender(timeout_s=5.0)
    yield s
    s.close()


def port_of(worker: _ConsumerWorker) -> int:
    return worker.server.address[1]


def send_layers(sender: FrameSender, port: int, tid: str, block_ids: list[int], data: dict[str, torch.Tensor]) -> None:
    for name, tensor in data.items():
        sender.send(HOST, port, {"type": "layer", "transfer": tid, "layer": name, "block_ids": block_ids}, tensor)


def send_done(sender: FrameSender, port: int, tid: str, frames: int) -> None:
    sender.send(HOST, port, {"type": "done", "transfer": tid, "frames": frames, "layers": len(LAYERS)})


# ---------------------------------------------------------------------------- transport
def _roundtrip_socketpair(header: dict, tensor: torch.Tensor | None):
    a, b = socket.socketpair()
    try:
        parts = encode(header, tensor)
        # A writer thread: a large payload would fill the socket buffer before anyone reads.
        writer = threading.Thread(target=lambda: [a.sendall(p) for p in parts])
        writer.start()
        frame = read_frame(b)
        writer.join(WAIT_S)
        return frame
    finally:
        a.close()
        b.close()


def test_encode_read_frame_header_only():
    frame = _roundtrip_socketpair({"type": "done", "transfer": "t-1", "frames": 3}, None)
    assert frame is not None
    assert frame.header == {"type": "done", "transfer": "t-1", "frames": 3}
    assert frame.tensor is None
    assert frame.received_at > 0


def test_encode_read_frame_float32_tensor_bit_identical():
    tensor = torch.randn(3, 2, 128, 64, generator=torch.Generator().manual_seed(0))
    frame = _roundtrip_socketpair({"type": "layer", "layer": "l0"}, tensor)
    assert frame is not None
    assert frame.header["type"] == "layer" and frame.header["layer"] == "l0"
    assert frame.header["dtype"] == "float32" and frame.header["shape"] == [3, 2, 128, 64]
    assert frame.tensor.dtype == torch.float32
    assert torch.equal(frame.tensor, tensor)


def test_encode_read_frame_non_contiguous_and_empty_tensors():
    base = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    view = base.transpose(0, 2)  # non-contiguous: encode makes it contiguous
    frame = _roundtrip_socketpair({"k": 1}, view)
    assert torch.equal(frame.tensor, view)
    empty = torch.empty(0, 2, 4, 6)
    frame = _roundtrip_socketpair({"k": 2}, empty)
    assert frame.tensor.shape == (0, 2, 4, 6) and frame.tensor.dtype == torch.float32


def test_read_frame_returns_none_when_peer_closes():
    a, b = socket.socketpair()
    a.close()
    try:
        assert read_frame(b) is None
    finally:
        b.close()


def test_encode_read_frame_bfloat16_tensor_bit_identical():
    tensor = torch.randn(3, 2, 128, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    frame = _roundtrip_socketpair({"type": "layer"}, tensor)
    assert frame.header["dtype"] == "bfloat16"
    assert frame.tensor.dtype == torch.bfloat16
    assert torch.equal(frame.tensor.view(torch.int16), tensor.view(torch.int16))


def test_frame_server_and_sender_keep_order_on_one_connection():
    server = FrameServer(HOST, 0)
    sender = FrameSender(timeout_s=5.0)
    try:
        port = server.address[1]
        g = torch.Generator().manual_seed(3)
        sent: list[tuple[dict, torch.Tensor | None]] = []
        for i in range(6):
            tensor = torch.randn(3, 2, 128, 64, generator=g) if i % 2 else None
            header = {"type": "layer" if tensor is not None else "note", "seq": i}
            sender.send(HOST, port, header, tensor)
            sent.append((header, tensor))
        assert len(sender._conns) == 1  # one connection per destination
        for header, tensor in sent:
            frame = server.inbox.get(timeout=WAIT_S)
            assert frame.header["seq"] == header["seq"]
            assert frame.header["type"] == header["type"]
            if tensor is None:
                assert frame.tensor is None
            else:
                assert torch.equal(frame.tensor, tensor)
        assert server.inbox.empty()
    finally:
        sender.close()
        server.close()


def test_frame_sender_raises_oserror_when_nothing_listens():
    sender = FrameSender(timeout_s=2.0)
    try:
        with pytest.raises(OSError):
            sender.send(HOST, free_port(), {"type": "done"})
        assert sender._conns == {}
    finally:
        sender.close()


# ---------------------------------------------------------------------------- scheduler side: decode
def decode_params(**extra) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "att-1", "metaserver": "http://relay/x"}
    params.update(extra)
    return params


def test_consumer_matched_tokens_only_with_remote_prefill():
    sched = _SchedulerSide(settings())
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 4) == (6, True)
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 0) == (10, True)
    # Everything cached locally: nothing to load.
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 8), 8) == (0, False)
    # No params, or not asked for remote prefill.
    assert sched.get_num_new_matched_tokens(fake_request("r", None, 10), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(fake_request("r", {}, 10), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(do_remote_prefill=False), 10), 0) == (0, False)
    # A producer never loads.
    producer = _SchedulerSide(settings(is_producer=True))
    assert producer.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 0) == (0, False)


def test_consumer_update_state_after_alloc_arms_once_and_posts(posts):
    sched = _SchedulerSide(settings(port=7777, engine_id="eng-7", recv_timeout_s=12.5))
    params = decode_params()
    req = fake_request("engine-req-1", params, 14)
    blocks = FakeBlocks([3, 5, 6, 7])  # the first block was prefix-cached: 4 tokens
    sched.update_state_after_alloc(req, blocks, num_external_tokens=10)
    assert params["do_remote_prefill"] is False
    assert posts.event.wait(WAIT_S)
    # A second call (vLLM may call again for new blocks) arms nothing and posts nothing.
    sched.update_state_after_alloc(req, FakeBlocks([3, 5, 6, 7, 9]), num_external_tokens=10)
    assert sched.get_num_new_matched_tokens(req, 4) == (0, False)

    meta = sched.build_connector_meta(sched_output(), FakeKVCacheManager({}))
    assert meta.recv == [RecvSpec("engine-req-1", "att-1", [3, 5, 6, 7], 10, 12.5)]
    assert meta.send == [] and meta.finished == []
    # Handed out once.
    assert sched.build_connector_meta(sched_output(), FakeKVCacheManager({})).recv == []

    drain_posts(sched)
    assert len(posts.calls) == 1
    url, body = posts.calls[0]
    assert url == "http://relay/x"
    expected = {
        "request_id": "att-1",
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [3, 5, 6, 7],
        "remote_block_size": BS,
        "remote_engine_id": "eng-7",
        "remote_host": HOST,
        "remote_port": 7777,
        "remote_tp_size": 1,
        "remote_cached_tokens": 4,
    }
    assert {k: body[k] for k in expected} == expected


def test_consumer_transfer_id_defaults_to_engine_request_id(posts):
    sched = _SchedulerSide(settings())
    params = decode_params()
    del params["request_id"]
    sched.update_state_after_alloc(fake_request("engine-req-2", params, 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    assert posts.calls[0][1]["request_id"] == "engine-req-2"
    assert posts.calls[0][1]["remote_cached_tokens"] == 0
    meta = sched.build_connector_meta(sched_output(), None)
    assert [(s.req_id, s.transfer_id) for s in meta.recv] == [("engine-req-2", "engine-req-2")]


def test_consumer_nothing_external_disarms_without_transfer(posts):
    sched = _SchedulerSide(settings())
    params = decode_params()
    sched.update_state_after_alloc(fake_request("r", params, 8), FakeBlocks([0, 1]), 0)
    assert params["do_remote_prefill"] is False
    drain_posts(sched)
    assert posts.calls == []
    assert sched.build_connector_meta(sched_output(), None).recv == []


def test_consumer_ignores_requests_without_remote_prefill(posts):
    sched = _SchedulerSide(settings())
    sched.update_state_after_alloc(fake_request("a", None, 8), FakeBlocks([0, 1]), 8)
    sched.update_state_after_alloc(fake_request("b", decode_params(do_remote_prefill=False), 8), FakeBlocks([0, 1]), 8)
    producer = _SchedulerSide(settings(is_producer=True))
    producer.update_state_after_alloc(fake_request("c", decode_params(), 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    drain_posts(producer)
    assert posts.calls == []
    assert sched.build_connector_meta(sched_output(), None).recv == []


def test_consumer_without_metaserver_still_arms(posts):
    sched = _SchedulerSide(settings())
    params = decode_params()
    del params["metaserver"]
    sched.update_state_after_alloc(fake_request("r", params, 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    assert posts.calls == []
    assert len(sched.build_connector_meta(sched_output(), None).recv) == 1


@pytest.mark.parametrize("allow_debug_faults, posted", [(False, True), (True, False)])
def test_debug_skip_metaserver_needs_allow_debug_faults(posts, allow_debug_faults, posted):
    sched = _SchedulerSide(settings(allow_debug_faults=allow_debug_faults))
    params = decode_params(debug_skip_metaserver=True)
    sched.update_state_after_alloc(fake_request("r", params, 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    assert (len(posts.calls) == 1) is posted
    # Either way the request is armed: with the fault, prefill never learns where to push.
    assert len(sched.build_connector_meta(sched_output(), None).recv) == 1


def test_finished_req_ids_appear_in_metadata():
    sched = _SchedulerSide(settings())
    meta = sched.build_connector_meta(sched_output(finished={"z", "a", "m"}), None)
    assert meta.finished == ["a", "m", "z"]
    assert sched.build_connector_meta(sched_output(), None).finished == []


# ---------------------------------------------------------------------------- scheduler side: prefill
def prefill_params(**extra) -> dict:
    params = {
        "request_id": "att-9",
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [10, 11, 12, 13],
        "remote_block_size": BS,
        "remote_engine_id": "engine-d",
        "remote_host": "10.0.0.5",
        "remote_port": 4567,
        "remote_tp_size": 1,
        "remote_cached_tokens": 4,
    }
    params.update(extra)
    return params


def covered_tokens(specs: list[SendSpec], start: int) -> list[int]:
    """Token positions whose blocks the specs push, starting from the first position not cached."""
    out = []
    for spec in specs:
        out.extend(range(start, start + spec.num_tokens))
        start += spec.num_tokens
    return out


def test_producer_two_chunks_cover_uncached_tokens_once():
    sched = _SchedulerSide(settings(is_producer=True))
    req = fake_request("p-1", prefill_params(), 14)  # 4 cached on decode, 10 to push
    sched.on_new_request(req)
    kvm = FakeKVCacheManager({"p-1": [0, 1, 2, 3]})

    # Step 1: prefill computes tokens [0, 8) (prefill has no cache of its own).
    m1 = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 8}), kvm)
    # Step 2: the rest, [8, 14).
    m2 = sched.build_connector_meta(sched_output(cached=[("p-1", 8)], scheduled={"p-1": 6}), kvm)
    # Step 3: a decode step on prefill: nothing more to push.
    m3 = sched.build_connector_meta(sched_output(cached=[("p-1", 14)], scheduled={"p-1": 1}), kvm)

    assert len(m1.send) == 1 and len(m2.send) == 1 and m3.send == []
    s1, s2 = m1.send[0], m2.send[0]
    for s in (s1, s2):
        assert (s.req_id, s.transfer_id, s.host, s.port, s.error) == ("p-1", "att-9", "10.0.0.5", 4567, None)
        assert not s.corrupt and s.push_delay_s == 0.0
    assert (s1.local_block_ids, s1.remote_block_ids, s1.num_tokens, s1.last_chunk) == ([1], [11], 4, False)
    assert (s2.local_block_ids, s2.remote_block_ids, s2.num_tokens, s2.last_chunk) == ([2, 3], [12, 13], 6, True)
    # Blocks 1..3 (tokens [4, 14)) are pushed exactly once; block 0 (cached on decode) never.
    pushed = s1.remote_block_ids + s2.remote_block_ids
    assert pushed == [11, 12, 13] and len(set(pushed)) == len(pushed)
    tokens = covered_tokens([s1, s2], 4)
    assert tokens == list(range(4, 14))
    assert sorted({t // BS for t in tokens}) == [1, 2, 3]


def test_producer_partial_block_is_pushed_again_when_completed():
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_cached_tokens=0), 14))
    kvm = FakeKVCacheManager({"p-1": [0, 1, 2, 3]})
    m1 = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 6}), kvm)
    m2 = sched.build_connector_meta(sched_output(cached=[("p-1", 6)], scheduled={"p-1": 8}), kvm)
    s1, s2 = m1.send[0], m2.send[0]
    assert (s1.remote_block_ids, s1.num_tokens, s1.last_chunk) == ([10, 11], 6, False)
    # Block 1 held only tokens 4, 5 after step 1: step 2 pushes it again, complete.
    assert (s2.remote_block_ids, s2.num_tokens, s2.last_chunk) == ([11, 12, 13], 8, True)
    assert s1.num_tokens + s2.num_tokens == 14


def test_producer_single_step_with_prefill_prefix_cache():
    """Prefill's own prefix cache covers more than decode's: the cached blocks are pushed too."""
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_cached_tokens=0), 14))
    kvm = FakeKVCacheManager({"p-1": [4, 5, 6, 7]})
    m = sched.build_connector_meta(sched_output(new=[("p-1", 12)], scheduled={"p-1": 2}), kvm)
    (s,) = m.send
    assert (s.local_block_ids, s.remote_block_ids, s.num_tokens, s.last_chunk) == ([4, 5, 6, 7], [10, 11, 12, 13], 14, True)


def test_producer_remote_block_list_too_short_is_an_error_spec():
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_block_ids=[10, 11], remote_cached_tokens=0), 14))
    m = sched.build_connector_meta(
        sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]})
    )
    (s,) = m.send
    assert s.error is not None and "too short" in s.error
    assert s.last_chunk


def test_producer_local_block_list_too_short_is_an_error_spec():
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_cached_tokens=0), 14))
    m = sched.build_connector_meta(
        sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1]})
    )
    assert m.send[0].error is not None and "local 2" in m.send[0].error


def test_producer_ignores_requests_without_remote_decode():
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("a", None, 8))
    sched.on_new_request(fake_request("b", prefill_params(do_remote_decode=False), 8))
    sched.on_new_request(fake_request("c", prefill_params(remote_host=None), 8))
    consumer_side = _SchedulerSide(settings(is_producer=False))
    consumer_side.on_new_request(fake_request("d", prefill_params(), 8))
    so = sched_output(new=[("a", 0), ("b", 0), ("c", 0), ("d", 0)], scheduled={"a": 8, "b": 8, "c": 8, "d": 8})
    kvm = FakeKVCacheManager({r: [0, 1] for r in "abcd"})
    assert sched.build_connector_meta(so, kvm).send == []
    assert consumer_side.build_connector_meta(so, kvm).send == []


def test_producer_forget_drops_the_plan():
    sched = _SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(), 14))
    sched.forget("p-1")
    m = sched.build_connector_meta(
        sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]})
    )
    assert m.send == []


@pytest.mark.parametrize("allow_debug_faults", [False, True])
def test_producer_debug_faults_need_allow_debug_faults(allow_debug_faults):
    sched = _SchedulerSide(settings(is_producer=True, allow_debug_faults=allow_debug_faults))
    sched.on_new_request(fake_request("p-1", prefill_params(debug_corrupt_kv=True, debug_push_delay_s=0.5), 14))
    m = sched.build_connector_meta(
        sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]})
    )
    (s,) = m.send
    assert s.corrupt is allow_debug_faults
    assert s.push_delay_s == (0.5 if allow_debug_faults else 0.0)


# ---------------------------------------------------------------------------- consumer worker
def arm(worker: _ConsumerWorker, req_id: str, tid: str, block_ids: list[int], num_tokens: int = 8, timeout_s: float = 30.0):
    worker.on_step(LayerwiseMetadata(recv=[RecvSpec(req_id, tid, block_ids, num_tokens, timeout_s)]))


def test_consumer_worker_only_stores_settings():
    worker = _ConsumerWorker(settings(), None)
    try:
        assert worker.server.address[0] == HOST and port_of(worker) > 0
        res = worker.results()
        assert res.finished_recving == set() and res.failed_recving == set()
        assert worker.take_records() == {}
    finally:
        worker.close()


def test_consumer_writes_received_layers_into_named_blocks(consumer, sender):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "req-1", "t-1", [2, 5, 6], num_tokens=9)
    data = layer_data(2, seed=1)
    send_layers(sender, port_of(consumer), "t-1", [5, 2], data)  # any order within the request's blocks
    send_done(sender, port_of(consumer), "t-1", frames=2)
    finished, failed = poll_until(consumer, "req-1")
    assert finished == {"req-1"} and failed == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [5, 2], data))
    records = consumer.take_records()
    assert set(records) == {"t-1"}
    rec = records["t-1"]
    assert rec["outcome"] == "done" and rec["error"] is None
    assert (rec["tokens_received"], rec["frames_received"], rec["layers_received"]) == (9, 2, 2)
    assert rec["armed_at"] <= rec["first_layer_at"] <= rec["last_layer_at"] <= rec["settled_at"]
    assert consumer.take_records() == {}
    # Reported once.
    assert consumer.results().finished_recving == set()


def test_consumer_frames_outside_the_request_blocks_fail_it(consumer, sender):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "req-1", "t-1", [2, 5])
    send_layers(sender, port_of(consumer), "t-1", [2, 7], layer_data(2, seed=2))
    finished, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"} and finished == {"req-1"}
    assert_caches_equal(consumer.kv.layers, before)
    rec = consumer.take_records()["t-1"]
    assert rec["outcome"] == "failed" and "outside" in rec["error"]
    assert rec["tokens_received"] == 0


def test_consumer_frame_of_wrong_shape_fails_it(consumer, sender):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "req-1", "t-1", [2, 5])
    sender.send(HOST, port_of(consumer), {"type": "layer", "transfer": "t-1", "layer": "l0", "block_ids": [2, 5]}, torch.ones(2, 3))
    _, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"}
    assert_caches_equal(consumer.kv.layers, before)
    assert "bad frame" in consumer.take_records()["t-1"]["error"]


def test_consumer_failed_frame_fails_it(consumer, sender):
    arm(consumer, "req-1", "t-1", [2, 5])
    sender.send(HOST, port_of(consumer), {"type": "failed", "transfer": "t-1", "reason": "prefill died"})
    finished, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"} and finished == {"req-1"}
    rec = consumer.take_records()["t-1"]
    assert (rec["outcome"], rec["error"]) == ("failed", "prefill died")


def test_consumer_missing_layer_fails_it(consumer, sender):
    arm(consumer, "req-1", "t-1", [2, 5])
    data = layer_data(2, seed=3)
    send_layers(sender, port_of(consumer), "t-1", [2, 5], {"l0": data["l0"]})
    send_done(sender, port_of(consumer), "t-1", frames=1)
    _, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"}
    assert "1 of 2 layers" in consumer.take_records()["t-1"]["error"]


def test_consumer_deadline_fails_it(consumer):
    arm(consumer, "req-1", "t-1", [2, 5], timeout_s=0.01)
    finished, failed = poll_until(consumer, "req-1")
    assert failed == {"req-1"} and finished == {"req-1"}
    rec = consumer.take_records()["t-1"]
    assert rec["outcome"] == "failed" and "no complete KV" in rec["error"]


def test_consumer_abort_while_waiting_reports_finished_and_drops_late_frames(consumer, sender):
    before = snapshot(consumer.kv.layers)
    port = port_of(consumer)
    arm(consumer, "req-1", "t-1", [2, 5])
    consumer.on_step(LayerwiseMetadata(finished=["req-1"]))
    res = consumer.results()
    assert res.finished_recving == {"req-1"} and res.failed_recving == set()
    assert consumer.take_records()["t-1"]["outcome"] == "aborted"

    # Late frames for the aborted transfer, then a second transfer on the same connection:
    # once the second is in, the late frames were seen (and dropped) before it.
    send_layers(sender, port, "t-1", [2, 5], layer_data(2, seed=4))
    send_done(sender, port, "t-1", frames=2)
    arm(consumer, "req-2", "t-2", [0])
    data2 = layer_data(1, seed=5)
    send_layers(sender, port, "t-2", [0], data2)
    send_done(sender, port, "t-2", frames=2)
    finished, failed = poll_until(consumer, "req-2")
    assert finished == {"req-2"} and failed == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [0], data2))
    assert "t-1" not in consumer._early  # not kept for a later arming either
    assert set(consumer.take_records()) == {"t-2"}


def test_consumer_abort_drops_frames_already_queued(consumer, sender):
    """Frames that arrived, but were not written yet, when the abort reaches the worker."""
    before = snapshot(consumer.kv.layers)
    arm(consumer, "req-1", "t-1", [2, 5])
    send_layers(sender, port_of(consumer), "t-1", [2, 5], layer_data(2, seed=6))
    wait_for(lambda: consumer.server.inbox.qsize() == 2)
    consumer.on_step(LayerwiseMetadata(finished=["req-1"]))
    assert consumer.results().finished_recving == {"req-1"}
    assert_caches_equal(consumer.kv.layers, before)


def test_consumer_finished_unknown_request_is_not_reported(consumer):
    consumer.on_step(LayerwiseMetadata(finished=["never-armed"]))
    assert consumer.results().finished_recving == set()


def test_consumer_frames_before_arming_are_applied_once_armed(consumer, sender):
    before = snapshot(consumer.kv.layers)
    data = layer_data(2, seed=7)
    send_layers(sender, port_of(consumer), "t-1", [6, 7], data)
    send_done(sender, port_of(consumer), "t-1", frames=2)

    def queued_early():
        consumer.results()
        return len(consumer._early.get("t-1", [])) == 3

    wait_for(queued_early)
    assert_caches_equal(consumer.kv.layers, before)  # nothing written before arming
    arm(consumer, "req-1", "t-1", [6, 7])
    res = consumer.results()
    assert res.finished_recving == {"req-1"} and res.failed_recving == set()
    assert_caches_equal(consumer.kv.layers, expected_after(before, [6, 7], data))
    assert "t-1" not in consumer._early


def test_consumer_take_records_outcomes(consumer, sender):
    port = port_of(consumer)
    consumer.on_step(
        LayerwiseMetadata(
            recv=[
                RecvSpec("r-done", "t-done", [0, 1], 8, 30.0),
                RecvSpec("r-failed", "t-failed", [2], 4, 30.0),
                RecvSpec("r-aborted", "t-aborted", [3], 4, 30.0),
            ]
        )
    )
    consumer.on_step(LayerwiseMetadata(finished=["r-aborted"]))
    sender.send(HOST, port, {"type": "failed", "transfer": "t-failed"})
    send_layers(sender, port, "t-done", [0, 1], layer_data(2, seed=8))
    send_done(sender, port, "t-done", frames=2)
    finished, failed = poll_until(consumer, "r-done")
    assert finished == {"r-done", "r-failed", "r-aborted"} and failed == {"r-failed"}
    outcomes = {tid: rec["outcome"] for tid, rec in consumer.take_records().items()}
    assert outcomes == {"t-done": "done", "t-failed": "failed", "t-aborted": "aborted"}


# ---------------------------------------------------------------------------- producer worker
@pytest.fixture
def producer():
    worker = _ProducerWorker(settings(is_producer=True))
    caches = patterned_caches(seed=2)
    worker.register_kv_caches(caches)
    yield worker
    worker.close()


def send_spec(port: int, local: list[int], remote: list[int], num_tokens: int, last_chunk: bool, **kw) -> SendSpec:
    return SendSpec(
        req_id="p-req",
        transfer_id="t-1",
        host=HOST,
        port=port,
        local_block_ids=local,
        remote_block_ids=remote,
        num_tokens=num_tokens,
        last_chunk=last_chunk,
        **kw,
    )


def run_step(producer: _ProducerWorker, spec: SendSpec) -> None:
    meta = LayerwiseMetadata(send=[spec])
    for name in LAYERS:
        producer.push_layer(meta, name, producer.kv.layers[name])
    producer.finish_step(meta)


def test_producer_pushes_layers_the_consumer_writes(producer, consumer):
    before = snapshot(consumer.kv.layers)
    port = port_of(consumer)
    arm(consumer, "d-req", "t-1", [0, 2, 5], num_tokens=8)
    # Two chunked steps: local block 1 -> remote 2, then local 3 -> remote 5.
    run_step(producer, send_spec(port, [1], [2], 4, last_chunk=False))
    assert consumer.results().finished_recving == set()
    run_step(producer, send_spec(port, [3], [5], 4, last_chunk=True))
    finished, failed = poll_until(consumer, "d-req")
    assert finished == {"d-req"} and failed == set()
    sent = {name: producer.kv.layers[name][[1, 3]] for name in LAYERS}
    assert_caches_equal(consumer.kv.layers, expected_after(before, [2, 5], sent))

    records = producer.take_records()
    rec = records["t-1"]
    assert rec["role"] == "prefill" and rec["outcome"] == "done" and "error" not in rec
    assert rec["layers_pushed"] == 4 == len(rec["push_times"])
    assert rec["tokens_pushed"] == 8 and rec["steps"] == 2
    assert rec["first_layer_sent_at"] <= rec["last_layer_sent_at"] <= rec["forward_done_at"]
    assert producer.take_records() == {}
    assert consumer.take_records()["t-1"]["frames_received"] == 4


def test_producer_unfinished_transfer_keeps_its_record(producer, consumer):
    arm(consumer, "d-req", "t-1", [2])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 4, last_chunk=False))
    assert producer.take_records() == {}  # only finished transfers are shipped


def test_producer_corrupt_sends_different_data(producer, consumer):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "d-req", "t-1", [2, 5])
    run_step(producer, send_spec(port_of(consumer), [1, 3], [2, 5], 8, last_chunk=True, corrupt=True))
    finished, failed = poll_until(consumer, "d-req")
    assert finished == {"d-req"} and failed == set()
    noise = torch.randn((2, *KV_SHAPE[1:]), generator=torch.Generator().manual_seed(0))
    for name in LAYERS:
        got = consumer.kv.layers[name][[2, 5]]
        assert not torch.equal(got, producer.kv.layers[name][[1, 3]])
        assert torch.equal(got, noise)
        keep = [b for b in range(KV_SHAPE[0]) if b not in (2, 5)]
        assert torch.equal(consumer.kv.layers[name][keep], before[name][keep])


def test_producer_error_spec_fails_the_consumer(producer, consumer):
    before = snapshot(consumer.kv.layers)
    arm(consumer, "d-req", "t-1", [2, 5])
    run_step(producer, send_spec(port_of(consumer), [1], [2], 8, last_chunk=False, error="block list too short"))
    finished, failed = poll_until(consumer, "d-req")
    assert failed == {"d-req"}
    assert consumer.take_records()["t-1"]["error"] == "block list too short"
    assert_caches_equal(consumer.kv.layers, before)
    rec = producer.take_records()["t-1"]
    assert (rec["outcome"], rec["error"], rec["layers_pushed"], rec["tokens_pushed"]) == (
        "failed",
        "block list too short",
        0,
        0,
    )


def test_producer_unreachable_decode_fails_the_transfer(producer):
    run_step(producer, send_spec(free_port(), [1], [2], 4, last_chunk=False))
    rec = producer.take_records()["t-1"]
    assert rec["outcome"] == "failed" and "push to" in rec["error"]
    assert rec["layers_pushed"] == 0 and rec["tokens_pushed"] == 0


def test_producer_pushes_bfloat16_kv(consumer):
    worker = _ProducerWorker(settings(is_producer=True))
    try:
        caches = {k: v.to(torch.bfloat16) for k, v in patterned_caches(seed=3).items()}
        worker.register_kv_caches(caches)
        bf16 = {k: torch.zeros(KV_SHAPE, dtype=torch.bfloat16) for k in LAYERS}
        consumer.register_kv_caches(bf16)
        arm(consumer, "d-req", "t-1", [2])
        run_step(worker, send_spec(port_of(consumer), [1], [2], 4, last_chunk=True))
        finished, failed = poll_until(consumer, "d-req")
        assert failed == set()
        for name in LAYERS:
            assert torch.equal(bf16[name][2], caches[name][1])
    finally:
        worker.close()


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
    stats = lc.LayerwisePushConnector.build_kv_connector_stats({"transfers": {"t": {}}})
    assert isinstance(stats, LayerwiseStats) and stats.reduce() == {"transfers": 1}
    assert lc.LayerwisePushConnector.build_kv_connector_stats(None).is_empty()
