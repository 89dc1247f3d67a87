"""Cache-aware routing (router.balancer: prefix) with real vLLM CPU engines: two decode engines,
four prompt prefixes. Each prefix's requests go to one engine, the one the documented rule
names, and hit its prefix cache (vLLM's own count); outputs are the baseline's, token for token;
and a prefix moves on to the other engine only once its engine's load crosses the bound."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from serve_app.router.prefix_index import chain_keys, engine_salt, rendezvous
from tests.support.cluster import completion_ids, deployed, inspect, sse_chunks, token_pattern, wait_idle

pytestmark = pytest.mark.engine

BLOCK = 128  # vLLM's KV block on the CPU, and so the router's prefix block (config.prefix_block_tokens)
ARGS = {
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    "engine_kwargs": {"kv_cache_memory_bytes": 64 << 20, "max_num_batched_tokens": 2048},
    "prefill": {"num_replicas": 0},
    "decode": {"num_replicas": 2, "num_cpus": 0.1},
    "router": {"mode": "colocated", "num_cpus": 0.05, "balancer": "prefix", "prefix": {"max_imbalance": 1.3}},
}


@pytest.fixture(scope="module")
def app(cluster):
    with deployed(cluster, "prefix", ARGS) as app:
        yield app


def engine_counts(app) -> dict[str, tuple[int, int]]:
    """Per decode engine: (prompt tokens it was given, those its prefix cache held), so far."""
    engines = app.snapshot()["engines"]
    return {n: (e["prompt_tokens_total"], e["prefix_hit_tokens_total"]) for n, e in engines.items() if e["role"] == "decode"}


def replica_ids(app) -> dict[str, str]:
    """Each engine's Serve replica id, by the name the router gives it."""
    return {name: e["replica"] for name, e in app.snapshot(refresh=False)["engines"].items()}


def home(app, prefix: list[int], names: list[str], replica: dict[str, str] | None = None) -> str:
    """Where every router replica sends a new prefix: rendezvous on its first block, salted by
    each engine's Serve replica id (``replica``: by name, else asked of the router)."""
    if replica is None:
        replica = replica_ids(app)
    return rendezvous(chain_keys(prefix, BLOCK)[0], names, lambda name: engine_salt(replica[name]))


def balanced_prefixes(app, names: list[str]) -> list[list[int]]:
    """Four prefixes the rule places two on each engine (the engines' replica ids, and so the
    placement, are new every run), so the bound never moves one while they take turns (which
    the second test shows it does when one engine gets more than its share)."""
    replica = replica_ids(app)
    chosen: dict[str, list[list[int]]] = {name: [] for name in names}
    for seed in range(700, 800):
        prefix = token_pattern(2 * BLOCK, seed=seed)
        engine = home(app, prefix, names, replica)
        if len(chosen[engine]) < 2:
            chosen[engine].append(prefix)
    return [prefix for pair in zip(*chosen.values()) for prefix in pair]


def test_each_prefix_sticks_to_the_engine_the_rule_names_and_hits_its_cache(app, baseline_app):
    names = sorted(engine_counts(app))
    assert names == ["decode-0", "decode-1"]
    prefixes = balanced_prefixes(app, names)
    assert len(prefixes) == 4
    served: dict[int, list[str]] = {i: [] for i in range(len(prefixes))}
    for turn in range(3):
        for i, prefix in enumerate(prefixes):
            prompt = prefix + token_pattern(20, seed=7000 + 10 * i + turn)
            before = engine_counts(app)
            _, tokens = completion_ids(app, prompt, max_tokens=8)
            after = engine_counts(app)
            (engine,) = [n for n in names if after[n][0] > before[n][0]]  # requests go one at a time
            hits = after[engine][1] - before[engine][1]
            served[i].append(engine)
            # vLLM caches whole blocks: from the second request on, the two blocks of the prefix.
            assert hits == (0 if turn == 0 else 2 * BLOCK), (i, turn, hits)
            _, reference = completion_ids(baseline_app, prompt, max_tokens=8)
            assert tokens == reference
    for i, engines in served.items():
        # A new prefix goes where every router replica would send it: rendezvous on its first block.
        assert engines == [home(app, prefixes[i], names)] * 3, served
    wait_idle(app)


