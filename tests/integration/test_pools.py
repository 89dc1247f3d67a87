"""Elastic pools on real Ray Serve with real vLLM CPU engines: the decode pool autoscales on the
load its engines report (pd-serve's policy, Serve's autoscaler), a replica that joins takes
requests within seconds of RUNNING, a replica Serve stops hands its streams to another token for
token, and the handle transport calls the replica the schedule chose."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.support.cluster import LogWatch, completion_ids, deployed, inspect, metric_lines, sse_chunks, token_pattern, wait_idle

pytestmark = pytest.mark.engine

TIMEOUTS = {"kv_ready_s": 10, "prefill_s": 30, "first_token_s": 30, "request_s": 300}
ENGINE_KWARGS = {"kv_cache_memory_bytes": 64 << 20, "max_num_batched_tokens": 2048}

AUTOSCALED = {
    "served_model_name": "tiny-llama",
    "max_model_len": 4096,  # room for streams long enough to be running when the pool shrinks
    "engine_kwargs": ENGINE_KWARGS,
    "prefill": {"num_replicas": 1, "num_cpus": 0.2},
    "decode": {
        "num_cpus": 0.2,
        "graceful_shutdown_timeout_s": 60,
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 2,
            "initial_replicas": 1,
            "upscale_delay_s": 0,
            # Long enough for the long streams below to start after the load ends, short enough
            # that the pool shrinks while they stream.
            "downscale_delay_s": 8,
            "look_back_period_s": 1,
            "metrics_interval_s": 0.25,
            # 8 requests per decode engine: the load's 16 concurrent streams ask for 2 engines,
            # the 8 long streams for one.
            "policy": {"policy_function": "serve_app.config.autoscaling:DecodeLoadPolicy", "policy_kwargs": {"target_requests": 8}},
        },
    },
    # By load: the long streams below alternate between the two engines (by prefix, those the
    # first engine already served would stay on it up to the imbalance bound).
    "router": {"mode": "disaggregated", "num_cpus": 0.1, "max_attempts": 3, "balancer": "load", "timeouts": TIMEOUTS},
}


def running_replicas(app_name: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[app_name].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"not within {timeout_s}s: {what}")


def decode_members(app) -> dict[str, dict[str, Any]]:
    """The decode engines the router chooses from now (its view, without a poll)."""
    return {name: e for name, e in app.snapshot(refresh=False)["engines"].items() if e["role"] == "decode" and not e["draining"]}


def stream_tokens(
    app, prompt: list[int], max_tokens: int, started: threading.Event | None = None
) -> tuple[set[str], list[int], str | None]:
    """(response ids, token ids, finish reason) of one greedy streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
    ids: set[str] = set()
    tokens: list[int] = []
    finish = None
    with requests.post(app.base_url + "/v1/completions", json=body, stream=True, timeout=600) as response:
        assert response.status_code == 200, response.text
        for chunk in sse_chunks(response):
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            if started is not None and tokens:
                started.set()
    return ids, tokens, finish


def scale_up(app) -> tuple[float, str]:
    """Under load: Serve starts a second decode replica; the router knows it and polls it
    within 5 s of RUNNING; it takes requests. (seconds from RUNNING to healthy, its name)"""
    wait_for("Serve runs a second decode replica", lambda: running_replicas(app.name, "decode") == 2, timeout_s=300, interval_s=0.1)
    running_at = time.monotonic()
    members = wait_for(
        "the router takes the new replica", lambda: [n for n, e in decode_members(app).items() if e["healthy"] and n != "decode-0"], 5, 0.2
    )
    joined_after = time.monotonic() - running_at
    (new,) = members
    wait_for(f"{new} takes requests", lambda: decode_members(app)[new]["router_inflight"] > 0, 5, interval_s=0.05)
    return joined_after, new


def drain_migrations(cluster, app_name: str) -> float:
    """pd_migrations_total{cause="drain"} of this app, on Ray's Prometheus endpoint."""
    lines = metric_lines(cluster.metrics_port)
    wanted = ('cause="drain"', f'application="{app_name}"')
    mine = [line for line in lines if line.startswith("ray_pd_migrations_total{") and all(w in line for w in wanted)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in mine)


