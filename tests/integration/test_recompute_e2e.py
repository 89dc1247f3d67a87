"""Recompute on real vLLM CPU engines: decode engines with a deliberately tiny KV cache give
requests back (stop_reason 'recomputed') and the router resumes them token for token; a decode
replica killed mid-stream is resumed the same way. The shipped Grafana dashboard is checked on
this app too (it needs recompute, which only this app's engines do, and one app less to start
keeps the suite shorter): after traffic that exercises every panel, every metric its panels
query is on Ray's Prometheus endpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from serve_app.config.settings import REPO_ROOT
from tests.support.cluster import (
    busy_engine,
    completion_ids,
    deployed,
    inspect,
    kv_pressure_args,
    metric_lines,
    post,
    sse_chunks,
    token_pattern,
    wait_healthy,
    wait_idle,
)
from tests.support.faults import BREAK_PUSH, FAULTS, PREFILL_UNHEALTHY, faulty_prompt

pytestmark = pytest.mark.engine

ARGS = kv_pressure_args(decode_replicas=2)
ARGS["router"]["tool_call_parser"] = "hermes"  # for tool_choice "auto"


@pytest.fixture(scope="module")
def app(cluster):
    # The fault plug-ins change nothing for a request that does not ask for a fault (the dashboard's test does).
    with deployed(cluster, "pressure", ARGS, FAULTS) as app:
        yield app


def call(app, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request, streamed or not (greedy unless ``body`` sets a temperature); returns id, token
    ids, text, finish_reason, usage, logprobs."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = {"temperature": 0, **body, "return_token_ids": True}
    if not body.get("stream"):
        response = post(app, path, body, timeout=900)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        return {
            "id": data["id"],
            "tokens": choice["token_ids"],
            "text": text,
            "finish": choice["finish_reason"],
            "usage": data["usage"],
            "logprobs": choice.get("logprobs"),
        }
    body["stream_options"] = {"include_usage": True}
    out: dict[str, Any] = {"tokens": [], "text": "", "finish": None, "roles": 0, "ids": set(), "logprob_count": 0, "calls": {}}
    with requests.post(app.base_url + path, json=body, stream=True, timeout=900) as response:
        assert response.status_code == 200, response.text
        for chunk in sse_chunks(response):
            out["ids"].add(chunk["id"])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                out["roles"] += 1 if delta.get("role") else 0
                out["text"] += (delta.get("content") or "") if route == "chat" else choice.get("text", "")
                for call_delta in delta.get("tool_calls") or ():  # assembled as a client does
                    one = out["calls"].setdefault(call_delta["index"], {"id": None, "name": "", "arguments": ""})
                    one["id"] = one["id"] or call_delta.get("id")
                    one["name"] += call_delta.get("function", {}).get("name") or ""
                    one["arguments"] += call_delta.get("function", {}).get("arguments") or ""
                out["tokens"] += choice.get("token_ids") or []
                out["finish"] = choice.get("finish_reason") or out["finish"]
                lp = choice.get("logprobs")
                if lp:
                    out["logprob_count"] += len(lp["content"] if route == "chat" else lp["tokens"])
    (out["id"],) = out["ids"]
    return out


def cases() -> list[tuple[str, dict[str, Any]]]:
    def messages(seed: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": " ".join(f"w{(seed * 7 + i) % 97}" for i in range(60))}]

    return [
        ("completions", {"prompt": token_pattern(260, 1), "max_tokens": 700, "ignore_eos": True}),
        ("completions", {"prompt": token_pattern(300, 2), "max_tokens": 650, "ignore_eos": True, "stream": True}),
        ("chat", {"messages": messages(3), "max_completion_tokens": 600, "ignore_eos": True}),
        ("chat", {"messages": messages(4), "max_tokens": 620, "ignore_eos": True, "stream": True}),
        ("completions", {"prompt": token_pattern(220, 5), "max_tokens": 640, "ignore_eos": True, "logprobs": 2}),
        (
            "chat",
            {
                "messages": messages(6),
                "max_completion_tokens": 600,
                "ignore_eos": True,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 1,
            },
        ),
        ("completions", {"prompt": token_pattern(280, 7), "max_tokens": 600, "ignore_eos": True, "stream": True}),
        ("completions", {"prompt": token_pattern(240, 8), "max_tokens": 660, "ignore_eos": True}),
    ]


def test_recompute_under_kv_pressure_is_token_exact(app, baseline_app, cluster):
    work = cases()
    results: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = call(app, *work[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    assert len(results) == len(work)

    for i, (route, body) in enumerate(work):
        want = call(baseline_app, route, {**body, "stream": False})
        got = results[i]
        assert got["tokens"] == want["tokens"], f"case {i}: resumed output differs from colocated"
        assert got["text"] == want["text"]
        assert got["finish"] == want["finish"] == "length"
        assert got["usage"] == want["usage"]  # original prompt + all output tokens
        if body.get("stream"):
            assert got["roles"] == (1 if route == "chat" else 0)
        if body.get("logprobs"):
            count = (
                got["logprob_count"]
                if body.get("stream")
                else len(got["logprobs"]["content"] if route == "chat" else got["logprobs"]["tokens"])
            )
            assert count == len(got["tokens"])

    # Recomputes really happened, and some request needed more than one attempt.
    second_attempts = [results[i]["id"] + "-2" for i in results]
    decode = inspect(app, "decode", second_attempts)
    resumed = {a for a in second_attempts for d in decode.values() if d["requests"][a] is not None}
    assert resumed, "no request took a second attempt"
    deadline = time.monotonic() + 60
    while True:
        lines = metric_lines(cluster.metrics_port)
        total = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ray_pd_recompute_total{"))
        if total > 0:
            break
        assert time.monotonic() < deadline, "pd_recompute_total stayed at 0"
        time.sleep(2)
    assert any(line.startswith("ray_pd_recompute_wasted_tokens_total{") for line in lines)
    assert any(line.startswith("ray_pd_attempts_per_request_bucket{") for line in lines)
    wait_idle(app)


def resumed_under_pressure(app, body: dict[str, Any], first_seed: int, rounds: int = 3, route: str = "completions") -> dict[str, Any]:
    """``body`` sent, streamed, once six long streams are running: it is then the newest request
    on an engine whose KV (2,048 tokens) runs out while it still has some hundred tokens to go,
    and the recompute scheduler gives back the newest request first, so it is resumed. Not every
    time: the long streams give each other back too, and one may have moved away by the time
    ``body`` arrives, leaving its engine room. So up to ``rounds`` rounds, each with other long
    streams, until one resumes it after some output (checked: a second attempt, and a first one
    that ended early with tokens of its own, which the resumed attempt must go on from; one
    given back before its first token tests nothing); ``body``'s answer is the same in every
    round."""
    for round_ in range(rounds):
        got = _under_pressure(app, body, first_seed + 10 * round_, route)
        records = {}
        for engine in inspect(app, "decode", [got["id"] + "-1", got["id"] + "-2"]).values():
            records.update({a: r for a, r in engine["requests"].items() if r is not None})
        if got["id"] + "-2" in records and records[got["id"] + "-1"]["output_tokens"] > 0:
            assert records[got["id"] + "-1"]["output_tokens"] < len(got["tokens"]), records
            got["first_attempt_tokens"] = records[got["id"] + "-1"]["output_tokens"]
            return got
        wait_idle(app)
    raise AssertionError(f"the request was never resumed after some output in {rounds} rounds")


def _under_pressure(app, body: dict[str, Any], first_seed: int, route: str) -> dict[str, Any]:
    running = [threading.Event() for _ in range(6)]

    def pressure(k: int) -> None:
        load = {"prompt": token_pattern(300, first_seed + k), "max_tokens": 640, "ignore_eos": True, "stream": True}
        with requests.post(app.base_url + "/v1/completions", json=load, stream=True, timeout=900) as response:
            assert response.status_code == 200, response.text
            for _ in sse_chunks(response):
                running[k].set()

    pressure_threads = [threading.Thread(target=pressure, args=(k,)) for k in range(len(running))]
    for t in pressure_threads:
        t.start()
    for event in running:
        assert event.wait(300), "a pressure stream never started"
    got = call(app, route, {**body, "stream": True})
    for t in pressure_threads:
        t.join(timeout=900)
    return got


def test_stop_string_across_attempts_under_pressure(app, baseline_app):
    """A stop string taken from the reference output far enough in that attempts have ended
    before it: the response still stops exactly there."""
    body = {"prompt": token_pattern(250, 9), "max_tokens": 640, "ignore_eos": True}
    reference = call(baseline_app, "completions", body)["text"]
    stop = reference[len(reference) * 3 // 4 :][:6]
    assert stop.strip(), "pick a visible stop string"
    expected = reference[: reference.index(stop)]
    got = resumed_under_pressure(app, {**body, "stop": [stop]}, first_seed=20)
    assert got["text"] == expected and got["finish"] == "stop"
    # The premise: its first attempt ended before the stop string.
    assert got["first_attempt_tokens"] < len(got["tokens"])
    wait_idle(app)


def test_a_repetition_that_spans_attempts_ends_the_response_where_an_uninterrupted_one_ends(app, baseline_app):
    """repetition_detection: one allowed token makes the output a run of it, so the uninterrupted
    request ends with "repetition" at its REPEATS-th token. An attempt resumed before that has
    fewer than REPEATS tokens of its own, so its engine alone would run to the length: the router
    checks the whole output."""
    repeats = 400
    body = {
        "prompt": token_pattern(250, 23),
        "max_tokens": 640,
        "ignore_eos": True,
        "allowed_token_ids": [500],
        "repetition_detection": {"max_pattern_size": 1, "min_count": repeats},
    }
    want = call(baseline_app, "completions", body)
    assert want["finish"] == "repetition" and want["tokens"] == [500] * repeats
    got = resumed_under_pressure(app, body, first_seed=60)
    assert 0 < got["first_attempt_tokens"] < repeats  # the premise: a resumed attempt reached the repetition
    assert got["tokens"] == want["tokens"] and got["finish"] == "repetition"
    wait_idle(app)


def test_penalties_and_bad_words_count_the_earlier_attempts_output(app, baseline_app):
    """Presence and frequency penalties and multi-token bad words look at the output: on a
    resumed attempt the earlier output is part of the prompt, and the decode engine's logits
    processor (vllm_plugins/resumed_output.py) counts it as output again, so the response is
    the one an uninterrupted run gives."""
    body = {"prompt": token_pattern(250, 13), "max_tokens": 640, "ignore_eos": True}
    plain = call(baseline_app, "completions", body)["text"]
    word = plain[len(plain) // 2 :][:5]
    assert word.strip(), "pick a visible bad word"
    body.update(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.05, bad_words=[word])
    want = call(baseline_app, "completions", body)
    got = resumed_under_pressure(app, body, first_seed=40)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    assert got["finish"] == want["finish"] == "length"
    wait_idle(app)


def test_seeded_sampling_goes_on_where_the_earlier_attempt_left_off(app, baseline_app):
    """A seeded request at temperature 1: the resumed attempt's sampler skips the draws of the
    earlier attempts' tokens (vllm_plugins/seeded_sampling.py), so the response is the one an
    uninterrupted run gives."""
    body = {"prompt": token_pattern(250, 17), "max_tokens": 640, "ignore_eos": True, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    want = call(baseline_app, "completions", body)
    got = resumed_under_pressure(app, body, first_seed=100)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    wait_idle(app)


def test_structured_output_goes_on_where_the_earlier_attempt_left_off(app, baseline_app, tiny_tokenizer):
    """A regex some 500 tokens long: the resumed attempt's grammar is advanced by the earlier
    attempts' output (vllm_plugins/resumed_grammar.py) instead of starting over, so the response
    is the one an uninterrupted run gives, and it matches the regex."""
    regex = r"\[(\d{1,3},){150}\d{1,3}\]"
    body = {"prompt": token_pattern(250, 19), "max_tokens": 640, "structured_outputs": {"regex": regex}}
    want = call(baseline_app, "completions", body)
    assert want["finish"] == "stop" and re.fullmatch(regex, tiny_tokenizer.decode(want["tokens"], skip_special_tokens=True))
    got = resumed_under_pressure(app, body, first_seed=120)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"] and got["finish"] == "stop"
    wait_idle(app)


def test_an_auto_tool_call_goes_on_where_the_earlier_attempt_left_off(app, baseline_app):
    """A hermes tool call some 500 tokens long (a client's regex makes the random model write
    one), resumed under KV pressure: the router's parser (router.tool_call_parser) reads the
    response's text as one, whatever attempts wrote it, so the client gets the one call a
    colocated engine's text holds, streamed in pieces, and ``finish_reason`` "tool_calls"."""
    number = r"(0|[1-9]\d{0,2})"  # JSON's: no leading zeros
    regex = rf'<tool_call>\n\{{"name": "plot", "arguments": \{{"points": \[({number}, ){{150}}{number}\]\}}\}}\n</tool_call>'
    points = {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "integer"}}}}
    body = {
        "messages": [{"role": "user", "content": " ".join(f"w{(i * 13) % 97}" for i in range(60)) + " Plot them."}],
        "tools": [{"type": "function", "function": {"name": "plot", "parameters": points}}],
        "max_tokens": 640,
        "structured_outputs": {"regex": regex},
    }
    # Colocated, tool_choice "none": the call as text (special tokens kept, as hermes' parser keeps them).
    want = call(baseline_app, "chat", {**body, "tool_choice": "none", "skip_special_tokens": False})
    assert want["finish"] == "stop" and re.fullmatch(regex, want["text"]), want["text"]
    got = resumed_under_pressure(app, body, first_seed=160, route="chat")
    assert got["tokens"] == want["tokens"] and got["finish"] == "tool_calls" and not got["text"]
    (only,) = got["calls"].values()
    assert only["id"] and only["name"] == "plot"
    assert json.loads(only["arguments"]) == json.loads(want["text"].split("\n")[1])["arguments"]
    wait_idle(app)


