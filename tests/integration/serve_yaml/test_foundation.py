"""The app exactly as configs/serve.yaml describes it, on real Ray Serve and real vLLM CPU
engines: OpenAI API (completions and chat, stream and not), the handle API, bad input, metrics.
The app (``app``, conftest.py) is the one test_fuzz.py uses after these tests."""

from __future__ import annotations

import json
import re
import time

import openai
import psutil
import pytest
import requests

from tests.support.cluster import LogWatch, wait_for_metrics, wait_idle

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(app):
    from transformers import AutoTokenizer

    from serve_app.config.settings import load_config

    return AutoTokenizer.from_pretrained(load_config(app.args).model)


MODEL = "tiny-llama"
PROMPT = "The river ran past the old mill, and the miller"
MESSAGES = [{"role": "user", "content": "What is the weather today?"}]
IDS = {"return_token_ids": True, "ignore_eos": True}
DISCONNECTS = 5


def test_models_and_health(app):
    models = requests.get(app.base_url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert requests.get(app.base_url + "/health", timeout=10).json() == {"status": "ok"}


def test_completion_text_and_usage_match_tokens(app, client, tokenizer):
    trace = {"X-Request-Id": "trace-4bf92f35"}  # names the response, as on vLLM's server
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=IDS, extra_headers=trace)
    assert out.id == "cmpl-trace-4bf92f35"
    choice = out.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))  # BOS + the prompt's tokens
    assert out.usage.completion_tokens == len(token_ids) == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    assert choice.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert out.model == MODEL
    wait_idle(app)


def test_greedy_is_deterministic_and_stream_matches(app, client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, extra_body=IDS)
    second = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, extra_body=IDS)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].model_extra["token_ids"] == second.choices[0].model_extra["token_ids"]

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IDS,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert text == first.choices[0].text
    assert streamed_ids == first.choices[0].model_extra["token_ids"]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 32 and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens
    wait_idle(app)


def test_chat_stream_and_non_stream(app, client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0, extra_body=IDS)
    message = full.choices[0].message
    assert message.role == "assistant"
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert full.usage.completion_tokens == 20
    assert message.content == tokenizer.decode(full.choices[0].model_extra["token_ids"], skip_special_tokens=True)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IDS,
        )
    )
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    wait_idle(app)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]


