"""The whole app in one process, without Ray: the router's ``RouterService`` driving the real
``Prefill`` / ``Decode`` deployment classes (their metaserver relay included) over mock engines,
through stand-ins for Serve's deployment handles. Fast tests of the async orchestration use it.

The handle stand-ins behave as Serve's do where the router can tell: a streaming call returns an
async iterator with ``cancel()``; a unary call returns an awaitable with ``cancel()``; a dead
replica raises ``ActorDiedError``. Faults are injected per engine (``Faults``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import ray.exceptions

from serve_app.config.backends import engine_specs
from serve_app.config.settings import load_config
from serve_app.engines.decode import Decode
from serve_app.engines.prefill import Prefill
from serve_app.router.service import RouterService
from serve_app.runtime.metrics import EngineMetrics, RouterMetrics


class NullMetric:
    def inc(self, *args: Any, **kwargs: Any) -> None:
        pass

    observe = set = inc


class RecordingMetric:
    """Keeps what was recorded, per tag set: the last value set, the sum of increments, the
    observations."""

    def __init__(self) -> None:
        self.values: dict[tuple, float] = {}
        self.observed: dict[tuple, list[float]] = {}

    @staticmethod
    def _key(tags: dict[str, str] | None) -> tuple:
        return tuple(sorted((tags or {}).items()))

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags)] = value

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value <= 0:  # as Ray's counters: an increment must be positive
            raise ValueError(f"value must be >0, got {value}")
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.observed.setdefault(self._key(tags), []).append(value)

    def value(self, **tags: str) -> float | None:
        return self.values.get(self._key(tags))

    def observations(self, **tags: str) -> list[float]:
        return self.observed.get(self._key(tags), [])


def recording_router_metrics() -> RouterMetrics:
    import dataclasses

    return RouterMetrics(**{f.name: RecordingMetric() for f in dataclasses.fields(RouterMetrics)})


def null_router_metrics() -> RouterMetrics:
    import dataclasses

    return RouterMetrics(**{f.name: NullMetric() for f in dataclasses.fields(RouterMetrics)})


def null_engine_metrics() -> EngineMetrics:
    import dataclasses

    return EngineMetrics(**{f.name: NullMetric() for f in dataclasses.fields(EngineMetrics)})


def _dead() -> ray.exceptions.ActorDiedError:
    return ray.exceptions.ActorDiedError()


@dataclass
class Faults:
    """What an engine's handle does wrong, for the next calls."""

    dead: bool = False  # every call raises ActorDiedError (the replica is gone)
    stream_ends_after: int | None = None  # a streaming call ends (no error) after this many items
    stream_raises_after: int | None = None  # ... or raises stream_error after this many items
    stream_error: Callable[[], BaseException] = _dead
    hang: bool = False  # a call never answers
    repeat_item: int | None = None  # a streaming call sends its item of this number (1-based) twice
    calls: list[str] = field(default_factory=list)


class FakeStream:
    """Serve's DeploymentResponseGenerator: ``async for`` over a replica's async generator."""

    def __init__(self, gen: AsyncIterator[Any], faults: Faults) -> None:
        self._gen = gen
        self._faults = faults
        self._items = 0
        self._last: Any = None
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        f = self._faults
        if self.cancelled:
            raise StopAsyncIteration
        if f.dead:
            raise _dead()
        if f.hang:
            await asyncio.Event().wait()
        if f.stream_ends_after is not None and self._items >= f.stream_ends_after:
            await self._close()
            raise StopAsyncIteration
        if f.stream_raises_after is not None and self._items >= f.stream_raises_after:
            await self._close()
            raise f.stream_error()
        if f.repeat_item is not None and self._items == f.repeat_item and self._last is not None:
            f.repeat_item = None
            return self._last
        item = await self._gen.__anext__()
        self._items += 1
        self._last = item
        return item

    def cancel(self) -> None:
        """As Serve does: stop the replica's generator (which aborts the engine request)."""
        self.cancelled = True
        asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        with contextlib.suppress(BaseException):
            await self._gen.aclose()


