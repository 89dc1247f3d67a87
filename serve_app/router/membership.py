"""Which engine replicas Serve runs, as this router replica learns it (pure: no Ray).

Ray Serve tells every handle's request router which replicas of a deployment are RUNNING, through
its long-poll from the controller: a replica joins that list once its constructor has returned
and leaves it when Serve stops it (downscale, redeploy, ``serve.delete``), which on Ray Serve 2.60
reaches the routers late, after the replica's own drain has begun: the replica also says so itself
(docs/design.md, "Pools"). pd-serve's request router (``router/replica_router.py``) publishes each list here; the
router's engine pool subscribes and turns the lists into joins and leaves. Each replica describes
itself once, when it starts (``record_replica_metadata``: its role, rank, call endpoint and KV
endpoint), and Serve hands that to every router along with the replica, so a new engine is
callable as soon as the router sees it, without a poll.

Costs: Serve sends a deployment's whole list on each change, to each router replica, so a change
in a pool of N replicas costs each of R router replicas O(N) here (set lookups) and Serve's
controller R messages of N replicas each, O(N x R) in all; between changes nothing is sent.
tests/unit/test_pools.py runs such changes with fakes at 100 replicas per pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.wire.protocol import EngineCallEndpoint, KVEndpoint, Role

logger = logging.getLogger("pd_serve.router")


@dataclass(frozen=True)
class ReplicaInfo:
    """One running engine replica, as its ``record_replica_metadata`` described it."""

    replica_id: str  # Serve's unique id of the replica: what a pinned call names
    role: Role
    name: str  # "<role>-<rank>"
    call_endpoint: EngineCallEndpoint | None = None
    kv_endpoint: KVEndpoint | None = None

    @classmethod
    def from_metadata(cls, replica_id: str, metadata: Mapping[str, Any]) -> ReplicaInfo | None:
        """None for a replica that described nothing (not one of ours, or not started yet)."""
        role = metadata.get("role")
        if role not in ("prefill", "decode"):
            return None
        call = metadata.get("call_endpoint")
        kv = metadata.get("kv_endpoint")
        return cls(
            replica_id=replica_id,
            role=role,
            name=str(metadata.get("name") or f"{role}-{replica_id}"),
            call_endpoint=EngineCallEndpoint(**call) if call else None,
            kv_endpoint=KVEndpoint(**kv) if kv else None,
        )


# Called with a list and its publisher (one of the process's request routers for the deployment).
Listener = Callable[[list[ReplicaInfo], str], None]


class Membership:
    """The latest replica list per (application, deployment) and publisher in this process, and
    who wants them.

    Each of a deployment's handles in the process has its own request router, and each publishes
    the lists Serve sends it, in order; two publishers' lists may reach a listener in any order, so
    listeners are told which publisher sent each (``EnginePool.update``). Serve's request routers
    may run on another thread than the router's event loop (a handle's router loop); a listener is
    always called on the loop it subscribed from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str], dict[str, list[ReplicaInfo]]] = {}
        self._listeners: dict[tuple[str, str], list[tuple[asyncio.AbstractEventLoop | None, Listener]]] = {}

    def publish(self, app: str, deployment: str, replicas: list[ReplicaInfo], publisher: str = "") -> None:
        key = (app, deployment)
        with self._lock:
            self._latest.setdefault(key, {})[publisher] = list(replicas)
            listeners = list(self._listeners.get(key, ()))
        for loop, listener in listeners:
            _call_on(loop, listener, list(replicas), publisher)

    def subscribe(self, app: str, deployment: str, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every list published from now on (and each publisher's latest);
        returns the function that unsubscribes it."""
        key = (app, deployment)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        entry = (loop, listener)
        with self._lock:
            self._listeners.setdefault(key, []).append(entry)
            latest = dict(self._latest.get(key, {}))
        for publisher, replicas in latest.items():
            _call_on(loop, listener, list(replicas), publisher)

        def unsubscribe() -> None:
            with self._lock:
                entries = self._listeners.get(key, [])
                if entry in entries:
                    entries.remove(entry)

        return unsubscribe


def _call_on(loop: asyncio.AbstractEventLoop | None, listener: Listener, replicas: list[ReplicaInfo], publisher: str) -> None:
    def call() -> None:
        try:
            listener(replicas, publisher)
        except Exception:  # one bad listener must not stop the others, nor Serve's router
            logger.exception("replica membership listener failed")

    if loop is None or loop.is_closed():
        call()
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        call()
    else:
        loop.call_soon_threadsafe(call)


# The process's registry: Serve's request routers publish into it, the router's pool reads it.
MEMBERSHIP = Membership()