def test_a_named_tool_call_through_the_openai_client(app, client):
    """``tool_choice`` naming a function: the reply is a call of it whose arguments the engine's
    grammar held to the function's schema, streamed as vLLM's server streams it."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_completion_tokens": 300, "temperature": 0}
    full = client.chat.completions.create(**request)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "stop" and not message.content
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert set(arguments) == {"city", "days"} and len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 14

    chunks = list(client.chat.completions.create(**request, stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id and all(c.index == 0 for c in calls)
    assert "".join(c.function.arguments for c in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(app)


def test_a_required_tool_call_through_the_openai_client(app, client):
    """``tool_choice: "required"``: the engine's grammar holds the output to an array of calls of
    the tools (one, with ``parallel_tool_calls: false``); the reply is that call, whole in one
    delta when streamed, ``finish_reason`` "tool_calls"."""
    request = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_completion_tokens": 300,
        "temperature": 0,
    }
    full = client.chat.completions.create(**request)
    assert full.choices[0].finish_reason == "tool_calls" and not full.choices[0].message.content
    (call,) = full.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name in {"get_weather", "now"} and call.id
    assert set(arguments) == ({"city", "days"} if call.function.name == "get_weather" else set())

    chunks = list(client.chat.completions.create(**request, stream=True))
    (streamed,) = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert (streamed.function.name, streamed.function.arguments, streamed.index) == (call.function.name, call.function.arguments, 0)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    wait_idle(app)


def test_handle_api_matches_http(app, client):
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    handle = app.handle
    final = handle.complete.remote(request).result(timeout_s=120)
    assert final["choices"][0]["text"] == http.choices[0].text
    assert final["usage"]["completion_tokens"] == 16

    events = list(handle.options(stream=True).generate.remote({**request, "stream_options": {"include_usage": True}}))
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == http.choices[0].text
    assert events[-1]["usage"]["completion_tokens"] == 16

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    chat_final = handle.complete.remote(chat).result(timeout_s=120)
    chat_events = list(handle.options(stream=True).generate.remote(chat))
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in chat_events if e.get("choices"))
    assert streamed == chat_final["choices"][0]["message"]["content"]
    assert handle.complete.remote({"messages": []}).result(timeout_s=30)["error"]["type"] == "invalid_request_error"
    wait_idle(app)


def test_tokenize_gives_the_ids_the_engines_get_and_detokenize_their_text(app, tokenizer):
    """vLLM's /tokenize and /detokenize, over HTTP and the handle API (router/tokenization.py)."""
    url = app.base_url
    for tokenize, path in (({"prompt": PROMPT}, "/v1/completions"), ({"messages": MESSAGES}, "/v1/chat/completions")):
        counted = requests.post(url + "/tokenize", json={**tokenize, "model": MODEL}, timeout=30).json()
        assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 2048
        assert app.handle.tokenize.remote(tokenize).result(timeout_s=30) == counted
        served = requests.post(url + path, json={**tokenize, "max_tokens": 4, **IDS}, timeout=120).json()
        assert served["usage"]["prompt_tokens"] == counted["count"]
        assert (served.get("prompt_token_ids") or served["choices"][0]["prompt_token_ids"]) == counted["tokens"]
        text = requests.post(url + "/detokenize", json={"tokens": counted["tokens"]}, timeout=30).json()
        assert text == {"prompt": tokenizer.decode(counted["tokens"])}
        assert app.handle.detokenize.remote({"tokens": counted["tokens"]}).result(timeout_s=30) == text
    assert counted["tokens"][:1] == [tokenizer.bos_token_id] and "<|assistant|>" in text["prompt"]  # the chat template's
    refused = requests.post(url + "/detokenize", json={"tokens": [1, 10**6]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert app.handle.tokenize.remote({"messages": []}).result(timeout_s=30)["error"]["param"] == "messages"
    wait_idle(app)


BAD_INPUTS: list[tuple[str, str | bytes, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", json.dumps({"model": MODEL}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({"model": MODEL}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": 12}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "many"}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -3}), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_completion_tokens": 0}), 400, "max_completion_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 100000}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "no-such-model"}), 404, "model"),
    ("/v1/completions", json.dumps({"prompt": "the river " * 1200, "max_tokens": 4}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 0}), 400, "n"),
    ("/v1/chat/completions", json.dumps({"messages": MESSAGES, "n": 129}), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": [1, 5, 999999]}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}), 400, "stream_options"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_input_gets_openai_error(app, path, body, status, param):
    started = time.monotonic()
    response = requests.post(app.base_url + path, data=body, headers={"content-type": "application/json"}, timeout=30)
    assert time.monotonic() - started < 10, "a bad request must be refused at once"
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and isinstance(error["message"], str)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    # Also streaming: refused before any event, with the same status.
    if isinstance(body, str) and body.startswith("{"):
        streamed = requests.post(app.base_url + path, data=json.dumps({**json.loads(body), "stream": True}), timeout=30)
        if param != "stream_options":
            assert streamed.status_code == status, streamed.text


def test_bad_input_leaves_nothing_behind(app):
    for path, body, _, _ in BAD_INPUTS:
        requests.post(app.base_url + path, data=body, timeout=30)
    snap = wait_idle(app)
    assert snap["router"]["inflight"] == 0


def test_client_disconnect_mid_stream_releases_everything(app):
    logs = LogWatch()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    for _ in range(DISCONNECTS):
        with requests.post(app.base_url + "/v1/completions", json=body, stream=True, timeout=60) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith(b"data: ") for line in got)
            busy = app.snapshot()
            assert busy["router"]["inflight"] == 1
        wait_idle(app)
    time.sleep(1.0)  # let the log files catch up
    text = logs.new_text()
    # One line per disconnect in the router's log; nothing prints a traceback for them.
    assert logs.new_text(under="serve").count("the client went away") == DISCONNECTS, text[-3000:]
    assert "Task exception was never retrieved" not in text and "Traceback" not in text, text[-3000:]


# vLLM's own engine metrics (its Ray stat logger), by the names Ray exports them under.
VLLM_ENGINE_METRICS = [
    "ray_vllm_num_requests_running{",
    "ray_vllm_num_requests_waiting{",
    "ray_vllm_kv_cache_usage_perc{",
    "ray_vllm_prefix_cache_queries_total{",
    "ray_vllm_prompt_tokens_total{",
    "ray_vllm_time_to_first_token_seconds_bucket{",
    "ray_vllm_request_success_total{",
]