DASHBOARD = REPO_ROOT / "configs" / "grafana" / "pd-serve.json"


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    return exprs


def what_queries_need(exprs: list[str]) -> dict[str, tuple[set[str], set[tuple[str, str]]]]:
    """Per series name a query reads: the labels it groups by (each metric of a query must have
    every label of the query's ``by``) and the label values it selects (``{le="1.0"}``)."""
    need: dict[str, tuple[set[str], set[tuple[str, str]]]] = {}
    for expr in exprs:
        assert not re.search(r"\bwithout\s*\(", expr), expr  # grouping this does not read
        grouped = {label.strip() for by in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in by.split(",")}
        for name, selector in re.findall(r"\b(ray_[a-z0-9_]+)(\{[^}]*\})?", expr):
            labels, values = need.setdefault(name, (set(), set()))
            labels |= {label for label in grouped if label != "le" or name.endswith("_bucket")}
            values |= set(re.findall(r'(\w+)="([^"]*)"', selector))
    return need


def exported_series(port: int, app) -> dict[str, list[dict[str, str]]]:
    """The series of ``app`` on Ray's endpoint, by name: pd-serve's by their Serve application,
    vLLM's by the replica of one of its engines (the cluster also serves other modules' apps,
    whose engines have the same names, and keeps their counters)."""
    replicas = {engine["replica"] for engine in app.snapshot()["engines"].values()}
    series: dict[str, list[dict[str, str]]] = {}
    for line in metric_lines(port, prefix="ray_"):
        name, _, rest = line.partition("{")
        name = name.split(" ", 1)[0]
        tags = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if tags.get("application") == app.name or tags.get("ReplicaId") in replicas:
            series.setdefault(name, []).append(tags)
    return series