def test_the_decode_pool_scales_with_its_load_and_a_stopped_replica_hands_its_streams_over(cluster, baseline_app):
    """(a) the pool grows to 2 under load and back to 1, every output equal to the colocated
    reference; (b) the replica Serve stops has at least 4 streams on it, and all of them complete
    token for token on the other one, counted as drain migrations."""
    prompts = [token_pattern(40, seed=900 + i) for i in range(8)]
    budget = 4000
    load_prompts = [token_pattern(32, seed=1000 + i) for i in range(16)]  # one per client, repeated
    with ThreadPoolExecutor(8) as pool:  # the colocated reference (its max_model_len: 2048)
        load_reference = list(pool.map(lambda p: completion_ids(baseline_app, p, max_tokens=400)[1], load_prompts))
        heads = list(pool.map(lambda p: completion_ids(baseline_app, p, max_tokens=2000)[1], prompts))
    with deployed(cluster, "pools", AUTOSCALED) as app:
        assert running_replicas(app.name, "decode") == 1 and list(decode_members(app)) == ["decode-0"]
        # The reference past the colocated app's 2,000 tokens: the long streams on the one
        # engine, nothing moving (8 requests are the policy's target for one engine: no scale-up).
        with ThreadPoolExecutor(len(prompts)) as pool:
            reference = [tokens for _, tokens, _ in pool.map(lambda p: stream_tokens(app, p, budget), prompts)]
        assert running_replicas(app.name, "decode") == 1

        # 1. Load: 16 concurrent streams keep the pool's running requests well above the policy's
        #    target of 8 per engine, until the pool has a second engine and it has served requests.
        stop = threading.Event()

        def load(i: int) -> list[tuple[set[str], list[int], str | None]]:
            outputs = []
            while not stop.is_set():
                outputs.append(stream_tokens(app, load_prompts[i], 400))
            return outputs

        with ThreadPoolExecutor(len(load_prompts)) as pool:
            loaders = [pool.submit(load, i) for i in range(len(load_prompts))]
            try:
                joined_after, new = scale_up(app)
            finally:
                stop.set()
            load_outputs = [loader.result() for loader in loaders]
        print(f"a joining decode replica was healthy in the router {joined_after:.2f}s after Serve said RUNNING")
        assert new in decode_members(app)
        for want, outputs in zip(load_reference, load_outputs):
            for ids, tokens, finish in outputs:
                assert len(ids) == 1 and finish == "length" and tokens == want
        print(f"{sum(map(len, load_outputs))} requests of the load, each equal to the colocated reference")

        # 2. The 8 long streams, 4 on each engine: the load falls to one engine's worth and Serve
        #    stops one replica while they stream. Its streams move to the other engine, token for
        #    token; each client sees one response.
        moved_before = drain_migrations(cluster, app.name)
        watch = LogWatch()
        started = [threading.Event() for _ in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            streams = []
            for prompt, event in zip(prompts, started):
                streams.append(pool.submit(stream_tokens, app, prompt, budget, event))
                event.wait(60)

            def four_each() -> bool:
                members = decode_members(app)
                return len(members) == 2 and all(e["router_inflight"] == 4 for e in members.values())

            try:
                wait_for("four long streams on each decode engine", four_each, 10, 0.2)
            except TimeoutError:
                view = {n: (e["router_inflight"], e["router_reserved_tokens"], e["draining"]) for n, e in app.snapshot()["engines"].items()}
                raise AssertionError(f"the long streams are not four per engine: {view}") from None
            wait_for("Serve stops one decode replica", lambda: running_replicas(app.name, "decode") == 1, timeout_s=120, interval_s=0.1)
            results = [s.result(timeout=600) for s in streams]
        for (ids, tokens, finish), want, head in zip(results, reference, heads):
            assert len(ids) == 1 and finish == "length" and len(tokens) == budget
            assert tokens == want and tokens[:2000] == head
        moves = {line.split("request ", 1)[1].split(" ", 1)[0] for line in watch.new_text().splitlines() if "moves off" in line}
        assert len(moves) >= 4, f"streams that moved off the stopped replica: {sorted(moves)}"
        deadline = time.monotonic() + 60
        while drain_migrations(cluster, app.name) - moved_before < len(moves):
            assert time.monotonic() < deadline, f"pd_migrations_total{{cause=drain}} did not count the {len(moves)} moves"
            time.sleep(2)
        assert len(decode_members(app)) == 1
        wait_idle(app)


ROLLED = {
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    "engine_kwargs": ENGINE_KWARGS,
    # A pool of one engine: its replacement starts before it stops (max_surge_percent), else
    # prompts would wait for a prefill engine while the replacement starts.
    "prefill": {"num_replicas": 1, "num_cpus": 0.2, "max_surge_percent": 100},
    "decode": {"num_replicas": 2, "num_cpus": 0.2, "engine_kwargs": {"kv_cache_memory_bytes": 64 << 20}},
    # Engine calls over the pools' deployment handles until the redeploy test moves them to the
    # engines' own endpoints (the default). By load, so both decode engines serve a few prompts
    # (by prefix each goes where its hash says).
    "router": {"mode": "disaggregated", "num_cpus": 0.1, "engine_transport": "grpc", "balancer": "load", "timeouts": TIMEOUTS},
}


@pytest.fixture(scope="module")
def rolled_app(cluster):
    """One app for the last two tests (an engine app's start is most of a minute on 2 cores): the
    handle transport's test first, then the redeploy's, which replaces every replica."""
    with deployed(cluster, "pools-rolled", ROLLED) as app:
        yield app


def test_over_serve_handles_each_call_reaches_the_replica_the_schedule_chose(rolled_app, baseline_app):
    """engine_transport: grpc: the router's engine calls go through the pools' deployment handles,
    pinned to the replica its balancer picked. Both decode engines serve; each attempt is on the
    one engine the router's snapshot names; the output is token-exact."""
    prompts = [token_pattern(64 + 37 * i, seed=700 + i) for i in range(6)]
    want = [completion_ids(baseline_app, p, max_tokens=12)[1] for p in prompts]
    app = rolled_app
    assert app.args["router"]["engine_transport"] == "grpc", "run before the redeploy test, which moves the router to http"
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: completion_ids(app, p, max_tokens=12), prompts))
    assert [tokens for _, tokens in got] == want
    attempts = [response_id + "-1" for response_id, _ in got]
    records = inspect(app, "decode", attempts)
    served = {name: [a for a in attempts if record["requests"][a]] for name, record in records.items()}
    assert set(served) == {"decode-0", "decode-1"} and all(served.values()), served
    assert sorted(a for names in served.values() for a in names) == sorted(attempts)  # each on exactly one
    for name, record in records.items():
        assert record["replica"] == app.snapshot()["engines"][name]["replica"]  # the pinned call reached it
    # The handle API too: engine calls made while the router serves a Serve request.
    final = app.handle.complete.remote({"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert final.result(timeout_s=120)["choices"][0]["token_ids"] == want[0]
    wait_idle(app)


LOADERS = 4
REDEPLOY_TOKENS = 96


def test_a_redeploy_with_a_changed_decode_engine_argument_under_load_loses_no_request(rolled_app, baseline_app):
    """A user changes a decode engine argument (its KV cache size, which changes no output) and
    the router's engine transport (Serve's handles to the engines' own endpoints), and redeploys
    the app as `serve deploy` does, while clients stream greedy completions. Serve
    replaces every replica of the app (it versions them all by the app's args): the decode
    engines one at a time, their streams moving to the other engine; the router replicas, whose
    replacements listen on the port before the old ones stop and finish their responses. Every
    request is answered once, whole and token for token as without the redeploy."""
    import copy

    from ray import serve

    from serve_app.app import Plugins, build_app_with

    prompts = [token_pattern(40 + 8 * i, seed=1300 + i) for i in range(8)]
    want = [completion_ids(baseline_app, p, max_tokens=REDEPLOY_TOKENS)[1] for p in prompts]
    app = rolled_app
    old_decode = {e["replica"] for e in decode_members(app).values()}
    old_router = app.snapshot()["router"]["replica"]
    assert len(old_decode) == 2
    stop = threading.Event()
    results: list[tuple[int, set[str] | None, list[int] | None, str | None, str | None]] = []

    def load(i: int) -> None:
        n = 0
        while not stop.is_set():
            k = (i + n * LOADERS) % len(prompts)
            try:
                ids, tokens, finish = stream_tokens(app, prompts[k], REDEPLOY_TOKENS)
                results.append((k, ids, tokens, finish, None))
            except Exception as exc:  # the client's view: any failure is an error here
                results.append((k, None, None, None, repr(exc)))
            n += 1

    watch = LogWatch()
    with ThreadPoolExecutor(LOADERS) as pool:
        loaders = [pool.submit(load, i) for i in range(LOADERS)]
        try:
            wait_for("the load is under way", lambda: len(results) >= LOADERS, timeout_s=120, interval_s=0.1)
            changed = copy.deepcopy(app.args)
            changed["decode"]["engine_kwargs"] = {"kv_cache_memory_bytes": 48 << 20}
            changed["router"]["engine_transport"] = "http"
            before = len(results)
            serve.run(build_app_with(changed, Plugins()), name=app.name, route_prefix=app.route_prefix)
            app.args = changed  # (what the module's app now runs)

            def replaced() -> bool:
                members = decode_members(app)
                ids = {e["replica"] for e in members.values()}
                return len(ids) == 2 and not ids & old_decode and all(e["healthy"] for e in members.values())

            wait_for("the router uses two new decode replicas", replaced, timeout_s=120, interval_s=0.5)
            assert serve.status().applications[app.name].status == "RUNNING"
            during = len(results) - before
            after = len(results)
            wait_for("more requests after the redeploy", lambda: len(results) >= after + 2 * LOADERS, timeout_s=300, interval_s=0.2)
        finally:
            stop.set()
        for loader in loaders:
            loader.result()
    new_router = app.snapshot()["router"]["replica"]
    logs = watch.new_text()
    rollout = [line for line in watch.new_text("serve").splitlines() if "Adding" in line or "Stopping" in line]
    print(f"{len(results)} requests, {during} answered while the redeploy ran; router {old_router} -> {new_router}")
    print(f"streams moved off a stopping decode engine: {logs.count('moves off')}")
    print("\n".join(rollout))

    errors = [error for *_, error in results if error is not None]
    assert not errors, errors
    # The two hand-overs the test is about really happened under the load.
    assert new_router != old_router and during > 0, (old_router, new_router, during)
    assert logs.count("moves off") >= 1, "no stream was on a stopping decode engine"
    for k, ids, tokens, finish, _ in results:
        assert ids is not None and len(ids) == 1 and finish == "length", (k, ids, finish)
        assert tokens == want[k], k
    wait_idle(app)
