"""Where an engine's KV side channel listens, settled when its replica starts.

The config gives each engine a port (``kv_port_base + 16 i``), but only the replica, once Ray
has placed it, knows its node's address and whether that port is free: an engine left over
from an unclean stop, or anything else on the host, may hold it. On the CPU backend a busy port
is replaced by a free one (the decode engine posts its real port with every KVReady, and the
router checks it against what the engine reports); on Ascend, where Mooncake derives several
ports from it, the start fails with an error naming the port and its holder.
"""

from __future__ import annotations

import copy
import logging
import socket
from typing import Any

from serve_app.runtime.ports import free_port
from serve_app.wire.protocol import KVEndpoint

logger = logging.getLogger("pd_serve.engine")

LOOPBACK = "127.0.0.1"


class KVPortBusy(RuntimeError):
    """The engine's KV port is taken and the backend cannot move it."""


def side_channel_host() -> str:
    """Loopback while the Ray cluster is one node (nothing else needs to reach the port); the
    node's own address, as Ray reports it, once engines may sit on other nodes."""
    import ray

    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
    except Exception:  # not connected to Ray (unit tests): one host
        return LOOPBACK
    if len(alive) <= 1:
        return LOOPBACK
    return ray.util.get_node_ip_address()


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str:
    """Who listens on ``port`` on this host, as 'pid N (name)', for the operator's message."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return "a process of another user"
                try:
                    name = psutil.Process(conn.pid).name()
                except psutil.Error:
                    name = "?"
                return f"pid {conn.pid} ({name})"
    except Exception:  # psutil may lack the rights to see every socket
        pass
    return "an unknown process"


def settle_kv_endpoint(
    engine_kwargs: dict[str, Any], *, listens: bool, fallback: bool, pass_host: bool = True
) -> tuple[dict[str, Any], KVEndpoint | None]:
    """The engine arguments with the side channel's host and port fixed, and the endpoint a
    KVReady from this engine must name (None when the engine loads no KV connector)."""
    ktc = engine_kwargs.get("kv_transfer_config")
    if not ktc:
        return engine_kwargs, None
    kwargs = copy.deepcopy(engine_kwargs)
    ktc = kwargs["kv_transfer_config"]
    host = side_channel_host()
    port = int(ktc["kv_port"])
    if listens and not port_is_free(host, port):
        holder = port_holder(port)
        if not fallback:
            raise KVPortBusy(f"KV port {port} on {host} is in use by {holder}; stop it or change kv_port_base")
        new_port = free_port(host)
        logger.warning("KV port %d on %s is in use by %s; this engine uses port %d instead", port, host, holder, new_port)
        port = new_port
    ktc["kv_port"] = port
    if pass_host:  # only a connector that reads it gets it (Mooncake finds its own address)
        ktc.setdefault("kv_connector_extra_config", {})["kv_host"] = host
    return kwargs, KVEndpoint(engine_id=str(ktc.get("engine_id", "")), host=host, port=port)