def unmet(need: dict[str, tuple[set[str], set[tuple[str, str]]]], series: dict[str, list[dict[str, str]]]) -> list[str]:
    """What the dashboard's queries read that no exported series has."""
    problems = []
    for name, (labels, values) in sorted(need.items()):
        if name not in series:
            problems.append(f"{name}: not exported")
            continue
        if not any(all(tags.get(label) for label in labels) for tags in series[name]):  # Ray fills a missing label with ""
            problems.append(f"{name}: no series with the labels {sorted(labels)}")
        for label, value in sorted(values):
            if not any(tags.get(label) == value for tags in series[name]):
                problems.append(f"{name}: no series with {label}={value!r}")
    return problems


def test_every_series_the_dashboard_queries_is_exported_after_traffic(app, cluster):
    """Every metric a panel reads, with the labels it groups by and the label values it selects."""
    # Recompute: 6 x (300 + 700) tokens on 2 decode engines of 2,048 tokens each, one engine holds three at least.
    long = [token_pattern(300, seed=80 + i) for i in range(6)]
    with ThreadPoolExecutor(len(long)) as pool:
        list(pool.map(lambda p: completion_ids(app, p, max_tokens=700), long))
    completion_ids(app, faulty_prompt(BREAK_PUSH, token_pattern(200, seed=90)))  # a push that breaks
    shared = token_pattern(400, seed=91)
    completion_ids(app, shared)
    completion_ids(app, shared)  # a prefix-cache hit
    completion_ids(app, faulty_prompt(PREFILL_UNHEALTHY, token_pattern(120, seed=92)))
    time.sleep(1.5)  # the router's next stats poll sees prefill unhealthy
    completion_ids(app, token_pattern(120, seed=93))  # served colocated: a fallback

    need = what_queries_need(dashboard_queries())
    assert {"ray_pd_pool_replicas", "ray_vllm_num_requests_running"} <= set(need) and need["ray_pd_inflight"][0] == {"role", "engine"}
    deadline = time.monotonic() + 90
    while True:
        series = exported_series(cluster.metrics_port, app)
        problems = unmet(need, series)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not problems, f"the dashboard reads what is not exported: {problems}"
    # vLLM's metrics carry pd-serve's engine names, not vLLM's engine index.
    engines = set(app.snapshot()["engines"])
    assert {tags["engine"] for tags in series["ray_vllm_num_requests_running"]} == engines
    wait_healthy(app)  # prefill is back (the next test needs it)
    wait_idle(app)


def test_killed_decode_replica_mid_stream_is_resumed_elsewhere(app, baseline_app):
    body = {"prompt": token_pattern(120, 11), "max_tokens": 500, "ignore_eos": True}
    want = call(baseline_app, "completions", body)
    text, tokens, finish, ids = "", [], None, set()
    killed = None
    with requests.post(
        app.base_url + "/v1/completions",
        json={**body, "temperature": 0, "return_token_ids": True, "stream": True},
        stream=True,
        timeout=600,
    ) as response:
        for chunk in sse_chunks(response):
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            text += choice["text"]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            if killed is None and len(tokens) >= 60:
                killed = busy_engine(app, "decode")
                pid = inspect(app, "decode", [])[killed]["pid"]
                os.kill(pid, signal.SIGKILL)
    assert killed is not None and len(ids) == 1
    assert tokens == want["tokens"] and text == want["text"] and finish == "length"
    (response_id,) = ids
    resumed = inspect(app, "decode", [response_id + "-2"], skip=(killed,))
    assert any(d["requests"][response_id + "-2"] for d in resumed.values())
    wait_healthy(app)
    wait_idle(app)
