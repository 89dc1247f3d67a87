"""Plain values of the layerwise push connector: its settings, what the scheduler side tells the
workers each step, and the per-transfer records the workers report back (as vLLM connector stats).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from serve_app.wire.kv_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_PEER, EXTRA_LIMITS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Defaults of the kv_connector_extra_config keys this connector reads.
DEFAULT_RECV_TIMEOUT_S = 60.0
DEFAULT_MAX_PENDING_CONNECTIONS = 32
DEFAULT_MAX_PENDING_PER_PEER = 16
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_EARLY_TRANSFERS = 64
DEFAULT_MAX_EARLY_BYTES = 64 << 20
DEFAULT_MAX_EARLY_TRANSFERS_PER_CONNECTION = 16
DEFAULT_MAX_EARLY_BYTES_PER_CONNECTION = 16 << 20
DEFAULT_EARLY_WAIT_S = 5.0
DEFAULT_EARLY_TTL_S = 10.0
DEFAULT_ACK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Settings:
    """Read once from the engine's ``kv_transfer_config``; both roles and processes share them."""

    host: str  # the address this engine's side channel is reached at (decode) / sends from
    port: int
    engine_id: str
    block_size: int
    tp_size: int
    max_model_len: int
    is_producer: bool
    recv_timeout_s: float = DEFAULT_RECV_TIMEOUT_S
    # Decode's receiver (consumer.py): connections that authenticated (sent a frame with a
    # transfer's secret), in all and from one address.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    # Connections that have not authenticated yet: their own pool, the oldest evicted for a newcomer.
    max_pending_connections: int = DEFAULT_MAX_PENDING_CONNECTIONS
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER
    # A connection's first frame header must be in within this, or it is closed.
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    max_early_transfers: int = DEFAULT_MAX_EARLY_TRANSFERS
    max_early_bytes: int = DEFAULT_MAX_EARLY_BYTES
    max_early_transfers_per_connection: int = DEFAULT_MAX_EARLY_TRANSFERS_PER_CONNECTION
    max_early_bytes_per_connection: int = DEFAULT_MAX_EARLY_BYTES_PER_CONNECTION
    # How long a frame of a transfer not armed yet waits for its arming or for room in the table,
    # and how long the frames of a transfer that is never armed are kept there.
    early_wait_s: float = DEFAULT_EARLY_WAIT_S
    early_ttl_s: float = DEFAULT_EARLY_TTL_S
    # Prefill's sender (producer.py): how long a done frame waits for decode's ack.
    ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S

    @property
    def max_blocks(self) -> int:
        """Blocks one request can own: what any single frame may name at most."""
        return -(-self.max_model_len // self.block_size) + 1

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> Settings:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        extra = ktc.kv_connector_extra_config or {}
        return cls(
            host=str(extra.get("kv_host") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"),
            port=int(ktc.kv_port),
            engine_id=str(ktc.engine_id),
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            max_model_len=int(vllm_config.model_config.max_model_len),
            is_producer=bool(ktc.is_kv_producer),
            recv_timeout_s=float(extra.get("recv_timeout_s", DEFAULT_RECV_TIMEOUT_S)),
            **{name: kind(extra[name]) for name, kind in EXTRA_LIMITS.items() if name in extra},
        )




@dataclass
class RecvSpec:
    """Decode: a request whose KV is coming. Frames may write ``block_ids`` only (the request's
    own, freshly allocated blocks; never its prefix-cached ones) and only while it waits."""

    req_id: str
    transfer_id: str
    secret: str
    block_ids: list[int]
    num_tokens: int
    timeout_s: float
    # Set when the scheduler side refused the transfer (e.g. its id is already armed): the worker
    # fails it at once instead of waiting for frames.
    rejected: str | None = None


@dataclass
class SendSpec:
    """Prefill: what to push during this step's forward, for one request."""

    req_id: str
    transfer_id: str
    secret: str
    host: str
    port: int
    local_block_ids: list[int]
    remote_block_ids: list[int]
    num_tokens: int
    last_chunk: bool
    error: str | None = None


@dataclass
class LayerwiseMetadata(KVConnectorMetadata):
    recv: list[RecvSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    # Requests finished (or aborted) since the last step: the decode worker forgets them before
    # writing anything, since the scheduler may already have handed their blocks to others.
    finished: list[str] = field(default_factory=list)
    # Decode: the loopback port of the engine core's doorbell (kv/wakeup.py), rung by the worker
    # when a transfer can be settled; None where there is none.
    wake_port: int | None = None
    # The doorbell's per-engine random token: a datagram without it wakes nothing.
    wake_token: str | None = None


@dataclass
class LayerwiseStats(KVConnectorStats):
    """Per-transfer records, keyed by transfer (attempt) id, and the side channel's cumulative
    counters, shipped worker -> scheduler -> frontend, where the engine wrapper's stat logger
    collects them."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data.get("transfers", {}))
        merged.update(other.data.get("transfers", {}))
        counters = {**self.data.get("counters", {}), **other.data.get("counters", {})}  # cumulative: latest wins
        self.data = {"transfers": merged, **({"counters": counters} if counters else {})}
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"transfers": len(self.data.get("transfers", {})), **self.data.get("counters", {})}

    def is_empty(self) -> bool:
        return not self.data.get("transfers") and not self.data.get("counters")


def new_record(role: str) -> dict[str, Any]:
    if role == "prefill":
        return {"role": "prefill", "layers_pushed": 0, "tokens_pushed": 0, "bytes_pushed": 0, "push_times": []}
    return {"role": "decode"}
