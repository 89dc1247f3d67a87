"""The KV side channel's wire format: versioned, length-prefixed frames over TCP.

One frame::

    preamble (fixed 28 bytes, network order)
        magic   4s   b"PDKV"
        version u16  WIRE_VERSION
        kind    u8   KIND_LAYER | KIND_DONE | KIND_FAILED (prefill -> decode), KIND_ACK (decode -> prefill)
        flags   u8   0 (reserved)
        compat  u64  hash of the KV layout both ends must share (``compat_hash``)
        header  u32  length of the JSON header
        payload u64  length of the raw payload (layer frames only)
    header  UTF-8 JSON: {"transfer", "secret", ...} (see ``LayerHeader`` and friends)
    payload the layer's KV of the named blocks, block after block, in the sender's layout

Everything a receiver needs to refuse a frame comes before the bytes it would have to hold: the
preamble says how much follows, so sizes are checked against the receiving engine's own block
geometry before any buffer is allocated, and the compat hash (like the one vLLM's NIXL connector
exchanges in its handshake) refuses a peer whose dtype, block size or layout differ. A frame that
breaks any rule raises ``WireError``; the receiver then closes that connection, because after a
bad length nothing later on it can be trusted.

Version 2 added the acknowledgement: decode answers a transfer's ``done`` frame, on the connection
it came on, with an ``ack`` frame (same preamble, no payload, header ``{"transfer", "ok",
"reason"}``), so prefill reports a push delivered only when the receiver has it, not when its bytes
went into a kernel buffer. ``ok`` false (a negative ack) says the receiver failed the transfer. The
version is in the preamble and in the compat hash, so a version-1 peer is refused at its first
frame instead of leaving a version-2 sender waiting for acks that never come.

Transfer ids come from the peer and end up in logs and records: they are checked on parse against
``TRANSFER_ID`` (bounded, no spaces or control characters), and free text from a peer (a failure
reason) is escaped with ``printable`` before anything keeps it.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"PDKV"
WIRE_VERSION = 2
KIND_LAYER = 1
KIND_DONE = 2
KIND_FAILED = 3
KIND_ACK = 4
KINDS = {KIND_LAYER: "layer", KIND_DONE: "done", KIND_FAILED: "failed", KIND_ACK: "ack"}
TO_DECODE = frozenset({KIND_LAYER, KIND_DONE, KIND_FAILED})  # what a receiver accepts
TO_PREFILL = frozenset({KIND_ACK})  # what a sender accepts back

PREAMBLE = struct.Struct("!4sHBBQIQ")
MAX_ID_CHARS = 256  # transfer ids and secrets
MAX_REASON_CHARS = 1024
# Bytes a header may take besides its block ids (keys, transfer id, secret, layer name).
HEADER_OVERHEAD = 4096
BYTES_PER_BLOCK_ID = 12  # up to 11 digits and a comma
MAX_ACK_HEADER_BYTES = 2048
# What the router's attempt ids (``<prefix>-<hex>-<n>``) are made of; anything else is refused.
TRANSFER_ID = re.compile(rf"[A-Za-z0-9._:@+=/-]{{1,{MAX_ID_CHARS}}}")


class WireError(ValueError):
    """A frame that breaks the protocol. The connection it came on is closed."""


@dataclass(frozen=True)
class Preamble:
    kind: int
    compat: int
    header_len: int
    payload_len: int


@dataclass(frozen=True)
class KVGeometry:
    """What both ends of a transfer must agree on, read off the engine's own KV cache.

    The KV cache is block-major (``[num_blocks, ...]`` per layer, vLLM's CPU layout), so one
    block of one layer is ``block_bytes`` contiguous bytes.
    """

    dtype: torch.dtype
    block_shape: tuple[int, ...]  # one block of one layer
    block_size: int  # tokens per block
    layers: tuple[str, ...]

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def compat(self) -> int:
        return compat_hash(self.dtype, self.block_shape, self.block_size, len(self.layers))

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], block_size: int) -> KVGeometry:
        first = next(iter(kv_caches.values()))
        return cls(dtype=first.dtype, block_shape=tuple(first.shape[1:]), block_size=block_size, layers=tuple(kv_caches))


def compat_hash(dtype: torch.dtype, block_shape: Sequence[int], block_size: int, num_layers: int) -> int:
    """A 64-bit fingerprint of the KV layout; two engines can exchange KV only when theirs match."""
    text = f"v{WIRE_VERSION}|block-major|{dtype}|{tuple(block_shape)}|{block_size}|{num_layers}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class FrameLimits:
    """The largest frame a receiver accepts, from its own geometry and context length."""

    max_blocks: int  # blocks of one request (max_model_len / block_size, rounded up)
    block_bytes: int

    @property
    def max_header_bytes(self) -> int:
        return HEADER_OVERHEAD + BYTES_PER_BLOCK_ID * self.max_blocks

    @property
    def max_payload_bytes(self) -> int:
        return self.max_blocks * self.block_bytes


# ---------------------------------------------------------------------------- headers
@dataclass(frozen=True)
class LayerHeader:
    transfer: str
    secret: str
    layer: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class DoneHeader:
    transfer: str
    secret: str
    frames: int


@dataclass(frozen=True)
class FailedHeader:
    transfer: str
    secret: str
    reason: str


@dataclass(frozen=True)
class AckHeader:
    transfer: str
    ok: bool
    reason: str


Header = LayerHeader | DoneHeader | FailedHeader


def printable(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """Peer-supplied text made safe for one log line: control and non-ASCII characters escaped,
    bounded in length."""
    return text[:limit].encode("unicode_escape").decode("ascii")[:limit]


def valid_transfer_id(value: object) -> bool:
    return isinstance(value, str) and TRANSFER_ID.fullmatch(value) is not None


def _transfer(obj: dict[str, Any]) -> str:
    value = obj.get("transfer")
    if not valid_transfer_id(value):
        raise WireError(f"header field 'transfer' must be 1 to {MAX_ID_CHARS} characters of [A-Za-z0-9._:@+=/-]")
    assert isinstance(value, str)
    return value


def _text(obj: dict[str, Any], key: str, limit: int) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise WireError(f"header field {key!r} must be a non-empty string of at most {limit} characters")
    return value


def parse_header(kind: int, raw: bytes | bytearray) -> Header:
    """The header of a frame of ``kind``; any deviation from the schema is a ``WireError``."""
    try:
        obj = json.loads(raw)
    except RecursionError:  # a peer's nesting is a bad frame, not a receiver error with a traceback
        raise WireError("header is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("header must be a JSON object")
    transfer = _transfer(obj)
    secret = _text(obj, "secret", MAX_ID_CHARS)
    if kind == KIND_LAYER:
        block_ids = obj.get("block_ids")
        if not isinstance(block_ids, list) or not block_ids or not all(type(b) is int and b >= 0 for b in block_ids):
            raise WireError("header field 'block_ids' must be a non-empty list of block numbers")
        if len(set(block_ids)) != len(block_ids):
            raise WireError("header field 'block_ids' names a block twice")
        return LayerHeader(transfer, secret, _text(obj, "layer", MAX_ID_CHARS), tuple(block_ids))
    if kind == KIND_DONE:
        frames = obj.get("frames")
        if type(frames) is not int or frames < 0:
            raise WireError("header field 'frames' must be a count")
        return DoneHeader(transfer, secret, frames)
    if kind == KIND_FAILED:
        reason = obj.get("reason")
        return FailedHeader(transfer, secret, printable(str(reason)) if reason else "prefill reported a failure")
    raise WireError(f"unknown frame kind {kind}")


def parse_ack(raw: bytes | bytearray) -> AckHeader:
    """An ack frame's header (decode -> prefill); any deviation from the schema is a ``WireError``."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise WireError("ack header is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"ack header is not JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise WireError("ack header must be a JSON object with a boolean 'ok'")
    reason = obj.get("reason")
    return AckHeader(_transfer(obj), obj["ok"], printable(str(reason)) if reason else "")


# ---------------------------------------------------------------------------- encoding
def encode_frame(kind: int, compat: int, header: dict[str, Any], payload: Sequence[bytes | memoryview] = ()) -> list[bytes | memoryview]:
    """The frame's parts, ready for ``sendall`` one after the other (the payload is not copied)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    payload_len = sum(memoryview(p).nbytes for p in payload)
    return [PREAMBLE.pack(MAGIC, WIRE_VERSION, kind, 0, compat, len(head), payload_len), head, *payload]


def encode_ack(compat: int, transfer: str, ok: bool, reason: str = "") -> bytes:
    """One ack frame, whole (it is small enough to go out in one non-blocking send)."""
    header: dict[str, Any] = {"transfer": transfer, "ok": ok}
    if reason:
        header["reason"] = reason[:MAX_REASON_CHARS]
    return b"".join(bytes(p) for p in encode_frame(KIND_ACK, compat, header))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous tensor's memory (no copy)."""
    assert tensor.is_contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------------------- sockets
# A peer host lost without closing its connections (a crash, a partition) is seen within about
# a minute by the kernel's keepalive probes: idle 30 s, then 3 probes 10 s apart.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


def side_channel_socket(sock: socket.socket) -> None:
    """A side-channel connection's options, both ends: no Nagle delay between a frame's parts,
    and keepalive probes, so that a connection to a lost host ends (and what it holds is freed)
    instead of waiting on it forever."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S), ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


# ---------------------------------------------------------------------------- decoding
def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; a peer that closes mid-frame is a ``WireError``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed mid-frame ({got} of {n} bytes)")
        got += k
    return buf


def discard(sock: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    """Read and drop ``n`` bytes (a frame nobody waits for), in bounded pieces."""
    scratch = bytearray(min(n, chunk))
    view = memoryview(scratch)
    while n > 0:
        k = sock.recv_into(view[: min(n, len(scratch))])
        if k == 0:
            raise WireError("connection closed mid-frame")
        n -= k


def read_preamble(sock: socket.socket, kinds: frozenset[int] = TO_DECODE) -> Preamble | None:
    """The next frame's preamble, or None when the peer closed cleanly between frames. ``kinds``:
    the frame kinds this end accepts (an ack travels only from decode to prefill)."""
    first = sock.recv(PREAMBLE.size)
    if not first:
        return None
    raw = bytes(first) + (bytes(recv_exact(sock, PREAMBLE.size - len(first))) if len(first) < PREAMBLE.size else b"")
    magic, version, kind, _flags, compat, header_len, payload_len = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise WireError("not a pd-serve KV frame (bad magic)")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version} is not supported (this engine speaks {WIRE_VERSION})")
    if kind not in KINDS:
        raise WireError(f"unknown frame kind {kind}")
    if kind not in kinds:
        raise WireError(f"a {KINDS[kind]} frame is not accepted in this direction")
    return Preamble(kind=kind, compat=compat, header_len=header_len, payload_len=payload_len)


def check_ack_sizes(pre: Preamble) -> None:
    if pre.header_len > MAX_ACK_HEADER_BYTES or pre.payload_len:
        raise WireError(f"an ack frame of {pre.header_len} + {pre.payload_len} bytes is not an ack")


def check_sizes(pre: Preamble, limits: FrameLimits) -> None:
    """Refuse, before reading further, a frame larger than this engine could ever accept."""
    if pre.header_len > limits.max_header_bytes:
        raise WireError(f"header of {pre.header_len} bytes exceeds the limit of {limits.max_header_bytes}")
    if pre.kind != KIND_LAYER and pre.payload_len:
        raise WireError(f"a {KINDS[pre.kind]} frame carries no payload, got {pre.payload_len} bytes")
    if pre.payload_len > limits.max_payload_bytes:
        raise WireError(f"payload of {pre.payload_len} bytes exceeds the limit of {limits.max_payload_bytes}")
