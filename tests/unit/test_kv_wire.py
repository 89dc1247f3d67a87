"""The KV side channel's frame format: encoding, parsing and every rule a receiver enforces
before it holds a frame's bytes."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading

import pytest
import torch

from serve_app.kv.wire import (
    KIND_DONE,
    KIND_FAILED,
    KIND_LAYER,
    MAGIC,
    PREAMBLE,
    WIRE_VERSION,
    DoneHeader,
    FailedHeader,
    FrameLimits,
    KVGeometry,
    LayerHeader,
    Preamble,
    WireError,
    check_sizes,
    compat_hash,
    discard,
    encode_frame,
    parse_header,
    read_preamble,
    recv_exact,
    tensor_bytes,
)


def roundtrip(parts):
    """(preamble, header bytes, payload bytes) as a receiver reads them off a socket."""
    a, b = socket.socketpair()
    try:
        writer = threading.Thread(target=lambda: [a.sendall(p) for p in parts])
        writer.start()
        pre = read_preamble(b)
        head = recv_exact(b, pre.header_len)
        payload = recv_exact(b, pre.payload_len)
        writer.join(5)
        return pre, bytes(head), bytes(payload)
    finally:
        a.close()
        b.close()


def test_layer_frame_roundtrip_is_bit_identical_for_float32_and_bfloat16():
    for dtype in (torch.float32, torch.bfloat16):
        data = torch.randn(3, 2, 4, 6).to(dtype)
        header = {"transfer": "t", "secret": "s", "layer": "l0", "block_ids": [4, 1, 7]}
        pre, head, payload = roundtrip(encode_frame(KIND_LAYER, 42, header, [tensor_bytes(data)]))
        assert (pre.kind, pre.compat, pre.payload_len) == (KIND_LAYER, 42, data.numel() * data.element_size())
        assert parse_header(pre.kind, head) == LayerHeader("t", "s", "l0", (4, 1, 7))
        back = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(data.shape)
        assert torch.equal(back, data)


def test_done_and_failed_frames_carry_no_payload():
    pre, head, payload = roundtrip(encode_frame(KIND_DONE, 1, {"transfer": "t", "secret": "s", "frames": 4}))
    assert payload == b"" and parse_header(pre.kind, head) == DoneHeader("t", "s", 4)
    pre, head, _ = roundtrip(encode_frame(KIND_FAILED, 1, {"transfer": "t", "secret": "s", "reason": "boom"}))
    assert parse_header(pre.kind, head) == FailedHeader("t", "s", "boom")


def test_read_preamble_is_none_only_at_a_clean_end():
    a, b = socket.socketpair()
    a.close()
    assert read_preamble(b) is None
    b.close()
    a, b = socket.socketpair()
    a.sendall(MAGIC)  # a preamble cut short
    a.close()
    with pytest.raises(WireError, match="mid-frame"):
        read_preamble(b)
    b.close()


@pytest.mark.parametrize(
    "raw,match",
    [
        (PREAMBLE.pack(b"HTTP", WIRE_VERSION, KIND_LAYER, 0, 0, 0, 0), "magic"),
        (PREAMBLE.pack(MAGIC, WIRE_VERSION + 1, KIND_LAYER, 0, 0, 0, 0), "version"),
        (PREAMBLE.pack(MAGIC, WIRE_VERSION, 9, 0, 0, 0, 0), "kind"),
    ],
)
def test_foreign_or_future_frames_are_refused(raw, match):
    a, b = socket.socketpair()
    a.sendall(raw)
    with pytest.raises(WireError, match=match):
        read_preamble(b)
    a.close()
    b.close()


LIMITS = FrameLimits(max_blocks=4, block_bytes=192)


@pytest.mark.parametrize(
    "pre,match",
    [
        (Preamble(KIND_LAYER, 0, LIMITS.max_header_bytes + 1, 0), "header of"),
        (Preamble(KIND_LAYER, 0, 100, LIMITS.max_payload_bytes + 1), "payload of"),
        (Preamble(KIND_DONE, 0, 100, 8), "no payload"),
        (Preamble(KIND_LAYER, 0, 1 << 31, 1 << 40), "header of"),
    ],
)
def test_sizes_are_capped_by_the_receivers_geometry(pre, match):
    with pytest.raises(WireError, match=match):
        check_sizes(pre, LIMITS)


def test_sizes_within_limits_pass():
    """A frame at the limits exactly passes the check and is read whole; one byte more of its
    header or of its payload does not pass."""
    header: dict = {"transfer": "t", "secret": "s", "layer": "l0", "block_ids": [0, 1, 2, 3], "pad": ""}
    header["pad"] = "x" * (LIMITS.max_header_bytes - len(json.dumps(header, separators=(",", ":"))))
    pre, head, payload = roundtrip(encode_frame(KIND_LAYER, 1, header, [bytes(range(256)) * 3]))
    assert (pre.header_len, pre.payload_len) == (LIMITS.max_header_bytes, LIMITS.max_payload_bytes)
    assert check_sizes(pre, LIMITS) is None
    assert len(head) == LIMITS.max_header_bytes and payload == bytes(range(256)) * 3
    assert parse_header(pre.kind, head) == LayerHeader("t", "s", "l0", (0, 1, 2, 3))
    for over in (dataclasses.replace(pre, header_len=pre.header_len + 1), dataclasses.replace(pre, payload_len=pre.payload_len + 1)):
        with pytest.raises(WireError):
            check_sizes(over, LIMITS)


@pytest.mark.parametrize(
    "kind,header,match",
    [
        (KIND_LAYER, b"not json", "JSON"),
        (KIND_LAYER, b"[1]", "object"),
        (KIND_LAYER, json.dumps({"secret": "s", "layer": "l", "block_ids": [1]}).encode(), "transfer"),
        (KIND_LAYER, json.dumps({"transfer": "t", "layer": "l", "block_ids": [1]}).encode(), "secret"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "", "layer": "l", "block_ids": [1]}).encode(), "secret"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "s", "layer": "l", "block_ids": []}).encode(), "block_ids"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "s", "layer": "l", "block_ids": [1, -2]}).encode(), "block_ids"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "s", "layer": "l", "block_ids": [1, True]}).encode(), "block_ids"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "s", "layer": "l", "block_ids": [3, 3]}).encode(), "twice"),
        (KIND_LAYER, json.dumps({"transfer": "t", "secret": "s", "block_ids": [1]}).encode(), "layer"),
        (KIND_LAYER, json.dumps({"transfer": "t" * 300, "secret": "s", "layer": "l", "block_ids": [1]}).encode(), "transfer"),
        (KIND_DONE, json.dumps({"transfer": "t", "secret": "s", "frames": -1}).encode(), "frames"),
        (KIND_DONE, json.dumps({"transfer": "t", "secret": "s", "frames": "2"}).encode(), "frames"),
        (KIND_DONE, b"\xff\xfe", "JSON"),
    ],
)
def test_headers_outside_the_schema_are_refused(kind, header, match):
    with pytest.raises(WireError, match=match):
        parse_header(kind, header)


def test_compat_hash_tells_layouts_apart():
    base = compat_hash(torch.float32, (2, 4, 6), 4, 2)
    assert base == compat_hash(torch.float32, (2, 4, 6), 4, 2)
    others = {
        compat_hash(torch.bfloat16, (2, 4, 6), 4, 2),
        compat_hash(torch.float32, (2, 4, 8), 4, 2),
        compat_hash(torch.float32, (2, 4, 6), 8, 2),
        compat_hash(torch.float32, (2, 4, 6), 4, 3),
    }
    assert base not in others and len(others) == 4


def test_geometry_of_a_block_major_cache():
    caches = {"a": torch.zeros(8, 2, 4, 6), "b": torch.zeros(8, 2, 4, 6)}
    geometry = KVGeometry.of(caches, block_size=4)
    assert geometry.block_shape == (2, 4, 6) and geometry.block_bytes == 2 * 4 * 6 * 4 and geometry.layers == ("a", "b")
    assert geometry.compat == compat_hash(torch.float32, (2, 4, 6), 4, 2)


def test_discard_reads_exactly_and_fails_on_a_short_stream():
    a, b = socket.socketpair()
    a.sendall(b"x" * 10 + b"NEXT")
    discard(b, 10, chunk=3)
    assert recv_exact(b, 4) == b"NEXT"
    a.sendall(b"yy")
    a.close()
    with pytest.raises(WireError):
        discard(b, 5)
    b.close()


def test_preamble_layout_is_fixed():
    assert PREAMBLE.format == "!4sHBBQIQ" and PREAMBLE.size == struct.calcsize("!4sHBBQIQ") == 28


# ---------------------------------------------------------------------------- version 2: acks, ids
def test_an_ack_frame_roundtrips_and_names_its_transfer():
    from serve_app.kv.wire import KIND_ACK, TO_PREFILL, AckHeader, check_ack_sizes, encode_ack, parse_ack

    for ok, reason in ((True, ""), (False, "2 of 3 frames arrived")):
        a, b = socket.socketpair()
        a.sendall(encode_ack(42, "chatcmpl-0f3a-1", ok, reason))
        pre = read_preamble(b, TO_PREFILL)
        assert (pre.kind, pre.compat, pre.payload_len) == (KIND_ACK, 42, 0)
        check_ack_sizes(pre)
        assert parse_ack(recv_exact(b, pre.header_len)) == AckHeader("chatcmpl-0f3a-1", ok, reason)
        a.close()
        b.close()


def test_frames_are_accepted_in_their_direction_only():
    """A receiver refuses an ack (decode -> prefill only) and a sender refuses anything else."""
    from serve_app.kv.wire import TO_PREFILL, encode_ack

    a, b = socket.socketpair()
    a.sendall(encode_ack(1, "t", True))
    with pytest.raises(WireError, match="not accepted"):
        read_preamble(b)  # a receiver's default: layer, done, failed
    a.close()
    b.close()
    a, b = socket.socketpair()
    a.sendall(b"".join(bytes(p) for p in encode_frame(KIND_DONE, 1, {"transfer": "t", "secret": "s", "frames": 1})))
    with pytest.raises(WireError, match="not accepted"):
        read_preamble(b, TO_PREFILL)
    a.close()
    b.close()


def test_version_1_peers_are_refused_at_their_first_frame():
    """Version 2 senders wait for acks a version 1 receiver never sends: the version (and the
    compat hash, which includes it) tell them apart at once."""
    assert WIRE_VERSION == 2
    a, b = socket.socketpair()
    a.sendall(PREAMBLE.pack(MAGIC, 1, KIND_LAYER, 0, 0, 0, 0))
    with pytest.raises(WireError, match="version 1"):
        read_preamble(b)
    a.close()
    b.close()


@pytest.mark.parametrize(
    "header",
    [
        {"transfer": 5, "ok": True},
        {"transfer": "t\nx", "ok": True},
        {"transfer": "t", "ok": "yes"},
        {"transfer": "t"},
        [1],
    ],
)
def test_acks_outside_the_schema_are_refused(header):
    from serve_app.kv.wire import parse_ack

    with pytest.raises(WireError):
        parse_ack(json.dumps(header).encode())


@pytest.mark.parametrize(
    "tid",
    ["t\nINFO forged log line", "t 1", "t\x00", "t\u2028", "", "é", "t" * 257, "t\r"],
)
def test_transfer_ids_outside_the_safe_charset_are_refused(tid):
    """Transfer ids end up in logs and records: a newline or a control character in one must
    never get that far."""
    for kind, extra in ((KIND_LAYER, {"layer": "l", "block_ids": [1]}), (KIND_DONE, {"frames": 1}), (KIND_FAILED, {})):
        with pytest.raises(WireError, match="transfer"):
            parse_header(kind, json.dumps({"transfer": tid, "secret": "s", **extra}).encode())


def test_attempt_ids_are_valid_transfer_ids():
    from serve_app.kv.wire import valid_transfer_id

    for tid in ("chatcmpl-5f0c9d2e8a7b4c1d9e0f1a2b3c4d5e6f-1", "cmpl-abc-12", "t-1", "x", "a" * 256):
        assert valid_transfer_id(tid)
        assert parse_header(KIND_DONE, json.dumps({"transfer": tid, "secret": "s", "frames": 0}).encode()).transfer == tid


def test_failure_reasons_from_a_peer_are_escaped():
    header = parse_header(KIND_FAILED, json.dumps({"transfer": "t", "secret": "s", "reason": "boom\nWARNING forged\x1b[31m"}).encode())
    assert "\n" not in header.reason and "\x1b" not in header.reason
    assert header.reason == "boom\\nWARNING forged\\x1b[31m"


@pytest.mark.parametrize("kind", ["header", "ack"])
def test_a_deeply_nested_header_is_a_bad_frame_not_a_receiver_error(kind):
    """Nesting past Python's recursion limit fits inside the header size caps (2 bytes a level);
    it must close the connection as any bad frame does, not end in a logged traceback."""
    from serve_app.kv.wire import MAX_ACK_HEADER_BYTES, parse_ack

    raw = b"[" * 1020 + b"]" * 1020
    assert len(raw) <= min(MAX_ACK_HEADER_BYTES, FrameLimits(max_blocks=17, block_bytes=192).max_header_bytes)
    with pytest.raises(WireError, match="nested"):
        parse_ack(raw) if kind == "ack" else parse_header(KIND_LAYER, raw)
