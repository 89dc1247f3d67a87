"""Ports chosen now for a server that binds them later.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, where it can become
the local end of an outgoing connection (Ray's processes open many) before the server binds it,
which then fails with "Address already in use", and a replica's start with it. Ray's workers
bind ports from 10002-19999 (its default ``min_worker_port`` and ``max_worker_port``) as they
start. So such ports come from between the two. The integration tests, the serving benchmark and
an engine whose configured KV port is taken all pick here.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

FIRST_PORT = 20000  # above Ray's worker ports
LAST_PORT = 65535
LINUX_EPHEMERAL_PORTS = (32768, 60999)  # the kernel's default, where /proc does not say
ENOUGH_PORTS = 1000  # the integration tests hand out blocks of 64


def ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_PORTS


def late_bound_ports() -> range:
    """Ports above Ray's worker ports and below the ephemeral range; on a host whose ephemeral
    range starts too low for that, the ports above it; where it leaves neither, every port
    above Ray's (best effort: then nothing is safe from an outgoing connection)."""
    low, high = ephemeral_port_range()
    if low - FIRST_PORT >= ENOUGH_PORTS:
        return range(FIRST_PORT, low)
    above = range(max(FIRST_PORT, high + 1), LAST_PORT + 1)
    if len(above) >= ENOUGH_PORTS:
        return above
    return range(FIRST_PORT, LAST_PORT + 1)


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port of ``late_bound_ports`` that is free on ``host`` now (picked at random, so that
    processes picking at the same time rarely collide)."""
    ports = late_bound_ports()
    for _ in range(tries):
        port = random.choice(ports)
        if bindable(host, port):
            return port
    raise RuntimeError(f"no free port found in {ports.start}-{ports.stop - 1} on {host}")
