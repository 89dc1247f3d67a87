"""Stand-ins and helpers shared by the KV connector's unit tests (no vLLM engine, no Ray)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import torch

from serve_app.kv.consumer import ConsumerWorker
from serve_app.kv.metadata import LayerwiseMetadata, RecvSpec, Settings
from serve_app.kv.wire import (
    KIND_DONE,
    KIND_FAILED,
    KIND_LAYER,
    TO_PREFILL,
    AckHeader,
    KVGeometry,
    encode_frame,
    parse_ack,
    read_preamble,
    recv_exact,
    tensor_bytes,
)
from serve_app.runtime import ports

HOST = "127.0.0.1"
BS = 4  # block size: easy arithmetic
KV_SHAPE = (8, 2, BS, 6)  # per layer: 8 blocks of (k/v, block_size, head dim)
LAYERS = ("l0", "l1")
WAIT_S = 5.0
MAX_MODEL_LEN = 24  # 6 blocks of 4 tokens: a frame names at most 7 blocks


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        host=HOST,
        port=0,
        engine_id="engine-d",
        block_size=BS,
        tp_size=1,
        max_model_len=MAX_MODEL_LEN,
        is_producer=False,
        recv_timeout_s=5.0,
        early_wait_s=1.0,  # a frame without room gives up well inside the tests' waits
    )
    values.update(overrides)
    return Settings(**values)


def free_port() -> int:
    """A port nothing listens on, for a side channel bound a little later."""
    return ports.free_port(HOST)


def fake_request(request_id: str, params: dict | None, prompt: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, num_prompt_tokens=prompt, prompt_token_ids=list(range(prompt)))


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


def patterned_caches(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(KV_SHAPE, generator=g).to(dtype) for name in LAYERS}


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


def compat() -> int:
    return KVGeometry.of(patterned_caches(0), BS).compat


# ---------------------------------------------------------------------------- raw peers
class Peer:
    """One raw TCP connection to a consumer's side channel, sending frames by hand."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=WAIT_S)
        self.reset_while_sending = False

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Send the parts; a consumer that refuses a frame from its header may close the
        connection before the payload is through (what ``closed_by_peer`` then reports)."""
        for part in parts:
            try:
                self.sock.sendall(part)
            except (ConnectionResetError, BrokenPipeError):
                self.reset_while_sending = True
                return

    def layer(
        self, tid: str, secret: str, block_ids: list[int], data: torch.Tensor, layer: str = "l0", compat_hash: int | None = None
    ) -> None:
        header = {"transfer": tid, "secret": secret, "layer": layer, "block_ids": block_ids}
        self.send(encode_frame(KIND_LAYER, compat() if compat_hash is None else compat_hash, header, [tensor_bytes(data.contiguous())]))

    def layers(self, tid: str, secret: str, block_ids: list[int], data: dict[str, torch.Tensor]) -> None:
        for name, tensor in data.items():
            self.layer(tid, secret, block_ids, tensor, layer=name)

    def done(self, tid: str, secret: str, frames: int) -> None:
        self.send(encode_frame(KIND_DONE, compat(), {"transfer": tid, "secret": secret, "frames": frames}))

    def failed(self, tid: str, secret: str, reason: str = "prefill died") -> None:
        self.send(encode_frame(KIND_FAILED, compat(), {"transfer": tid, "secret": secret, "reason": reason}))

    def ack(self, timeout_s: float = WAIT_S) -> AckHeader:
        """The next acknowledgement the consumer sent back on this connection."""
        self.sock.settimeout(timeout_s)
        pre = read_preamble(self.sock, TO_PREFILL)
        assert pre is not None, "the consumer closed the connection"
        return parse_ack(recv_exact(self.sock, pre.header_len))

    def closed_by_peer(self, timeout_s: float = WAIT_S) -> bool:
        """True once the consumer has closed this connection."""
        if self.reset_while_sending:
            return True
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def stays_open(self, timeout_s: float) -> bool:
        """True if the consumer keeps this connection open for ``timeout_s``, whatever it sends
        meanwhile (acks are read and dropped: ``closed_by_peer`` would take an ack's first byte
        for proof of an open connection)."""
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if self.sock.recv(4096) == b"":
                    return False
        except (ConnectionResetError, BrokenPipeError):
            return False
        except TimeoutError:
            pass
        return not self.reset_while_sending

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------- consumer helpers
def arm(
    worker: ConsumerWorker,
    req_id: str,
    tid: str,
    block_ids: list[int],
    num_tokens: int = 8,
    timeout_s: float = 30.0,
    secret: str | None = None,
) -> str:
    """Arm a receive as the scheduler side would; returns its secret."""
    secret = secret or f"secret-of-{tid}"
    worker.on_step(LayerwiseMetadata(recv=[RecvSpec(req_id, tid, secret, block_ids, num_tokens, timeout_s)]))
    return secret


def poll_until(worker: ConsumerWorker, req_id: str, timeout: float = WAIT_S) -> tuple[set[str], set[str]]:
    """Step the worker until req_id is reported finished; returns everything reported so far."""
    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.on_step(LayerwiseMetadata())
        done, bad = worker.results()
        finished |= done
        failed |= bad
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


def port_of(worker: ConsumerWorker) -> int:
    return worker.server.address[1]