def test_metrics_exported_after_traffic(app, client, cluster):
    """pd-serve's own metrics of this app's traffic, and vLLM's engine metrics for every engine,
    labelled with the engine's name and role (README, Monitoring)."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True).close()
    requests.post(app.base_url + "/v1/completions", json={"prompt": "hi", "n": 0}, timeout=30)
    wanted = [
        ("ray_pd_requests_total{", 'status="200"'),
        ("ray_pd_errors_total{", 'kind="invalid_request"'),
        ("ray_pd_ttft_seconds_bucket{", ""),
        ("ray_pd_tpot_seconds_bucket{", ""),
        ("ray_pd_request_seconds_bucket{", 'route="completions"'),
        ("ray_pd_engine_wait_seconds_bucket{", 'route="completions"'),
        ("ray_pd_router_seconds_bucket{", 'route="completions"'),
        ("ray_pd_attempts_per_request_bucket{", ""),
        ("ray_pd_kv_ready_seconds_bucket{", ""),
        ("ray_pd_prefill_seconds_bucket{", ""),
        ("ray_pd_kv_push_bytes_total{", 'engine="prefill-0"'),
        ("ray_pd_kv_pushes_total{", 'engine="prefill-0"'),
        ("ray_pd_kv_push_seconds_bucket{", 'engine="prefill-0"'),
        ("ray_pd_inflight{", 'role="decode"'),
        ("ray_pd_inflight{", 'role="router"'),
        ("ray_pd_engine_kv_usage{", 'engine="decode-0"'),
        ("ray_pd_leak_requests{", 'engine="decode-0"'),
        ("ray_pd_leak_kv_tokens{", 'engine="prefill-0"'),
    ]
    for engine, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        wanted += [(name, f'engine="{engine}"') for name in VLLM_ENGINE_METRICS]
        wanted.append(("ray_vllm_num_requests_running{", f'role="{role}"'))
    wait_for_metrics(cluster.metrics_port, wanted)
    wait_idle(app)


def _replica_processes(app_name: str) -> dict[str, psutil.Process]:
    """The app's replica processes: "router", and "prefill-0", "decode-0", ... (one deployment
    per role; its replicas numbered here in the order found)."""
    found: dict[str, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        for deployment in ("router", "prefill", "decode"):
            # Ray's process title may carry the method running (":decode.__call__"): the name
            # must end at a character no deployment name has.
            if re.search(rf"ServeReplica:{re.escape(app_name)}:{deployment}(?![\w-])", cmd):
                if deployment == "router":
                    found["router"] = proc
                else:
                    found[f"{deployment}-{sum(k.startswith(deployment) for k in found)}"] = proc
    return found


def _per_thread(proc, read) -> list:
    """``read(thread_id)`` for each of the process's threads, skipping any that ended meanwhile."""
    values = []
    for thread in proc.threads():
        try:
            values.append(read(thread.id))
        except OSError:  # ended meanwhile
            pass
    return values


def _thread_masks(proc) -> set[frozenset[int]]:
    import os

    return {frozenset(mask) for mask in _per_thread(proc, os.sched_getaffinity)}


def _engine_core_and_worker(replica):
    children = replica.children(recursive=True)
    core = [c for c in children if c.name().startswith("VLLM::EngineCor")]
    workers = [c for c in children if c.name().startswith("VLLM::Worker")]
    assert len(core) == 1 and workers, f"engine processes of {replica.pid}: {[c.name() for c in children]}"
    return core[0], workers[0]


@pytest.mark.parametrize("which", ["disaggregated", "colocated"])
def test_engine_cores_share_their_workers_cores_and_replicas_keep_off_them(which, app, baseline_app):
    """runtime/cpu_placement.py: every thread of an engine's EngineCore runs on its worker's cores; the
    router and engine replicas run on the cores no engine is bound to, where there are any."""
    import os

    deployed = app if which == "disaggregated" else baseline_app
    replicas = _replica_processes(deployed.name)
    engines = [role for role in ("prefill-0", "decode-0") if role in replicas]
    assert "router" in replicas and engines, replicas
    host = frozenset(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("a host with one core cannot tell a bound process from a free one")
    bound: set[int] = set()
    for role in engines:
        core, worker = _engine_core_and_worker(replicas[role])
        cores = frozenset(os.sched_getaffinity(worker.pid))
        assert cores < host  # the CPU backend binds each engine's worker
        assert _thread_masks(core) == {cores}
        bound |= cores
    spare = host - bound
    expected = {spare} if spare else {host}
    for role, proc in replicas.items():
        assert _thread_masks(proc) == expected, role


def _thread_names(proc) -> list[str]:
    def comm(thread_id: int) -> str:
        with open(f"/proc/{proc.pid}/task/{thread_id}/comm") as f:
            return f.read().strip()

    return _per_thread(proc, comm)


def test_engine_workers_keep_one_gloo_loop_thread(app):
    """gloo_device.py: a CPU worker's Gloo process groups share one device, so one loop thread
    wakes every 10 ms on the worker's cores instead of one per group (13 on vLLM 0.32)."""
    replicas = _replica_processes(app.name)
    for role in ("prefill-0", "decode-0"):
        _, worker = _engine_core_and_worker(replicas[role])
        names = _thread_names(worker)
        assert sum(name.startswith("gloo") for name in names) == 1, (role, sorted(names))
