"""The router's engines: who they are, its own load counters on them, and their health.

Engines are *members*. Under Serve, each role is one deployment and its replicas join and leave
as Serve starts and stops them (``join``/``leave``, fed by router/membership.py); a member is
called through the role's handle with the replica's id pinned (router/replica_router.py), or over
its own HTTP endpoint. A replica that joins is chosen at once: Serve lists it only once its
constructor has returned (its engine is up). Outside Serve (the in-process tests) members are given at construction,
one handle each.

Counters are changed only through ``lease`` (a context manager), so every path out of an attempt
(success, error, retry, timeout, client disconnect) gives back exactly what it took. A member
that leaves while leases are held is *draining*: chosen for nothing new, forgotten when its last
lease ends; the attempts streaming from a draining decode engine are told to move
(``watch``), and resume elsewhere through the recompute path.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from serve_app.router.balancer import EngineLoad, ScoreFn, candidates, decode_score, prefill_score, select
from serve_app.router.engine_client import EngineClient
from serve_app.router.leak_audit import LeakAudit
from serve_app.router.membership import ReplicaInfo
from serve_app.router.prefix_index import PrefixIndex, RecentWork, chain_keys, choose, engine_salt
from serve_app.wire.protocol import EngineCallEndpoint, EngineRequest, EngineStats, KVEndpoint, Role

logger = logging.getLogger("pd_serve.router")

SCORES: dict[Role, ScoreFn] = {"decode": decode_score, "prefill": prefill_score}
# How long work sent to an engine counts in cache-aware routing's bound (halving each time).
WORK_HALF_LIFE_S = 10.0
MAX_GONE_REPLICAS = 4096  # replica ids remembered as gone (EnginePool._gone)
# An engine whose calls fail is chosen for nothing for CALL_BACKOFF_S, doubled for each failure
# in a row up to CALL_BACKOFF_MAX_S; failures further apart than CALL_FAILURES_FORGOTTEN_S are
# not in a row.
CALL_BACKOFF_S = 1.0
CALL_BACKOFF_MAX_S = 30.0
CALL_FAILURES_FORGOTTEN_S = 60.0


def _outside_request(remote: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``remote(*args, **kwargs)`` (a handle call) as if made outside any Serve request. A call
    made while this replica serves a handle request (the handle API, ``engine_snapshot``) takes
    that request's context with it, and pinned calls made so to an engine pool do not answer
    (Ray Serve 2.60; unpinned calls to single-replica deployments do): the engine call is its
    own request, not part of the client's."""
    return contextvars.Context().run(remote, *args, **kwargs)


@dataclass
class Member:
    """One engine: how to call it, and who to tell when it leaves."""

    name: str
    role: Role
    handle: Any  # unary calls
    stream_handle: Any  # streaming calls
    stats_handle: Any = None  # stats polls (default: ``handle``)
    replica_id: str | None = None  # Serve's replica id, pinned on every handle call; None: the handle is the engine's own
    call_endpoint: EngineCallEndpoint | None = None  # from its metadata (Serve), else from its stats
    kv_endpoint: KVEndpoint | None = None
    watchers: set[Callable[[], None]] = field(default_factory=set)

    @property
    def pin(self) -> dict[str, str]:
        return {"replica": self.replica_id} if self.replica_id is not None else {}


@dataclass
class PrefixRouting:
    """``router.balancer: prefix``: where each prompt prefix is expected to be cached."""

    block_tokens: int
    max_imbalance: float
    index: PrefixIndex = field(default_factory=PrefixIndex)
    recent: RecentWork = field(default_factory=lambda: RecentWork(WORK_HALF_LIFE_S))


