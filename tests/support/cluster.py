"""Helpers of the tests on real Ray Serve with real vLLM CPU engines (tests/integration; its
conftest's ``cluster`` fixture starts one Ray cluster and Serve instance per session): apps
deployed per module (``deploy``, ``deployed``) and deleted when the module ends.

Everything listens on loopback. Each app's router serves HTTP itself (``router.http``, as
configs/serve.yaml does) on a free port rather than 8000, so the tests do not collide with a
`make run` on the same machine.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from serve_app.config.backends import KV_PORT_STRIDE
from serve_app.runtime.ports import bindable, late_bound_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE_YAML = REPO_ROOT / "configs" / "serve.yaml"


# Ports the tests hand out for servers that bind them later (a router's HTTP port, once its
# engines are up; a KV port block): from serve_app.runtime.ports, between Ray's worker ports and the
# kernel's ephemeral range, where bind(0) and outgoing connections take ports (vLLM picks its
# internal ports with bind(0), then binds them again later). With ports handed out by bind(0),
# CI once saw a router's constructor fail three times and its app's deploy fail; a port taken
# meanwhile is the likeliest cause (the log did not show the constructor's error; ``deploy`` now
# prints it).
_TEST_PORTS = late_bound_ports()
# Room for an app's KV side channels, KV_PORT_STRIDE ports each: eight engine indices, which hold
# test_cdcp's 2 prefill + 2 decode engines (decode's indices start after twice the prefill pool).
KV_PORT_BLOCK = 8 * KV_PORT_STRIDE
_handed_out: set[int] = set()


def free_ports(count: int = 1, align: int = 1) -> int:
    """The first of ``count`` consecutive free ports (starting at a multiple of ``align``), never
    handed out before in this session."""
    start = _TEST_PORTS.start + (os.getpid() * 97) % (len(_TEST_PORTS) // 2)
    start -= start % align
    for first in range(start, _TEST_PORTS.stop - count, align):
        block = range(first, first + count)
        if not _handed_out.intersection(block) and all(bindable("127.0.0.1", port) for port in block):
            _handed_out.update(block)
            return first
    raise RuntimeError(f"no {count} free ports left in {_TEST_PORTS}")


def free_port() -> int:
    return free_ports()


@dataclass
class Cluster:
    http_port: int
    metrics_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass
class DeployedApp:
    name: str
    route_prefix: str
    base_url: str  # http://host:port of the app's router, without a trailing slash
    args: dict[str, Any]

    @property
    def handle(self) -> Any:
        from ray import serve

        return serve.get_app_handle(self.name)

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this app sends: its first API key (``router.api_keys``), if it has any."""
        keys = self.args.get("router", {}).get("api_keys")
        return {"authorization": f"Bearer {keys[0]}"} if keys else {}

    def snapshot(self, refresh: bool = True) -> dict[str, Any]:
        """The router's view of its engines; ``refresh``: after polling every engine's stats
        (else as it stands, e.g. to see whom the router knows, on a busy host)."""
        return self.handle.engine_snapshot.remote(refresh).result(timeout_s=30)


def deploy(
    cluster: Cluster, name: str, route_prefix: str, args: dict[str, Any], timeout_s: float = 240, plugins: Any = None
) -> DeployedApp:
    from ray import serve

    from serve_app.app import Plugins, build_app_with

    port = free_port()
    router = args.get("router", {})
    args = {**args, "router": {**router, "http": {**router.get("http", {}), "host": "127.0.0.1", "port": port}}}
    try:
        serve.run(build_app_with(args, plugins or Plugins()), name=name, route_prefix=route_prefix, blocking=False)
    except RuntimeError as exc:  # Serve names the failed deployments; their messages say why
        deployments = serve.status().applications[name].deployments
        raise RuntimeError(f"{exc}\n" + "\n".join(f"{d}: {s.status}: {s.message}" for d, s in deployments.items())) from exc
    app = DeployedApp(name=name, route_prefix=route_prefix, base_url=f"http://127.0.0.1:{port}", args=args)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(app.base_url + "/health", timeout=5).status_code == 200:
                snap = app.snapshot()["engines"]
                if all(e["healthy"] for e in snap.values()):
                    return app
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"app {name} did not become healthy within {timeout_s}s")


