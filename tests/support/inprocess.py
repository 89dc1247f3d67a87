"""The whole app in one process, without Ray: the router's ``RouterService`` driving the real
``Prefill`` / ``Decode`` deployment classes (their metaserver relay included) over mock engines,
through stand-ins for Serve's deployment handles (``router.engine_transport: grpc``) or over the
engines' own HTTP endpoints (``http``). Fast tests of the async orchestration use it, with the
helpers below (``run``, ``completion``, ``expected``, ...).

The handle stand-ins behave as Serve's do where the router can tell: a streaming call returns an
async iterator with ``cancel()``; a unary call returns an awaitable with ``cancel()``; a dead
replica raises ``ActorDiedError``. Faults are injected per engine (``Faults``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import ray.exceptions

from serve_app.config.backends import KV_PORT_STRIDE, engine_specs
from serve_app.config.settings import load_config
from serve_app.engines.decode import Decode
from serve_app.engines.mock_runner import next_token
from serve_app.engines.prefill import Prefill
from serve_app.router.service import RouterService
from serve_app.runtime.metrics import EngineMetrics, RouterMetrics
from serve_app.runtime.ports import bindable, late_bound_ports
from serve_app.wire.sampling import sampling_fields


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
    # Calls through the handle stand-ins, where faults are injected; ``args(router={"engine_transport":
    # "http"})`` runs the same app over the engines' own HTTP endpoints (the ``transport`` fixture).
    "router": {
        "mode": "disaggregated",
        "engine_transport": "grpc",
        "timeouts": {"kv_ready_s": 2, "prefill_s": 2, "first_token_s": 2, "request_s": 20},
    },
    "mock": {"decode_step_s": 0.001, "prefill_s_per_token": 0.00001},
}


# The in-process apps' KV ports: the mock engines listen on kv_port_base + 16 * i (up to 8 engines
# here). The default base (36000) is every process's: test processes run side by side (pytest -n,
# `make test-fast`) or a `make run` would race for the same ports. Each process takes a block of
# its own, once (its apps run one after the other).
KV_ENGINES = 8
_kv_port_base: int | None = None


def kv_port_base() -> int:
    """This process's block of KV ports, found free when first asked for."""
    global _kv_port_base
    if _kv_port_base is None:
        ports = late_bound_ports()
        size = KV_ENGINES * KV_PORT_STRIDE
        blocks = range(ports.start - ports.start % size + size, ports.stop - size, size)
        first = (os.getpid() * 7919) % len(blocks)  # processes starting together start apart
        for base in [*blocks[first:], *blocks[:first]]:
            if all(bindable("127.0.0.1", base + i * KV_PORT_STRIDE) for i in range(KV_ENGINES)):
                _kv_port_base = base
                break
        else:
            raise RuntimeError(f"no free block of KV ports in {ports}")
    return _kv_port_base


class App:
    """The app of ``args`` in this process; ``await App.start(args)``, then ``await app.stop()``.
    Its engines' KV ports are this process's own (``kv_port_base()``) unless ``args`` name them."""

    def __init__(self) -> None:
        self.service: RouterService
        self.engines: dict[str, Any] = {}
        self.faults: dict[str, Faults] = {}

    @classmethod
    async def start(cls, args: dict[str, Any], tokenizer: Any, metrics: RouterMetrics | None = None) -> App:
        app = cls()
        config = load_config({"kv_port_base": kv_port_base(), **args})
        handles: dict[str, tuple[str, Any]] = {}
        for spec in engine_specs(config):
            deployment = (Prefill if spec.role == "prefill" else Decode).func_or_class
            engine = deployment.__new__(deployment)
            # A replica freezes its process's heap once started; the test process is not theirs.
            # It reports to Ray's metrics, which would start Ray here: it reports to nothing.
            with (
                mock.patch("serve_app.engines.server.freeze_startup_heap"),
                mock.patch("serve_app.engines.server.engine_metrics", null_engine_metrics),
            ):
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

        async def stop_engine(engine: Any) -> None:
            servers = [getattr(engine, "relay", None), engine.call_server]
            await asyncio.gather(*(server.stop() for server in servers if server is not None))
            stopping = engine.__del__()  # as Serve does: awaits what it returns
            if stopping is not None:
                await stopping

        # Together, as Serve stops replicas: an in-replica server's stop waits for uvicorn's next
        # check of its exit flag (every 0.1 s), so one after the other they cost every test that.
        await asyncio.gather(*(stop_engine(engine) for engine in self.engines.values()))

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
            # Every engine's own count as well: one the router has dropped from its pool (drained,
            # lost) is in no snapshot, and a request left on it would be a leak all the same.
            held = {name: e.runner.stats() for name, e in self.engines.items()}
            busy = busy or any(s.inflight or s.num_running or s.num_waiting or s.kv_usage for s in held.values())
            relays = [getattr(e, "relay", None) for e in self.engines.values()]
            if not busy and not any(r is not None and r.pending for r in relays):
                return snap
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"resources still held: {snap}; engines: {held}")
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------- driving the app
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def args(**changes: Any) -> dict[str, Any]:
    """``MOCK_ARGS`` with ``changes``: a dict given for a dict field is merged into it (one level)."""
    out = copy.deepcopy(MOCK_ARGS)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def run(coro_fn: Callable[[App], Awaitable[Any]], app_args: dict[str, Any], tokenizer: Any, metrics: RouterMetrics | None = None) -> Any:
    """``await coro_fn(app)`` on the app of ``app_args`` (30 s at most), then the idle check."""

    async def main() -> Any:
        app = await App.start(app_args, tokenizer, metrics)
        try:
            result = await asyncio.wait_for(coro_fn(app), 30)
            await app.idle()
            return result
        finally:
            await app.stop()

    return asyncio.run(main())


