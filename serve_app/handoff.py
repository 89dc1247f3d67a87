"""What a decode engine's KV callback must say before a prefill engine acts on it.

The callback (the decode connector's metaserver POST) names where the prefill engine is to push
the prompt's KV: an engine id, a host and a port. It lands on the prefill replica chosen for the
attempt, which starts the prefill at once, so that replica checks it against what the router
expects (the decode engine the router chose, as that engine reported its side channel) before
anything is pushed: nothing else that can reach the relay can redirect a push.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from serve_app.protocol import KVEndpoint

# The KV parameters a prefill engine's connector reads (vllm-ascend's MooncakeLayerwiseConnector
# and ours); anything else a callback carried stays with the prefill replica.
PREFILL_KV_KEYS = frozenset(
    {
        "token_ids",
        "request_id",
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_block_size",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "remote_tp_size",
        "remote_pcp_size",
        "remote_dcp_size",
        "remote_cached_tokens",
        "transfer_secret",
    }
)


def kv_ready_mismatch(params: dict[str, Any], endpoint: KVEndpoint | None, checks: Collection[str]) -> str | None:
    """Why a callback does not come from the decode engine it should (None when it does)."""
    if endpoint is None:
        return "the decode engine has not reported its KV endpoint yet"
    engine_id = str(params.get("remote_engine_id", ""))
    if "engine_id" in checks and engine_id != endpoint.engine_id and not engine_id.startswith(endpoint.engine_id + "-"):
        return f"remote_engine_id {engine_id!r} is not {endpoint.engine_id!r}"
    if "host" in checks and params.get("remote_host") != endpoint.host:
        return f"remote_host {params.get('remote_host')!r} is not {endpoint.host!r}"
    if "port" in checks and str(params.get("remote_port")) != str(endpoint.port):
        return f"remote_port {params.get('remote_port')!r} is not {endpoint.port}"
    return None


def prefill_kv_params(params: dict[str, Any]) -> dict[str, Any]:
    """The callback's parameters a prefill engine is given."""
    return {k: v for k, v in params.items() if k in PREFILL_KV_KEYS}
