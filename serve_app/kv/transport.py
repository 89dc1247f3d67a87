"""The wire between a prefill worker and a decode worker: length-prefixed frames over TCP.

A frame is a JSON header and an optional raw tensor payload::

    u32 header length | header (UTF-8 JSON) | u64 payload length | payload bytes

All frames of one transfer travel over one connection, in order, so a ``done`` frame arrives after
every layer frame before it. The receiver only parses and queues frames; writing them into the KV
cache is the decode worker's job, on its own thread, at a step boundary (see
``layerwise_connector``), so a late frame can never touch blocks the scheduler has handed to
another request.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("pd_serve.kv")

_HEADER_LEN = struct.Struct("!I")
_PAYLOAD_LEN = struct.Struct("!Q")
SEND_TIMEOUT_S = 10.0


@dataclass
class Frame:
    header: dict[str, Any]
    tensor: torch.Tensor | None = None
    received_at: float = 0.0


def encode(header: dict[str, Any], tensor: torch.Tensor | None = None) -> list[bytes | memoryview]:
    if tensor is not None:
        tensor = tensor.contiguous()
        header = {**header, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        # A flat byte view of the tensor's memory: len() is its size in bytes, no copy made.
        payload: bytes | memoryview = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""
    else:
        payload = b""
    head = json.dumps(header, separators=(",", ":")).encode()
    return [_HEADER_LEN.pack(len(head)), head, _PAYLOAD_LEN.pack(len(payload)), payload]


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


def read_frame(sock: socket.socket) -> Frame | None:
    """The next frame, or None when the peer closed the connection."""
    raw = _recv_exact(sock, _HEADER_LEN.size)
    if raw is None:
        return None
    head = _recv_exact(sock, _HEADER_LEN.unpack(raw)[0])
    raw_len = _recv_exact(sock, _PAYLOAD_LEN.size)
    if head is None or raw_len is None:
        return None
    header = json.loads(head)
    n = _PAYLOAD_LEN.unpack(raw_len)[0]
    tensor = None
    if "dtype" in header:
        payload = _recv_exact(sock, n) if n else bytearray()
        if payload is None:
            return None
        dtype = getattr(torch, header["dtype"])
        tensor = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(header["shape"]) if n else torch.empty(
            header["shape"], dtype=dtype
        )
    return Frame(header=header, tensor=tensor, received_at=time.time())


class FrameServer:
    """Accepts connections on a loopback port; every frame read goes to ``inbox``."""

    def __init__(self, host: str, port: int) -> None:
        self.inbox: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.address = self._sock.getsockname()
        self._closed = False
        threading.Thread(target=self._accept, name="kv-recv-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    frame = read_frame(conn)
                except (OSError, ValueError) as exc:
                    logger.warning("kv receiver: connection failed: %r", exc)
                    return
                if frame is None:
                    return
                self.inbox.put(frame)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class FrameSender:
    """One connection per destination, opened on first use and reopened once after a failure."""

    def __init__(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}

    def send(self, host: str, port: int, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        """Send one frame; raises OSError when the destination cannot be reached."""
        parts = encode(header, tensor)
        key = (host, port)
        for attempt in range(2):
            conn = self._conns.get(key)
            try:
                if conn is None:
                    conn = socket.create_connection(key, timeout=self.timeout_s)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._conns[key] = conn
                for part in parts:
                    conn.sendall(part)
                return
            except OSError:
                self._drop(key)
                if attempt == 1:
                    raise

    def _drop(self, key: tuple[str, int]) -> None:
        conn = self._conns.pop(key, None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        for key in list(self._conns):
            self._drop(key)