def router_args(**router: Any) -> dict[str, Any]:
    """``MOCK_ARGS`` with ``router`` merged into its router section."""
    out = copy.deepcopy(MOCK_ARGS)
    out["router"] = {**out["router"], **router}
    return out


def run_http(
    body: Callable[[App, Any], Awaitable[None]],
    tokenizer: Any,
    metrics: RouterMetrics | None = None,
    environ: dict[str, str] | None = None,
    app_args: dict[str, Any] | None = None,
    **router: Any,
) -> None:
    """``await body(app, client)``: ``client`` an httpx client of the router's own HTTP app
    (router/direct_http.py) over the in-process app of ``app_args`` (default: ``router_args(**router)``),
    started with ``environ`` in its environment (60 s at most); then the idle check."""
    import httpx

    from serve_app.router.direct_http import openai_app

    async def main() -> None:
        with mock.patch.dict("os.environ", environ or {}):
            app = await App.start(app_args if app_args is not None else router_args(**router), tokenizer, metrics)
        try:
            transport = httpx.ASGITransport(app=openai_app(app.service))
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=30) as client:
                await asyncio.wait_for(body(app, client), 60)
            await app.idle()
        finally:
            await app.stop()

    asyncio.run(main())


def expected(prompt: list[int], n: int) -> list[int]:
    """The mock engine's ``n`` greedy tokens after ``prompt``."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


async def play(response: Any, sent: list) -> None:
    """Run a Starlette response as its server would, for a client that never disconnects by
    itself (cancel the task to have it leave); every ASGI message it sends goes into ``sent``."""

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    await response({"type": "http"}, receive, send)


def sse_events(sent: list[dict]) -> list:
    """The SSE events (dicts, and "[DONE]") in the ASGI messages a response sent."""
    events: list = []
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def body_of(response: Any) -> tuple[int, Any]:
    """(status, JSON body or the list of SSE events) of a Starlette response, consumed here."""
    if hasattr(response, "body_iterator"):
        sent: list[dict] = []
        await play(response, sent)
        return response.status_code, sse_events(sent)
    return response.status_code, json.loads(response.body)


async def completion(app: App, prompt: list[int], max_tokens: int = 8, stream: bool = False, **extra: Any) -> tuple[int, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, "stream": stream, **extra}
    return await body_of(await app.service.http("completions", json.dumps(body).encode()))


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids") or []]


async def long_streaming_client(app: App, events: list) -> None:
    """A client streaming a long completion that never disconnects by itself: cancel its task
    to have it leave. What it is sent goes into ``events``."""
    response = await app.service.http("completions", json.dumps({"prompt": PROMPT, "max_tokens": 2000, "stream": True}).encode())
    await play(response, events)


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def leased(app: App, role: str) -> bool:
    """Whether the router holds a call on an engine of ``role``."""
    return any(load.inflight for load in app.service.pool.of_role(role))


def no_callbacks(app: App) -> None:
    """Decode engines allocate KV but never call the metaserver back."""
    for name, engine in app.engines.items():
        if name.startswith("decode"):

            async def lost(*_: Any, **__: Any) -> None:
                return None

            engine.runner.post_callback = lost


def handle_calls(app: App) -> list[str]:
    """The engine calls that went through the Serve handle stand-ins (stats polls aside)."""
    return [call for faults in app.faults.values() for call in faults.calls if call != "stats"]


def engine_calls(app: App) -> list[dict[str, Any]]:
    """Each engine request as it arrives: the engine, its id, and its prompt logprobs setting."""
    calls: list[dict[str, Any]] = []
    for name, engine in app.engines.items():
        real = engine.runner.generate

        async def recording(request: Any, real: Any = real, name: str = name) -> Any:
            fields = sampling_fields(request.sampling_params)
            calls.append(
                {
                    "engine": name,
                    "request_id": request.request_id,
                    "prompt_logprobs": fields.get("prompt_logprobs"),
                    "skip_cache": fields.get("skip_reading_prefix_cache"),
                    "prompt": list(request.prompt_token_ids),
                    "kv": request.kv_transfer_params,
                    "priority": request.priority,
                    "reasoning_ended": request.reasoning_ended,
                    "reasoning_parser_kwargs": request.reasoning_parser_kwargs,
                }
            )
            async for delta in real(request):
                yield delta

        engine.runner.generate = recording
    return calls


def vllm_logprob_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text vLLM's own engine (its LogprobsProcessor) gives each of these tokens' logprobs,
    sampled one a step: a piece of a multi-byte character is read with the tokens before it. A
    prompt's, from its second token on, are these of ``prompt[1:]`` (the first has no entry)."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    processor = LogprobsProcessor(
        tokenizer=tokenizer, logprobs=[], prompt_logprobs=None, cumulative_logprob=0.0, num_logprobs=0, num_prompt_logprobs=None
    )
    for token_id in token_ids:
        processor._update_sample_logprobs(LogprobsLists(np.array([[token_id]]), np.array([[-1.0]]), np.array([1])))
    return [position[token_id].decoded_token for position, token_id in zip(processor.logprobs, token_ids)]