@contextmanager
def deployed(cluster: Cluster, name: str, args: dict[str, Any], plugins: Any = None) -> Iterator[DeployedApp]:
    """An app at /<name> for the duration of a module, on KV ports of its own (unless ``args``
    names them)."""
    from ray import serve

    try:
        app = deploy(cluster, name, f"/{name}", {"kv_port_base": free_ports(KV_PORT_BLOCK, align=16), **args}, plugins=plugins)
    except BaseException:
        # An app that did not become healthy still holds its replicas' CPUs: deleted here, or
        # every later module's app would wait for room on the cluster.
        serve.delete(name)
        raise
    try:
        yield app
    finally:
        serve.delete(app.name)


# The tiny model's KV per block: tokens/block * layers * (K,V) * kv heads * head_dim * fp32.
BLOCK_BYTES = 128 * 2 * 2 * 2 * 32 * 4


def kv_pressure_args(decode_replicas: int) -> dict[str, Any]:
    """A disaggregated app whose decode engines hold 16 usable blocks (2048 tokens) each, the least
    vLLM accepts for max_model_len: a few long generations at once run them out of KV."""
    return {
        "served_model_name": "tiny-llama",
        "max_model_len": 2048,
        "engine_kwargs": {"max_num_batched_tokens": 2048},
        "prefill": {"num_replicas": 1, "num_cpus": 0.2, "engine_kwargs": {"kv_cache_memory_bytes": 64 << 20}},
        "decode": {"num_replicas": decode_replicas, "num_cpus": 0.2, "engine_kwargs": {"kv_cache_memory_bytes": 17 * BLOCK_BYTES}},
        "router": {
            "mode": "disaggregated",
            "num_cpus": 0.1,
            "max_attempts": 24,
            "timeouts": {"kv_ready_s": 300, "prefill_s": 60, "first_token_s": 300, "request_s": 900},
        },
    }


def sse_chunks(response: requests.Response) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed OpenAI response, as they arrive (none of them an error)."""
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        yield chunk


def token_pattern(length: int, seed: int) -> list[int]:
    """A prompt of token ids that only this seed produces (so no engine has it cached by chance)."""
    return [(seed * 131 + i * 17 + (i * i) % 7) % 900 + 20 for i in range(length)]


def busy_engine(app: DeployedApp, role: str, timeout_s: float = 30) -> str:
    """The engine of ``role`` the router has a call in flight on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, engine in app.snapshot()["engines"].items():
            if engine["role"] == role and engine["router_inflight"] > 0:
                return name
        time.sleep(0.05)
    raise TimeoutError(f"no {role} engine busy")


def serve_yaml_app() -> dict[str, Any]:
    """The one application of configs/serve.yaml, as written."""
    (app,) = yaml.safe_load(SERVE_YAML.read_text())["applications"]
    return app


def wait_idle(app: DeployedApp, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until nothing is in flight anywhere and every engine's KV cache is empty; fail with
    the last snapshot otherwise. This is the 'nothing leaks' check after every test."""
    deadline = time.monotonic() + timeout_s
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        snap = app.snapshot()
        if snap["router"]["inflight"] == 0 and all(_engine_idle(e) for e in snap["engines"].values()):
            return snap
        time.sleep(0.25)
    raise AssertionError(f"resources still held after {timeout_s}s: {snap}")


def _engine_idle(engine: dict[str, Any]) -> bool:
    return (
        engine["router_inflight"] == 0
        and engine["router_reserved_tokens"] == 0
        and engine["engine_inflight"] == 0
        and engine["engine_running"] == 0
        and engine["engine_waiting"] == 0
        and engine["kv_usage"] == 0.0
    )


def metric_lines(port: int, prefix: str = "ray_pd_") -> list[str]:
    """pd-serve's lines (or those of another prefix: ``ray_vllm_`` for vLLM's) on Ray's
    Prometheus endpoint."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


