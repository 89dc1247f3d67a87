"""The KV side channel's bounds a user may set in ``kv_connector_extra_config``: their names (as
in ``kv.metadata.Settings``, whose defaults they override) and types. In the layer below both the
connector and the app's config, so the config checks them when it loads, without importing vLLM
or the connector."""

from __future__ import annotations

# The connection bounds' defaults (kv.metadata.Settings has the others): the app's config weighs
# the prefill pool against them without importing the connector.
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_MAX_CONNECTIONS_PER_PEER = 16

EXTRA_LIMITS: dict[str, type] = {
    "max_connections": int,
    "max_connections_per_peer": int,
    "max_pending_connections": int,
    "max_pending_per_peer": int,
    "handshake_timeout_s": float,
    "max_early_transfers": int,
    "max_early_bytes": int,
    "max_early_transfers_per_connection": int,
    "max_early_bytes_per_connection": int,
    "early_wait_s": float,
    "early_ttl_s": float,
    "ack_timeout_s": float,
}


def limit_problem(name: str, value: object) -> str | None:
    """Why ``value`` cannot be the bound ``name`` (None: it can). Every bound is a positive number:
    a zero or negative one refuses every transfer or closes every connection at once."""
    kind = EXTRA_LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        return f"{name} must be a {'whole ' if kind is int else ''}number, not {value!r}"
    if not value > 0 or value != value or value == float("inf"):
        return f"{name} must be above 0 and finite, not {value!r}"
    return None