class EnginePool:
    def __init__(
        self,
        engines: dict[str, tuple[Role, Any]],
        stats_timeout_s: float = 2.0,
        audit: LeakAudit | None = None,
        client: EngineClient | None = None,
        prefix: PrefixRouting | None = None,
        pick_at_random: bool = False,
    ) -> None:
        self.members: dict[str, Member] = {}
        self.loads: dict[str, EngineLoad] = {}
        for name, (role, handle) in engines.items():
            self._add(Member(name=name, role=role, handle=handle, stream_handle=handle.options(stream=True)))
        self.stats_timeout_s = stats_timeout_s
        self._full_poll: asyncio.Future | None = None  # the poll of every engine under way: callers share it
        self.reported: dict[str, EngineStats] = {}
        self.audit = audit
        # Ties rotate per role: one counter for both would be stepped twice per attempt (decode,
        # then prefill), so with two tied decode engines every attempt would get the same one.
        self._turn: dict[Role, itertools.count] = {"decode": itertools.count(), "prefill": itertools.count()}
        # router.engine_transport: http; calls then go to an engine's own endpoint once known,
        # through its Serve handle before.
        self.client = client
        # Serve replica id -> (member name, role), for as long as Serve lists the replica: a
        # member that said "moved" may be forgotten before Serve's list drops its replica.
        self._by_replica: dict[str, tuple[str, Role]] = {}
        # Replicas that left Serve's list, newest last: a list published late (by another of the
        # pool handle's request routers) never brings one back. Serve never reuses a replica id.
        self._gone: OrderedDict[str, None] = OrderedDict()
        # (role, publisher) -> the replica ids of its last list: a replica leaves when a publisher
        # that listed it lists it no more, not when one that has not heard of it yet omits it.
        self._listed: dict[tuple[Role, str], set[str]] = {}
        self._pool_handles: dict[Role, tuple[Any, Any]] = {}
        self.on_joined: Callable[[str], None] | None = None
        self.on_drained: Callable[[Role], None] | None = None  # a role's choosable engines changed
        self.prefix = prefix
        self.pick_at_random = pick_at_random  # router.balancer: random (a benchmark's baseline)
        # Told of each choice made by prefix: (role, engine, prompt tokens it is expected to hold).
        self.on_prefix_choice: Callable[[Role, str, int], None] | None = None

    # ------------------------------------------------------------------ membership
    def attach(self, role: Role, handle: Any, stats_handle: Any = None) -> None:
        """The deployment handle of ``role``'s pool (its replicas join through ``update``), and
        the one its stats polls go through (default: the same). Serve's gRPC transport carries
        the engine calls well, but a pinned unary poll through it does not answer inside the
        router replica (Ray Serve 2.60): polls then take Serve's default transport."""
        self._pool_handles[role] = (handle, handle.options(stream=True), stats_handle if stats_handle is not None else handle)

    def update(self, role: Role, running: list[ReplicaInfo], publisher: str = "") -> None:
        """Serve's latest list of ``role``'s running replicas, as ``publisher`` (one of the
        process's request routers for the pool's deployment) has it: members join and leave.
        Each publisher's lists come in order, but two publishers' may cross: a replica leaves
        when a publisher that listed it lists it no more (a publisher that never listed it may
        only be behind), and one that left is never brought back by a list published late."""
        listed = {r.replica_id for r in running if r.role == role}
        before = self._listed.get((role, publisher), set())
        self._listed[(role, publisher)] = listed
        for replica_id in before - listed:
            self.leave(replica_id)
        for info in running:
            if info.role == role and info.replica_id not in self._by_replica and info.replica_id not in self._gone:
                self.join(info)

    def join(self, info: ReplicaInfo) -> str:
        handle, stream_handle, stats_handle = self._pool_handles[info.role]
        name = info.name if info.name not in self.members else f"{info.name}.{info.replica_id[:8]}"
        member = Member(
            name=name,
            role=info.role,
            handle=handle,
            stream_handle=stream_handle,
            stats_handle=stats_handle,
            replica_id=info.replica_id,
            call_endpoint=info.call_endpoint,
            kv_endpoint=info.kv_endpoint,
        )
        self._add(member)
        # Serve lists a replica once its constructor has returned: its engine is up and its
        # endpoints are in its metadata, so it takes work now; its first stats poll follows.
        self.loads[name].healthy = True
        self._by_replica[info.replica_id] = (name, info.role)
        logger.info("engine %s (%s replica %s) joined", name, info.role, info.replica_id)
        if self.on_joined is not None:
            self.on_joined(name)
        return name

    def leave(self, replica_id: str) -> None:
        """Serve is stopping this replica: choose it for nothing new, move its decode streams."""
        name, _ = self._by_replica.pop(replica_id, (None, None))
        self._gone[replica_id] = None
        while len(self._gone) > MAX_GONE_REPLICAS:
            self._gone.popitem(last=False)
        member = self.members.get(name) if name is not None else None
        if member is not None and member.replica_id == replica_id:  # not a later engine of that name
            self.drain(name)

    def drain(self, name: str) -> None:
        """The engine ``name`` is leaving: it takes nothing new; attempts streaming from it are
        told (``watch``); it is forgotten once this router holds nothing on it."""
        load = self.loads.get(name)
        if load is None or load.draining:
            return
        load.healthy = False
        load.draining = True
        member = self.members[name]
        logger.info("engine %s (%s) is leaving: %d requests of this router on it", name, member.role, load.inflight)
        for watcher in list(member.watchers):
            watcher()
        if load.inflight == 0:
            self._forget(name)
        if self.on_drained is not None:
            self.on_drained(member.role)

    def _add(self, member: Member) -> None:
        self.members[member.name] = member
        self.loads[member.name] = EngineLoad(name=member.name, role=member.role)

    def _forget(self, name: str) -> None:
        self.members.pop(name, None)
        self.loads.pop(name, None)
        self.reported.pop(name, None)
        if self.audit is not None:
            self.audit.forget(name)
        if self.prefix is not None:
            self.prefix.index.forget(name)
            self.prefix.recent.forget(name)

    @contextmanager
    def watch(self, name: str, on_leave: Callable[[], None]) -> Iterator[None]:
        """Call ``on_leave`` if the engine leaves while the block runs (an engine no longer a
        member has left already: nothing to watch)."""
        member = self.members.get(name)
        if member is None:
            yield
            return
        member.watchers.add(on_leave)
        try:
            yield
        finally:
            member.watchers.discard(on_leave)

    def draining(self, name: str) -> bool:
        load = self.loads.get(name)
        return load is None or load.draining

    # ------------------------------------------------------------------ calls
    def open_stream(self, name: str, request: EngineRequest) -> Any:
        """Start a decode attempt's stream: ``__anext__`` for its events, ``cancel`` to end it."""
        endpoint = self._call_endpoint(name)
        if self.client is not None and endpoint is not None:
            return self.client.stream(endpoint, request)
        member = self.members[name]
        return _outside_request(member.stream_handle.generate.remote, request, **member.pin)

    def start_prefill(self, name: str, request: EngineRequest) -> Any:
        """Start a prefill call: await it for its ``PrefillResult``, ``cancel`` to abort it."""
        endpoint = self._call_endpoint(name)
        if self.client is not None and endpoint is not None:
            return self.client.call(endpoint, request)
        member = self.members[name]
        return _outside_request(member.handle.run.remote, request, **member.pin)

    def _call_endpoint(self, name: str) -> EngineCallEndpoint | None:
        reported = self.reported.get(name)
        if reported is not None and reported.call_endpoint is not None:
            return reported.call_endpoint
        return self.members[name].call_endpoint

    def of_role(self, role: Role) -> list[EngineLoad]:
        return [load for load in self.loads.values() if load.role == role]

    def choosable(self, role: Role) -> int:
        """``role``'s engines that may be chosen for new work (joined, not leaving)."""
        return sum(1 for load in self.of_role(role) if not load.draining)

    def has_healthy(self, role: Role) -> bool:
        return any(load.healthy for load in self.of_role(role))

    def prefix_keys(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The prompt's block keys for ``pick`` (none when routing by load alone)."""
        if self.prefix is None:
            return []
        return chain_keys(token_ids, self.prefix.block_tokens, cache_salt=cache_salt)

    def pick(
        self, role: Role, avoid: frozenset[str] = frozenset(), prefix_keys: list[int] | None = None, request_load: int = 0
    ) -> EngineLoad | None:
        """An engine of ``role``: by load alone, or (``prefix_keys`` given, router.balancer:
        prefix) the one expected to hold the longest prefix within the imbalance bound, which
        then holds it. ``request_load``: what the request adds to the role's load score."""
        if not self.pick_at_random and (self.prefix is None or not prefix_keys):
            return select(self.of_role(role), SCORES[role], turn=next(self._turn[role]), avoid=avoid)
        preferred = candidates(self.of_role(role), avoid)
        if not preferred:
            return None
        if self.prefix is None or not prefix_keys:
            return random.choice(preferred)
        score = SCORES[role]
        recent = self.prefix.recent
        factor = recent.factor(time.monotonic())
        name, blocks = choose(
            self.prefix.index,
            prefix_keys,
            [(load.name, score(load), recent.scaled(load.name)) for load in preferred],
            max_imbalance=self.prefix.max_imbalance,
            request_load=request_load,
            request_work=request_load * factor,
            salt=self._salt,
        )
        recent.add(name, request_load, factor)
        self.prefix.index.record(name, prefix_keys)
        if self.on_prefix_choice is not None and blocks:
            self.on_prefix_choice(role, name, blocks * self.prefix.block_tokens)
        return self.loads[name]

    def _salt(self, name: str) -> int:
        """An engine's rendezvous salt, from its Serve replica id where it has one: router
        replicas name one engine differently (``decode-0`` in one, ``decode-0.<id>`` in another
        that still holds an earlier engine of that name, or two live engines of one name after
        Serve renumbered ranks), and must still send a new prefix to the same engine."""
        member = self.members.get(name)
        return engine_salt(member.replica_id if member is not None and member.replica_id else name)

    @contextmanager
    def lease(self, name: str, tokens: int) -> Iterator[EngineLoad]:
        load = self.loads[name]
        load.reserved_tokens += tokens
        load.inflight += 1
        try:
            yield load
        finally:
            load.reserved_tokens -= tokens
            load.inflight -= 1
            if load.draining and load.inflight == 0 and self.loads.get(name) is load:
                self._forget(name)

    def kv_endpoint(self, name: str) -> KVEndpoint | None:
        """Where the engine said its KV side channel is."""
        reported = self.reported.get(name)
        if reported is not None and reported.kv_endpoint is not None:
            return reported.kv_endpoint
        member = self.members.get(name)
        return member.kv_endpoint if member is not None else None

    def mark_unhealthy(self, name: str) -> None:
        """Stop choosing an engine whose call just failed (unreachable) for a while: 1 s, twice
        that for each failure in a row, at most ``CALL_BACKOFF_MAX_S``. Its stats answering
        again is not enough: they come through Serve, its calls through its own endpoint, and
        an endpoint other routers cannot reach (a loopback one, a firewalled port) answers no
        call while its stats do."""
        load = self.loads.get(name)
        if load is None:
            return
        now = time.monotonic()
        load.healthy = False
        if now < load.call_backoff_until:
            # Calls that were under way when it became unreachable (a stream each): one event,
            # not failures in a row.
            return
        if now - load.last_call_failure > CALL_FAILURES_FORGOTTEN_S:  # (or a call went through since)
            load.call_failures = 0
        load.call_failures += 1
        load.last_call_failure = now
        load.call_backoff_until = now + min(CALL_BACKOFF_S * 2 ** (load.call_failures - 1), CALL_BACKOFF_MAX_S)
        load.healthy = False

    def call_succeeded(self, name: str) -> None:
        """A call to the engine went through: its earlier failures are not in a row with a
        later one."""
        load = self.loads.get(name)
        if load is not None:
            load.call_failures = 0

    # ------------------------------------------------------------------ stats
    async def refresh(self, names: list[str] | None = None) -> None:
        """Poll the engines ``names`` (None: every engine) for their stats. One poll of every
        engine at a time: the background poller and each attempt waiting for an engine share it,
        so waiting requests do not multiply the polls on engines that are already slow."""
        if names is not None:
            return await self._poll(names)
        if self._full_poll is None:
            self._full_poll = asyncio.ensure_future(self._poll([name for name, load in self.loads.items() if not load.draining]))
            self._full_poll.add_done_callback(self._full_poll_done)
        await asyncio.shield(self._full_poll)

    def _full_poll_done(self, poll: asyncio.Future) -> None:
        if self._full_poll is poll:
            self._full_poll = None
        if not poll.cancelled():
            poll.exception()  # retrieved here too: its callers may all have gone

    async def _poll(self, names: list[str]) -> None:
        members = {name: self.members.get(name) for name in names}
        results = await asyncio.gather(*(self._stats(name) for name in names), return_exceptions=True)
        for name, result in zip(names, results):
            load = self.loads.get(name)
            # Left while its stats were on the way, or another engine now has its name: the
            # answer is not that engine's.
            if load is None or load.draining or self.members.get(name) is not members[name]:
                continue
            if isinstance(result, BaseException):
                if load.healthy:
                    logger.warning("engine %s unreachable: %r", name, result)
                load.healthy = False
                continue
            self.reported[name] = result
            if self.prefix is not None:
                self.prefix.index.set_epoch(name, result.epoch)
                self.prefix.index.set_capacity(name, result.kv_capacity_tokens // self.prefix.block_tokens)
            load.healthy = result.healthy and time.monotonic() >= load.call_backoff_until
            load.kv_used_tokens = result.kv_used_tokens
            load.kv_capacity_tokens = result.kv_capacity_tokens
            load.num_waiting = result.num_waiting
            load.queued_prompt_tokens = result.queued_prompt_tokens
            if self.audit is not None:
                self.audit.check(name, load.inflight, result)

    async def _stats(self, name: str) -> EngineStats:
        member = self.members[name]
        handle = member.stats_handle if member.stats_handle is not None else member.handle
        return await asyncio.wait_for(_outside_request(handle.stats.remote, **member.pin), self.stats_timeout_s)

    async def discover(self) -> None:
        """Make each pool's handle start its request router (Serve starts it at the first call),
        which then sends its replica list: one call that names no replica."""
        for role, (_, _, handle) in self._pool_handles.items():
            if not any(load.role == role for load in self.loads.values()):
                try:
                    await asyncio.wait_for(_outside_request(handle.stats.remote), self.stats_timeout_s)
                except Exception as exc:  # no replica yet (starting): the next round asks again
                    logger.debug("discovery call to the %s pool: %r", role, exc)

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.discover()
                await self.refresh()
            except Exception:  # never let the poller die; the next round tries again
                logger.exception("engine stats poll failed")
            await asyncio.sleep(interval_s)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The router's counters and each engine's last report, for tests and operators."""
        out: dict[str, dict[str, Any]] = {}
        for name, load in self.loads.items():
            reported = self.reported.get(name)
            member = self.members[name]
            kv_endpoint = self.kv_endpoint(name)
            call_endpoint = self._call_endpoint(name)
            out[name] = {
                "role": load.role,
                "healthy": load.healthy,
                "draining": load.draining,
                "replica": member.replica_id,
                "router_inflight": load.inflight,
                "router_reserved_tokens": load.reserved_tokens,
                "engine_inflight": reported.inflight if reported else None,
                "engine_running": reported.num_running if reported else None,
                "engine_waiting": reported.num_waiting if reported else None,
                "kv_usage": reported.kv_usage if reported else None,
                "kv_capacity_tokens": reported.kv_capacity_tokens if reported else None,
                "kv_endpoint": dataclasses.asdict(kv_endpoint) if kv_endpoint else None,
                # Its URL only: the token stays between the engine and the routers.
                "call_endpoint": call_endpoint.url if call_endpoint else None,
                "prompt_tokens_total": reported.prompt_tokens_total if reported else None,
                "prefix_hit_tokens_total": reported.prefix_hit_tokens_total if reported else None,
                "kv_bytes_pushed_total": reported.kv_bytes_pushed_total if reported else None,
                "prefix_blocks_expected": self.prefix.index.held(name) if self.prefix is not None else None,
                "extra": reported.extra if reported else {},
            }
        return out