class FakeResponse:
    """Serve's DeploymentResponse: awaitable, cancellable."""

    def __init__(self, coro: Awaitable[Any], faults: Faults) -> None:
        self._faults = faults

        async def run() -> Any:
            try:
                if faults.dead:
                    raise _dead()
                if faults.hang:
                    await asyncio.Event().wait()
            except BaseException:
                coro.close()  # never started: no "never awaited" warning
                raise
            return await coro

        self._task = asyncio.ensure_future(run())

    def __await__(self) -> Any:
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class FakeMethod:
    def __init__(self, target: Any, name: str, stream: bool, faults: Faults) -> None:
        self._call = getattr(target, name)
        self._name = name
        self._stream = stream
        self._faults = faults

    def remote(self, *args: Any) -> Any:
        self._faults.calls.append(self._name)
        if self._stream:
            return FakeStream(self._call(*args), self._faults)
        return FakeResponse(self._call(*args), self._faults)


class FakeHandle:
    def __init__(self, target: Any, faults: Faults, stream: bool = False) -> None:
        self._target = target
        self._faults = faults
        self._stream = stream

    def options(self, stream: bool = False, **_: Any) -> FakeHandle:
        return FakeHandle(self._target, self._faults, stream)

    def __getattr__(self, name: str) -> FakeMethod:
        return FakeMethod(self._target, name, self._stream, self._faults)


MOCK_ARGS: dict[str, Any] = {
    "backend": "mock",
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    "prefill": {"num_replicas": 1},
    "decode": {"num_replicas": 2},
    # Calls through the handle stand-ins, where faults are injected; tests/unit/test_engine_http.py
    # runs the same app over the engines' own HTTP endpoints (router.engine_transport: http).
    "router": {
        "mode": "disaggregated",
        "engine_transport": "grpc",
        "timeouts": {"kv_ready_s": 2, "prefill_s": 2, "first_token_s": 2, "request_s": 20},
    },
    "mock": {"decode_step_s": 0.001, "prefill_s_per_token": 0.00001},
}


class App:
    """The app of ``args`` in this process; ``await App.start(args)``, then ``await app.stop()``."""

    def __init__(self) -> None:
        self.service: RouterService
        self.engines: dict[str, Any] = {}
        self.faults: dict[str, Faults] = {}

    @classmethod
    async def start(cls, args: dict[str, Any], tokenizer: Any, metrics: RouterMetrics | None = None) -> App:
        app = cls()
        config = load_config(args)
        handles: dict[str, tuple[str, Any]] = {}
        for spec in engine_specs(config):
            deployment = (Prefill if spec.role == "prefill" else Decode).func_or_class
            engine = deployment.__new__(deployment)
            # A replica freezes its process's heap once started; the test process is not theirs.
            with mock.patch("serve_app.engines.server.freeze_startup_heap"):
                await engine.__init__(spec)
            app.engines[spec.name] = engine
            app.faults[spec.name] = Faults()
            handles[spec.name] = (spec.role, FakeHandle(engine, app.faults[spec.name]))
        app.service = RouterService(
            config,
            handles,
            tokenizer=tokenizer,
            vocab_size=len(tokenizer),
            metrics=metrics or null_router_metrics(),
            replica_id="router-test",
        )
        await app.service.pool.refresh()
        return app

    async def stop(self) -> None:
        self.service.stop()
        for engine in self.engines.values():
            relay = getattr(engine, "relay", None)
            if relay is not None:
                await relay.stop()
            if engine.call_server is not None:
                await engine.call_server.stop()
            stopping = engine.__del__()  # as Serve does: awaits what it returns
            if stopping is not None:
                await stopping

    async def idle(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Wait until nothing is held anywhere (router counters, engine requests, KV); fail with
        the last snapshot otherwise. The leak check after every fast test."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            snap = await self.service.engine_snapshot()
            busy = snap["router"]["inflight"] or any(
                e["router_inflight"]
                or e["router_reserved_tokens"]
                or e["engine_inflight"]
                or e["engine_running"]
                or e["engine_waiting"]
                or e["kv_usage"]
                for e in snap["engines"].values()
            )
            relays = [getattr(e, "relay", None) for e in self.engines.values()]
            if not busy and not any(r is not None and r.pending for r in relays):
                return snap
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"resources still held: {snap}")
            await asyncio.sleep(0.01)