def wait_for_metrics(port: int, wanted: list[tuple[str, str]], timeout_s: float = 90) -> None:
    """Until every (line prefix, tag text) is on Ray's Prometheus endpoint; fail naming those
    that never came."""
    deadline = time.monotonic() + timeout_s
    missing = list(wanted)
    while True:
        lines = metric_lines(port, prefix="ray_")
        missing = [(name, tag) for name, tag in missing if not any(line.startswith(name) and tag in line for line in lines)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"not exported: {missing}"


def post(app: DeployedApp, path: str, body: dict[str, Any], timeout: float = 180) -> requests.Response:
    return requests.post(app.base_url + path, json=body, headers=app.headers, timeout=timeout)


def completion_ids(app: DeployedApp, prompt: Any, max_tokens: int = 12, **extra: Any) -> tuple[str, list[int]]:
    """(response id, output token ids) of a greedy completion through the HTTP API."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = post(app, "/v1/completions", {**body, **extra})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["id"], data["choices"][0]["token_ids"]


class PinnedEngine:
    """One engine replica of a pool, called through its role's deployment handle: every call
    names the replica, which pd-serve's request router sends it to (router/replica_router.py)."""

    def __init__(self, handle: Any, replica_id: str) -> None:
        self._handle = handle
        self.replica_id = replica_id

    def options(self, **options: Any) -> PinnedEngine:
        return PinnedEngine(self._handle.options(**options), self.replica_id)

    def __getattr__(self, method: str) -> Any:
        target, replica = getattr(self._handle, method), self.replica_id

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                return target.remote(*args, replica=replica, **kwargs)

        return Method()


def engine_handles(app: DeployedApp, role: str) -> dict[str, PinnedEngine]:
    """The running engines of ``role``, by the name the router knows them by."""
    from ray import serve

    handle = serve.get_deployment_handle(role, app.name)
    engines = app.snapshot()["engines"]
    return {name: PinnedEngine(handle, e["replica"]) for name, e in engines.items() if e["role"] == role and not e["draining"]}


def inspect(app: DeployedApp, role: str, ids: list[str], skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every engine of ``role``'s records for these attempt ids (engines in ``skip`` left out)."""
    handles = engine_handles(app, role)
    return {name: h.inspect.remote(ids).result(timeout_s=30) for name, h in handles.items() if name not in skip}


def wait_healthy(app: DeployedApp, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = app.snapshot()["engines"]
        if all(e["healthy"] for e in snap.values()):
            return
        time.sleep(1)
    raise TimeoutError(f"engines of {app.name} not healthy again within {timeout_s}s")


BASELINE_ARGS = {
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    "prefill": {"num_replicas": 0},
    "decode": {"num_replicas": 1, "num_cpus": 0.1},
    "router": {"mode": "colocated", "num_cpus": 0.05},
}


class LogWatch:
    """What Ray's processes write to their log files from now on (router, engines, proxy)."""

    def __init__(self) -> None:
        import ray

        self.root = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        self.offsets = {path: path.stat().st_size for path in self._files()}

    def _files(self) -> list[Path]:
        return [p for p in self.root.rglob("*") if p.is_file() and p.suffix in (".log", ".err", ".out")]

    def new_text(self, under: str = "") -> str:
        """Text appended since this watch began, in every log file (or those under ``under``,
        e.g. "serve" for the Serve components' own files)."""
        chunks = []
        for path in self._files():
            if under and under not in path.relative_to(self.root).parts[:-1]:
                continue
            start = self.offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                chunks.append(f.read().decode(errors="replace"))
        return "".join(chunks)