def stream(app, prompt: list[int], max_tokens: int, started: threading.Event) -> tuple[str, int]:
    """(response id, tokens) of a greedy stream; ``started`` is set at its first token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True}
    rid, count = "", 0
    with requests.post(app.base_url + "/v1/completions", json=body, stream=True, timeout=600) as response:
        assert response.status_code == 200, response.text
        for chunk in sse_chunks(response):
            rid = chunk["id"]
            count += len(chunk["choices"][0].get("token_ids") or [])
            if count:
                started.set()
    return rid, count


def test_a_prefix_moves_on_only_once_its_engine_is_past_the_bound(app):
    """Streams of one prefix, started one after another and all kept running: the first ones
    stay on the prefix's engine; once its load passes 1.3x the mean (plus a request's), the next
    goes to the other engine."""
    names = sorted(engine_counts(app))
    prefix = token_pattern(2 * BLOCK, seed=700)
    home_engine = home(app, prefix, names)
    streams = 5
    with ThreadPoolExecutor(streams) as pool:
        futures = []
        for n in range(streams):
            started = threading.Event()
            futures.append(pool.submit(stream, app, prefix + token_pattern(20, seed=8000 + n), 600, started))
            assert started.wait(120), "a stream did not start"
        results: list[tuple[str, int]] = [f.result() for f in futures]
    assert all(count == 600 for _, count in results)
    records: dict[str, Any] = inspect(app, "decode", [f"{rid}-1" for rid, _ in results])
    engine_of = {}
    for name, seen in records.items():
        for attempt, record in seen["requests"].items():
            if record is not None:
                engine_of[attempt] = name
    order = [engine_of[f"{rid}-1"] for rid, _ in results]
    first_away = next((k for k, name in enumerate(order) if name != home_engine), None)
    # Two streams fit under the bound on an idle pair (load <= r / (1 - 1.3 / 2) with one
    # request's load r); the other engine takes one by the fourth.
    assert order[:2] == [home_engine, home_engine] and first_away is not None and first_away <= 3, order
    wait_idle(app)


def test_a_cache_salt_shares_cached_prefixes_only_between_requests_with_that_salt(baseline_app):
    """vLLM's cache_salt through pd-serve (one engine, so every request meets the same cache): a
    prefix cached under one salt is a hit for that salt only; the salt never changes the output."""
    prefix = token_pattern(2 * BLOCK, seed=730)
    (engine,) = [n for n, e in baseline_app.snapshot()["engines"].items() if e["role"] == "decode"]

    def hits_and_tokens(salt: str | None, suffix_seed: int) -> tuple[int, list[int]]:
        prompt = prefix + token_pattern(20, seed=suffix_seed)
        before = baseline_app.snapshot()["engines"][engine]["prefix_hit_tokens_total"]
        _, tokens = completion_ids(baseline_app, prompt, max_tokens=8, **({} if salt is None else {"cache_salt": salt}))
        return baseline_app.snapshot()["engines"][engine]["prefix_hit_tokens_total"] - before, tokens

    # (salt, the prefix tokens the engine's cache holds for it by then)
    for turn, (salt, hits) in enumerate([("tenant-a", 0), ("tenant-a", 2 * BLOCK), ("tenant-b", 0), (None, 0), (None, 2 * BLOCK)]):
        assert hits_and_tokens(salt, 7300 + turn)[0] == hits, (turn, salt)
    # The same prompt under a salt whose cache holds it, another salt, and none: one output.
    outputs = [hits_and_tokens(salt, 7399)[1] for salt in ("tenant-a", "tenant-c", None)]
    assert outputs[0] == outputs[1] == outputs[2]
    wait_idle(baseline_app)
