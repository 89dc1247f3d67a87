"""The bytes of a router-engine call over HTTP (``router.engine_transport: http``).

A call's request body is one msgpack-encoded ``EngineRequest``; a stream's response body is a
sequence of frames, each a 4-byte big-endian length and a msgpack array ``[kind, payload]``:
``kv`` (``KVReady``), ``delta`` (``TokenDelta``), ``rejected`` (``EngineRejected``), ``result``
(``PrefillResult``) or ``error`` (a message: the engine's call raised). msgpack and typed
decoding (msgspec), never pickle: a body is decoded into these plain types and nothing else, so
even a peer holding the endpoint's token cannot make a replica run code.

Framing lives here once (``FrameReader``): a network read may hold part of a frame or several.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from serve_app.wire.protocol import EngineEvent, EngineRejected, EngineRequest, KVReady, PrefillResult, TokenDelta

LENGTH_BYTES = 4
# A frame longer than this is not one of ours (a delta of a few hundred tokens with logprobs is
# tens of kB): the stream is broken, not a request to buffer it.
MAX_FRAME_BYTES = 64 << 20
CONTENT_TYPE = "application/x-pd-serve-frames"
# The engine call endpoint's two paths: a streamed call (prefill or decode) and a unary one.
GENERATE_PATH = "/generate"
RUN_PATH = "/run"

_KINDS: dict[type, str] = {KVReady: "kv", TokenDelta: "delta", EngineRejected: "rejected", PrefillResult: "result"}
_DECODERS: dict[str, msgspec.msgpack.Decoder] = {kind: msgspec.msgpack.Decoder(cls) for cls, kind in _KINDS.items()}
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_REQUEST = msgspec.msgpack.Decoder(EngineRequest)
_ENCODER = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """Bytes that are not a valid message of this protocol."""


@dataclass(frozen=True)
class CallError:
    """The engine replica's call raised: its message, for the router's failure."""

    message: str


Message = EngineEvent | PrefillResult | CallError


def encode_request(request: EngineRequest) -> bytes:
    return _ENCODER.encode(request)


def decode_request(body: bytes) -> EngineRequest:
    try:
        return _REQUEST.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"not an engine request: {exc}") from None


def encode_frame(message: Message) -> bytes:
    if isinstance(message, CallError):
        payload = _ENCODER.encode(("error", message.message))
    else:
        payload = _ENCODER.encode((_KINDS[type(message)], message))
    return len(payload).to_bytes(LENGTH_BYTES, "big") + payload


def decode_message(payload: bytes) -> Message:
    try:
        kind, body = _ENVELOPE.decode(payload)
        if kind == "error":
            return CallError(str(msgspec.msgpack.decode(body)))
        decoder = _DECODERS.get(kind)
        if decoder is None:
            raise WireError(f"unknown message kind {kind!r}")
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a message: {exc}") from None


class FrameReader:
    """Whole frames out of reads of any size."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buffer += data
        messages: list[Message] = []
        start = 0
        while len(self._buffer) - start >= LENGTH_BYTES:
            length = int.from_bytes(self._buffer[start : start + LENGTH_BYTES], "big")
            if length > MAX_FRAME_BYTES:
                raise WireError(f"frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
            end = start + LENGTH_BYTES + length
            if len(self._buffer) < end:
                break
            messages.append(decode_message(bytes(self._buffer[start + LENGTH_BYTES : end])))
            start = end
        del self._buffer[:start]
        return messages

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet complete (non-zero at the end of a body: it was cut)."""
        return len(self._buffer)
