"""The connector's scheduler side, driven by hand with stand-ins for vLLM's Request,
KVCacheBlocks, kv_cache_manager and SchedulerOutput (no engine, no Ray)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from serve_app.kv.metadata import SendSpec
from serve_app.kv.scheduler_side import SchedulerSide
from tests.support.kv_helpers import (
    BS,
    HOST,
    WAIT_S,
    FakeBlocks,
    FakeKVCacheManager,
    fake_request,
    sched_output,
    settings,
)


@pytest.fixture
def posts():
    """Captures the metaserver POSTs the scheduler side submits to its thread pool."""
    calls: list[tuple[str, dict]] = []
    event = threading.Event()

    def fake_post(url, body):
        calls.append((url, body))
        event.set()

    return SimpleNamespace(calls=calls, event=event, post=fake_post)


def drain_posts(sched: SchedulerSide) -> None:
    """Wait for every submitted POST to have run."""
    sched._poster.shutdown(wait=True)


def consumer_side(posts=None, **overrides) -> SchedulerSide:
    return SchedulerSide(settings(**overrides), post=posts.post if posts else lambda url, body: None)


def decode_params(**extra) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "att-1", "metaserver": "http://relay/x"}
    params.update(extra)
    return params


def test_consumer_matched_tokens_only_with_remote_prefill():
    sched = consumer_side()
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 4) == (6, True)
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 0) == (10, True)
    # Everything cached locally: nothing to load.
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 8), 8) == (0, False)
    # No params, or not asked for remote prefill.
    assert sched.get_num_new_matched_tokens(fake_request("r", None, 10), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(fake_request("r", {}, 10), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(do_remote_prefill=False), 10), 0) == (0, False)
    # A producer never loads.
    producer = SchedulerSide(settings(is_producer=True))
    assert producer.get_num_new_matched_tokens(fake_request("r", decode_params(), 10), 0) == (0, False)


def test_consumer_update_state_after_alloc_arms_once_and_posts(posts):
    sched = consumer_side(posts, port=7777, engine_id="eng-7", recv_timeout_s=12.5)
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
    (spec,) = meta.recv
    # Frames may write only the blocks after the prefix-cached one (block 3 may be shared).
    assert (spec.req_id, spec.transfer_id, spec.block_ids, spec.num_tokens, spec.timeout_s) == (
        "engine-req-1",
        "att-1",
        [5, 6, 7],
        10,
        12.5,
    )
    assert spec.rejected is None and len(spec.secret) >= 24
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
        "transfer_secret": spec.secret,
    }
    assert {k: body[k] for k in expected} == expected


def test_consumer_transfer_id_defaults_to_engine_request_id(posts):
    sched = consumer_side(posts)
    params = decode_params()
    del params["request_id"]
    sched.update_state_after_alloc(fake_request("engine-req-2", params, 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    assert posts.calls[0][1]["request_id"] == "engine-req-2"
    assert posts.calls[0][1]["remote_cached_tokens"] == 0
    meta = sched.build_connector_meta(sched_output(), None)
    assert [(s.req_id, s.transfer_id) for s in meta.recv] == [("engine-req-2", "engine-req-2")]


def test_consumer_nothing_external_disarms_without_transfer(posts):
    sched = consumer_side(posts)
    params = decode_params()
    sched.update_state_after_alloc(fake_request("r", params, 8), FakeBlocks([0, 1]), 0)
    assert params["do_remote_prefill"] is False
    drain_posts(sched)
    assert posts.calls == []
    assert sched.build_connector_meta(sched_output(), None).recv == []


def test_consumer_ignores_requests_without_remote_prefill(posts):
    sched = consumer_side(posts)
    sched.update_state_after_alloc(fake_request("a", None, 8), FakeBlocks([0, 1]), 8)
    sched.update_state_after_alloc(fake_request("b", decode_params(do_remote_prefill=False), 8), FakeBlocks([0, 1]), 8)
    producer = SchedulerSide(settings(is_producer=True))
    producer.update_state_after_alloc(fake_request("c", decode_params(), 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    drain_posts(producer)
    assert posts.calls == []
    assert sched.build_connector_meta(sched_output(), None).recv == []


def test_consumer_without_metaserver_still_arms(posts):
    sched = consumer_side(posts)
    params = decode_params()
    del params["metaserver"]
    sched.update_state_after_alloc(fake_request("r", params, 8), FakeBlocks([0, 1]), 8)
    drain_posts(sched)
    assert posts.calls == []
    assert len(sched.build_connector_meta(sched_output(), None).recv) == 1


def test_finished_req_ids_appear_in_metadata():
    sched = consumer_side()
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
        "transfer_secret": "s-9",
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
    sched = SchedulerSide(settings(is_producer=True))
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
        assert s.secret == "s-9"
    assert (s1.local_block_ids, s1.remote_block_ids, s1.num_tokens, s1.last_chunk) == ([1], [11], 4, False)
    assert (s2.local_block_ids, s2.remote_block_ids, s2.num_tokens, s2.last_chunk) == ([2, 3], [12, 13], 6, True)
    # Blocks 1..3 (tokens [4, 14)) are pushed exactly once; block 0 (cached on decode) never.
    pushed = s1.remote_block_ids + s2.remote_block_ids
    assert pushed == [11, 12, 13] and len(set(pushed)) == len(pushed)
    tokens = covered_tokens([s1, s2], 4)
    assert tokens == list(range(4, 14))
    assert sorted({t // BS for t in tokens}) == [1, 2, 3]


def test_producer_partial_block_is_pushed_again_when_completed():
    sched = SchedulerSide(settings(is_producer=True))
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
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_cached_tokens=0), 14))
    kvm = FakeKVCacheManager({"p-1": [4, 5, 6, 7]})
    m = sched.build_connector_meta(sched_output(new=[("p-1", 12)], scheduled={"p-1": 2}), kvm)
    (s,) = m.send
    assert (s.local_block_ids, s.remote_block_ids, s.num_tokens, s.last_chunk) == ([4, 5, 6, 7], [10, 11, 12, 13], 14, True)


def test_producer_remote_block_list_too_short_is_an_error_spec():
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_block_ids=[10, 11], remote_cached_tokens=0), 14))
    m = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]}))
    (s,) = m.send
    assert s.error is not None and "too short" in s.error
    assert s.last_chunk


def test_producer_local_block_list_too_short_is_an_error_spec():
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(remote_cached_tokens=0), 14))
    m = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1]}))
    assert m.send[0].error is not None and "local 2" in m.send[0].error


def test_producer_ignores_requests_without_remote_decode():
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("a", None, 8))
    sched.on_new_request(fake_request("b", prefill_params(do_remote_decode=False), 8))
    sched.on_new_request(fake_request("c", prefill_params(remote_host=None), 8))
    consumer_side = SchedulerSide(settings(is_producer=False))
    consumer_side.on_new_request(fake_request("d", prefill_params(), 8))
    so = sched_output(new=[("a", 0), ("b", 0), ("c", 0), ("d", 0)], scheduled={"a": 8, "b": 8, "c": 8, "d": 8})
    kvm = FakeKVCacheManager({r: [0, 1] for r in "abcd"})
    assert sched.build_connector_meta(so, kvm).send == []
    assert consumer_side.build_connector_meta(so, kvm).send == []


def test_producer_forget_drops_the_plan():
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(), 14))
    sched.forget("p-1")
    m = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]}))
    assert m.send == []


def test_each_transfer_gets_its_own_secret(posts):
    sched = consumer_side(posts)
    for i in range(3):
        sched.update_state_after_alloc(fake_request(f"r{i}", decode_params(request_id=f"att-{i}"), 8), FakeBlocks([i]), 8)
    secrets = [spec.secret for spec in sched.build_connector_meta(sched_output(), None).recv]
    assert len(set(secrets)) == 3
    drain_posts(sched)
    assert [body["transfer_secret"] for _, body in posts.calls] == secrets


def test_a_transfer_id_is_armed_once_per_engine(posts):
    sched = consumer_side(posts)
    sched.update_state_after_alloc(fake_request("r1", decode_params(request_id="att-x"), 8), FakeBlocks([0, 1]), 8)
    # A second request naming the same transfer id, while the first is armed and after it ended.
    sched.update_state_after_alloc(fake_request("r2", decode_params(request_id="att-x"), 8), FakeBlocks([2, 3]), 8)
    sched.forget("r1")
    sched.update_state_after_alloc(fake_request("r3", decode_params(request_id="att-x"), 8), FakeBlocks([4, 5]), 8)
    first, second, third = sched.build_connector_meta(sched_output(), None).recv
    assert first.rejected is None
    assert second.rejected and "already in use" in second.rejected
    assert third.rejected and "already in use" in third.rejected
    drain_posts(sched)
    assert len(posts.calls) == 1  # only the first one is announced to prefill


def test_a_whole_prompt_prefix_hit_needs_no_transfer():
    """vLLM recomputes the last position of a fully cached prompt itself (num_computed is then not
    a whole number of blocks): that position lies in a shared cached block, so no push."""
    sched = consumer_side()
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 12), 11) == (0, False)
    assert sched.get_num_new_matched_tokens(fake_request("r", decode_params(), 12), 8) == (4, True)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"remote_block_size": BS * 2}, "blocks of"),
        ({"remote_cached_tokens": 3}, "whole number of blocks"),
        ({"remote_port": "not a port"}, "bad kv_transfer_params"),
        ({"remote_block_ids": ["x"]}, "bad kv_transfer_params"),
    ],
)
def test_producer_refuses_parameters_it_cannot_honour(extra, match):
    sched = SchedulerSide(settings(is_producer=True))
    sched.on_new_request(fake_request("p-1", prefill_params(**extra), 14))
    m = sched.build_connector_meta(sched_output(new=[("p-1", 0)], scheduled={"p-1": 14}), FakeKVCacheManager({"p-1": [0, 1, 2, 3]}))
    (s,) = m.send
    assert s.error is not None and match in s.error and s.last_chunk


def test_a_transfer_id_the_wire_would_refuse_is_rejected_at_once(posts):
    """No frame could name it (kv/wire.py checks transfer ids on parse), so it fails now instead
    of at its receive deadline, and is never announced to prefill."""
    sched = consumer_side(posts)
    sched.update_state_after_alloc(fake_request("r1", decode_params(request_id="att\n1"), 8), FakeBlocks([2, 3]), 8)
    (spec,) = sched.build_connector_meta(sched_output(), None).recv
    assert spec.rejected and "not one the KV side channel accepts" in spec.rejected
    drain_posts(sched)
    assert posts.calls == []
