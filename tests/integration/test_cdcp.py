"""Decode-first disaggregation on real vLLM CPU engines: 2 prefill + 2 decode engines, the
layerwise push connector, the metaserver relay, and faults injected by the test-only seams of
tests/support/faults.py (requested through the prompt)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from tests.support.cluster import (
    KV_PORT_BLOCK,
    LogWatch,
    busy_engine,
    completion_ids,
    deployed,
    engine_handles,
    free_ports,
    inspect,
    metric_lines,
    post,
    sse_chunks,
    token_pattern,
    wait_for_metrics,
    wait_healthy,
    wait_idle,
)
from tests.support.faults import BREAK_PUSH, CORRUPT_KV, FAULTS, PREFILL_RAISE, PUSH_DELAY, SKIP_METASERVER, faulty_prompt
from tests.support.inprocess import vllm_logprob_texts

pytestmark = pytest.mark.engine

NUM_LAYERS = 2
BLOCK = 128

# Prompts up to this long are prefilled by their decode engine (router.local_prefill_max_tokens).
LOCAL_PREFILL = 8
# While every prefill engine holds this many of the router's prompt tokens, any prompt is
# (router.local_prefill_queue_tokens): more than the other tests ever queue on both engines.
QUEUE_BOUND = 3000
ARGS = {
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    # One prefill step per prompt (no chunking), so "one push per layer" is exact.
    "engine_kwargs": {"kv_cache_memory_bytes": 64 << 20, "max_num_batched_tokens": 2048},
    "prefill": {"num_replicas": 2, "num_cpus": 0.2},
    "decode": {"num_replicas": 2, "num_cpus": 0.2},
    "router": {
        "mode": "disaggregated",
        "local_prefill_max_tokens": LOCAL_PREFILL,
        "local_prefill_queue_tokens": QUEUE_BOUND,
        "tool_call_parser": "hermes",
        "num_cpus": 0.1,
        "max_attempts": 3,
        "timeouts": {"kv_ready_s": 5, "prefill_s": 20, "first_token_s": 30, "request_s": 120},
    },
}


@dataclass
class HeldPort:
    """A port this process listens on before the app starts: the one the config gives decode-0's
    KV side channel (as a leftover process would hold it)."""

    kv_port_base: int  # the app's
    port: int
    logs: LogWatch  # Ray's logs from before the app's start


@pytest.fixture(scope="module")
def held_kv_port(cluster) -> Iterator[HeldPort]:
    import socket

    from serve_app.config.backends import KV_PORT_STRIDE, kv_port_offset
    from serve_app.config.settings import load_config

    base = free_ports(KV_PORT_BLOCK, align=16)
    port = base + KV_PORT_STRIDE * kv_port_offset(load_config(ARGS), "decode")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        yield HeldPort(kv_port_base=base, port=port, logs=LogWatch())


@pytest.fixture(scope="module")
def app(cluster, held_kv_port):
    """The module's app; every test here runs with decode-0 on a KV port other than its config's."""
    with deployed(cluster, "pd2x2", {**ARGS, "kv_port_base": held_kv_port.kv_port_base}, FAULTS) as app:
        yield app


LENGTHS = [1, 5, 64, 127, 128, 129, 200, 255, 256, 257, 384, 500, 640, 700, 1000, 1500]


def test_token_exact_versus_colocated_and_kv_really_transferred(app, baseline_app):
    shared = token_pattern(300, seed=1)
    prompts = [token_pattern(n, seed=100 + n) for n in LENGTHS]
    # A prefix already cached on decode: the same 300 tokens, then different tails. Sent after
    # the shared prompt itself, both decode engines hold its blocks by the time the tails come.
    prompts += [shared, shared] + [shared + token_pattern(k, seed=200 + k) for k in (1, 40, 128, 300)]
    assert len(prompts) >= 20
    ids = []
    for prompt in prompts:
        response_id, got = completion_ids(app, prompt)
        _, want = completion_ids(baseline_app, prompt)
        assert got == want, f"prompt of {len(prompt)} tokens: disaggregated {got} != colocated {want}"
        ids.append((response_id + "-1", len(prompt)))
    wait_idle(app)

    attempt_ids = [i for i, _ in ids]
    decode = inspect(app, "decode", attempt_ids)
    prefill = inspect(app, "prefill", attempt_ids)
    cached_prefix_seen = False
    for attempt_id, prompt_len in ids:
        served = [d for d in decode.values() if d["requests"][attempt_id]]
        assert len(served) == 1, f"{attempt_id} served by {len(served)} decode engines"
        engine = served[0]
        transfer = engine["transfers"][attempt_id]
        request = engine["requests"][attempt_id]
        if prompt_len <= LOCAL_PREFILL:
            # Its decode engine computed it (and still matched colocated, token for token): no
            # prefill engine saw it, nothing was pushed.
            assert transfer is None and not any(p["transfers"][attempt_id] for p in prefill.values()), attempt_id
            continue
        if transfer is None:
            # Only a prompt the decode engine held entirely already needs no transfer.
            assert request["num_cached_tokens"] == prompt_len, (attempt_id, request)
            continue
        assert transfer["outcome"] == "done" and transfer["layers_received"] == NUM_LAYERS
        assert 0 < transfer["tokens_received"] <= prompt_len
        cached_prefix_seen |= transfer["tokens_received"] < prompt_len
        # Decode computed no prompt token itself: each one was in its prefix cache or received
        # from prefill. (vLLM re-runs the last position once to get logits for the first token;
        # its stats count that position as computed for a one-token prompt, hence the -1.)
        assert request["num_cached_tokens"] >= prompt_len - 1, (attempt_id, request)
        pushed = [p["transfers"][attempt_id] for p in prefill.values() if p["transfers"][attempt_id]]
        assert len(pushed) == 1 and pushed[0]["outcome"] == "done"
        assert pushed[0]["tokens_pushed"] == transfer["tokens_received"]
    assert cached_prefix_seen, "no request found its prefix cached on the decode engine"


def test_n_seeded_samples_and_several_prompts_through_disaggregated_engines(app, baseline_app):
    """A prompt's n samples are its one-sample requests seeded seed, seed + 1, ... (as vLLM's
    engine seeds a prompt's samples), each disaggregated; several prompts come back each at its
    index with the same tokens as alone; streamed, the same choices."""
    prompt = token_pattern(200, seed=71)
    sampled = {"max_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True, "return_token_ids": True}
    response = post(app, "/v1/completions", {"prompt": prompt, "n": 3, **sampled})
    assert response.status_code == 200, response.text
    data = response.json()
    samples = {c["index"]: c["token_ids"] for c in data["choices"]}
    for i in range(3):
        alone = post(baseline_app, "/v1/completions", {"prompt": prompt, **sampled, "seed": 1234 + i}).json()
        assert samples[i] == alone["choices"][0]["token_ids"], i
    assert len({tuple(tokens) for tokens in samples.values()}) == 3  # three samples, not one thrice
    assert data["usage"] == {"prompt_tokens": 200, "completion_tokens": 36, "total_tokens": 236}
    wait_idle(app)
    attempts = [f"{data['id']}-{i}-1" for i in range(3)]
    prefill, decode = inspect(app, "prefill", attempts), inspect(app, "decode", attempts)
    assert any(p["transfers"][attempts[0]] for p in prefill.values())  # the first sample's prompt went to a prefill engine
    for later in attempts[1:]:  # the others came after it: the prompt's full block was in a cache
        records = [e["requests"][later] for e in (*prefill.values(), *decode.values()) if e["requests"][later]]
        assert records and max(r.get("num_cached_tokens") or 0 for r in records) >= BLOCK, (later, records)

    streamed: dict[int, list[int]] = {}
    response = post(app, "/v1/completions", {"prompt": prompt, "n": 3, **sampled, "stream": True})
    for chunk in sse_chunks(response):
        for choice in chunk["choices"]:
            streamed.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    assert streamed == samples

    prompts = [token_pattern(150, seed=72), token_pattern(60, seed=73)]
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = post(app, "/v1/completions", {"prompt": prompts, **greedy})
    assert response.status_code == 200, response.text
    assert [c["token_ids"] for c in response.json()["choices"]] == [completion_ids(baseline_app, p)[1] for p in prompts]
    wait_idle(app)


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_the_engine_computes_them(app, tiny_tokenizer):
    """What evaluation harnesses read a text's likelihood from (lm-eval's loglikelihood: several
    prompts, echo, logprobs, one token): each prompt token's logprob, served colocated. A
    prompt's own tokens past a point are a greedy output the engine produced: their echoed
    logprobs are the ones the engine gave when it sampled them."""
    prompt = token_pattern(150, seed=74)
    response = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1})
    first = response.json()["choices"][0]["logprobs"]
    output = completion_ids(app, prompt, max_tokens=8)[1]
    body = {"prompt": [prompt + output, prompt], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "return_token_ids": True}
    response = post(app, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    echoed = choices[0]["logprobs"]
    assert len(echoed["token_logprobs"]) == len(prompt) + len(output) + 1 and echoed["token_logprobs"][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in echoed["token_logprobs"][1:])
    assert echoed["tokens"][len(prompt) : len(prompt) + 8] == first["tokens"]
    assert echoed["token_logprobs"][len(prompt) : len(prompt) + 8] == pytest.approx(first["token_logprobs"], abs=1e-3)
    # The second prompt, the first's beginning alone: the same logprobs for the same tokens.
    assert choices[1]["logprobs"]["token_logprobs"][: len(prompt)] == pytest.approx(echoed["token_logprobs"][: len(prompt)], abs=1e-3)
    # A prompt's samples share the first's prompt logprobs; the others read the prompt's cache.
    both = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 1.0, "echo": True, "logprobs": 1})
    choices = both.json()["choices"]
    assert choices[0]["logprobs"]["token_logprobs"][: len(prompt)] == choices[1]["logprobs"]["token_logprobs"][: len(prompt)]
    assert choices[0]["logprobs"]["token_logprobs"][: len(prompt)] == pytest.approx(echoed["token_logprobs"][: len(prompt)], abs=1e-3)
    # No output (max_tokens 0, what scoring clients send): the prompt's alone.
    alone = post(app, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert alone["token_logprobs"] == pytest.approx(echoed["token_logprobs"][: len(prompt)], abs=1e-3)
    # vLLM's prompt_logprobs field: each token's logprob (the echo's), rank and text, then the top
    # 2, best first; the greedy output's tokens, in the prompt now, rank first.
    response = post(app, "/v1/completions", {"prompt": prompt + output, "max_tokens": 1, "prompt_logprobs": 2})
    field = response.json()["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(prompt) + len(output)
    for position in range(1, len(field)):
        entries = field[position]
        own = entries[str((prompt + output)[position])]
        assert next(iter(entries.values())) is own and own["logprob"] == pytest.approx(echoed["token_logprobs"][position], abs=1e-3)
        assert own["decoded_token"] == echoed["tokens"][position] and own["rank"] >= 1
        ranked = sorted(entries.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == ([1, 2] if own["rank"] <= 2 else [1, 2, own["rank"]])
        assert all(a["logprob"] >= b["logprob"] - 1e-6 for a, b in zip(ranked, ranked[1:]))
    assert all(next(iter(field[len(prompt) + i].values()))["rank"] == 1 for i in range(len(output)))
    # Each token's text as vLLM's own engine writes it (a multi-byte character's pieces read together).
    texts = [next(iter(entries.values()))["decoded_token"] for entries in field[1:]]
    assert texts == vllm_logprob_texts(tiny_tokenizer, (prompt + output)[1:])
    wait_idle(app)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_through_disaggregated_engines(app, baseline_app):
    """A JSON schema (chat's response_format) and a regex (completions' structured_outputs): the
    decode engine samples under the grammar with KV pushed by a prefill engine, token for token
    what a colocated engine samples, and the response matches the grammar; an invalid schema gets
    a 400 that says what is wrong with it (vLLM's check, when the decode engine admits it)."""
    chat = {
        "messages": [{"role": "user", "content": "Who is it?"}],
        "max_tokens": 200,
        "temperature": 0,
        "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    }
    want = post(baseline_app, "/v1/chat/completions", chat).json()["choices"][0]
    response = post(app, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == "stop"
    document = json.loads(got["message"]["content"])
    assert set(document) == {"name", "age"} and isinstance(document["age"], int) and len(document["name"]) <= 12

    regex = r"\[(\d{1,3},){20}\d{1,3}\]"
    prompt = " ".join(f"w{i % 97}" for i in range(120))  # long enough to be prefilled by a prefill engine
    response_id, got_ids = completion_ids(app, prompt, max_tokens=200, ignore_eos=False, structured_outputs={"regex": regex})
    _, want_ids = completion_ids(baseline_app, prompt, max_tokens=200, ignore_eos=False, structured_outputs={"regex": regex})
    assert got_ids == want_ids
    body = {"prompt": prompt, "max_tokens": 200, "temperature": 0, "structured_outputs": {"regex": regex}}
    text = post(app, "/v1/completions", body).json()["choices"][0]["text"]
    assert re.fullmatch(regex, text), text
    wait_idle(app)
    attempt = response_id + "-1"
    (pushed,) = [p["transfers"][attempt] for p in inspect(app, "prefill", [attempt]).values() if p["transfers"][attempt]]
    assert pushed["outcome"] == "done"

    bad = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no such type"}}}}
    response = post(app, "/v1/chat/completions", bad)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "invalid type: no such type" in error["message"].lower(), error
    wait_idle(app)


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
# One call in hermes' format, which a client's grammar makes the random model write.
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "days": [1-9]\}\}\n</tool_call>'


def test_auto_tool_calls_are_read_by_the_models_parser_through_disaggregated_engines(app, baseline_app):
    """``router.tool_call_parser: hermes``: with tools, ``tool_choice`` "auto" (the default) is
    served, and vLLM's hermes parser reads the calls out of the reply's text. The engines sample,
    with KV pushed by a prefill engine, the tokens a colocated engine samples for the same
    grammar (there with ``tool_choice: none``: the call as text), and the reply is that call,
    streamed or not; without a call in the text, the reply is the text."""
    chat = {
        "messages": [{"role": "user", "content": " ".join(f"w{i % 89}" for i in range(40)) + " Weather in Oslo?"}],
        "tools": WEATHER_TOOLS,
        "max_tokens": 120,
        "temperature": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,  # what hermes' parser sets
        "structured_outputs": {"regex": HERMES_CALL},
    }
    want = post(baseline_app, "/v1/chat/completions", {**chat, "tool_choice": "none"}).json()["choices"][0]
    assert re.fullmatch(HERMES_CALL, want["message"]["content"]), want
    arguments = json.loads(want["message"]["content"].split("\n")[1])["arguments"]

    response = post(app, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == "tool_calls" and not got["message"]["content"]
    (call,) = got["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == arguments and call["id"]
    wait_idle(app)
    attempt = response.json()["id"] + "-1"
    (pushed,) = [p["transfers"][attempt] for p in inspect(app, "prefill", [attempt]).values() if p["transfers"][attempt]]
    assert pushed["outcome"] == "done"

    with requests.post(app.base_url + "/v1/chat/completions", json={**chat, "stream": True}, stream=True, timeout=180) as streamed:
        assert streamed.status_code == 200, streamed.text
        choices = [chunk["choices"][0] for chunk in sse_chunks(streamed) if chunk["choices"]]
    calls = [c for choice in choices for c in choice["delta"].get("tool_calls") or ()]
    assert {c["index"] for c in calls} == {0} and [c["function"]["name"] for c in calls if c.get("id")] == ["get_weather"]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == arguments
    assert not "".join(choice["delta"].get("content") or "" for choice in choices) and choices[-1]["finish_reason"] == "tool_calls"

    free = {**chat, "max_tokens": 24, "ignore_eos": True}
    del free["structured_outputs"]
    want = post(baseline_app, "/v1/chat/completions", {**free, "tool_choice": "none"}).json()["choices"][0]
    got = post(app, "/v1/chat/completions", free).json()["choices"][0]
    assert got["token_ids"] == want["token_ids"] and got["message"]["content"] == want["message"]["content"]
    assert not got["message"].get("tool_calls") and got["finish_reason"] == "length"
    wait_idle(app)


# Strict tools: the structural tag holds a call's arguments to the schema (short, so the random
# model's call ends well within its budget).
STRICT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "strict": True, "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]


def test_named_and_required_calls_are_written_in_the_models_format_and_read_by_its_parser(app, baseline_app, tiny_tokenizer):
    """With hermes as the tool-call parser (vLLM 0.32: a format xgrammar knows, so vLLM's server
    does not force its JSON), a named or required ``tool_choice`` is served as vLLM's server
    serves it: hermes' structural tag holds the model to a call in hermes' format, and the parser
    reads it. The disaggregated engines sample the tokens a colocated engine samples for that
    grammar (given as a client's, ``tool_choice: none``), and the reply is the call, content "",
    streamed or not, "stop" for a named choice and "tool_calls" for a required one."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from serve_app.router.output_parsers import load_parser

    chat = {
        "messages": [{"role": "user", "content": " ".join(f"w{i % 83}" for i in range(40)) + " Weather in Oslo?"}],
        "tools": STRICT_TOOLS,
        "parallel_tool_calls": False,  # one call, in the grammar too
        "max_tokens": 200,
        "temperature": 0,
        "return_token_ids": True,
    }
    hermes = load_parser(tiny_tokenizer, tool="hermes")
    for choice, finish in (({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")):
        body = {**chat, "tool_choice": choice}
        request = ChatCompletionRequest(model="tiny-llama", **body)
        hermes(tiny_tokenizer, request.tools).adjust_request(request)
        tag = request.structured_outputs.structural_tag
        assert tag is not None and "<tool_call>" in tag, "vLLM's hermes parser gave no structural tag for this choice"
        colocated = {**chat, "tool_choice": "none", "skip_special_tokens": False, "structured_outputs": {"structural_tag": tag}}
        want = post(baseline_app, "/v1/chat/completions", colocated).json()["choices"][0]
        text = want["message"]["content"]
        assert want["finish_reason"] == "stop" and text.startswith("<tool_call>") and text.endswith("</tool_call>"), want
        written = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))

        response = post(app, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        got = response.json()["choices"][0]
        assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == finish and got["message"]["content"] == "", got
        (call,) = got["message"]["tool_calls"]
        assert call["id"] and call["function"]["name"] == written["name"]
        assert json.loads(call["function"]["arguments"]) == written["arguments"]

        with requests.post(app.base_url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=180) as streamed:
            assert streamed.status_code == 200, streamed.text
            choices = [chunk["choices"][0] for chunk in sse_chunks(streamed) if chunk["choices"]]
        calls = [c for one in choices for c in one["delta"].get("tool_calls") or ()]
        assert [c["function"]["name"] for c in calls if c.get("id")] == [written["name"]] and {c["index"] for c in calls} == {0}
        assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == written["arguments"]
        assert not "".join(one["delta"].get("content") or "" for one in choices) and choices[-1]["finish_reason"] == finish
    wait_idle(app)


def test_corrupted_kv_changes_the_output(app, baseline_app):
    # Used by this test only: the corrupt KV stays in that cache.
    prompt = faulty_prompt(CORRUPT_KV, token_pattern(600, seed=7))
    _, want = completion_ids(baseline_app, prompt)
    _, corrupted = completion_ids(app, prompt)
    assert corrupted != want
    wait_idle(app)


def test_one_push_per_layer_and_the_first_before_the_forward_ends(app):
    # The router falls back to colocated while it sees no healthy prefill engine (a stats poll
    # that timed out on a loaded host, after the previous test): this request must be pushed.
    wait_healthy(app)
    prompt = token_pattern(1800, seed=11)
    response_id, _ = completion_ids(app, prompt, max_tokens=4)
    attempt_id = response_id + "-1"
    # The prefill engine's record rides with its engine's stats, which can come after the
    # response: decode may stream its 4 tokens (and the attempt end, cancelling the prefill call)
    # before the prefill step that waited for decode's ack has reported.
    deadline = time.monotonic() + 10
    while True:
        records = [p["transfers"][attempt_id] for p in inspect(app, "prefill", [attempt_id]).values()]
        pushed = [r for r in records if r]
        if pushed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(pushed) == 1, (records, [d["transfers"] for d in inspect(app, "decode", [attempt_id]).values()])
    (record,) = pushed
    assert record["steps"] == 1 and record["layers_pushed"] == NUM_LAYERS
    times = record["push_times"]
    assert len(times) == NUM_LAYERS and times == sorted(times)
    assert record["first_layer_sent_at"] < record["forward_done_at"]
    assert record["tokens_pushed"] == 1800
    decode = [d["transfers"][attempt_id] for d in inspect(app, "decode", [attempt_id]).values()]
    (received,) = [r for r in decode if r]
    assert received["frames_received"] == NUM_LAYERS and received["first_layer_at"] <= received["last_layer_at"]
    wait_idle(app)


def test_concurrent_requests_use_every_engine_and_release_everything(app, baseline_app):
    prompts = [token_pattern(50 + 97 * i, seed=300 + i) for i in range(16)]
    results: dict[int, tuple[str, list[int]]] = {}

    def run(i: int) -> None:
        results[i] = completion_ids(app, prompts[i], max_tokens=24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == len(prompts)
    attempt_ids = [results[i][0] + "-1" for i in range(len(prompts))]
    for role in ("decode", "prefill"):
        used = {
            name: sum(1 for a in attempt_ids if info["requests"][a] is not None) for name, info in inspect(app, role, attempt_ids).items()
        }
        assert len(used) == 2 and all(n > 0 for n in used.values()), f"{role} engines idle under load: {used}"
    for i, prompt in enumerate(prompts):
        assert results[i][1] == completion_ids(baseline_app, prompt, max_tokens=24)[1]
    snap = wait_idle(app)
    assert all(e["kv_usage"] == 0.0 and e["engine_inflight"] == 0 for e in snap["engines"].values())


def test_while_every_prefill_line_is_long_a_prompt_is_prefilled_by_its_decode_engine(app, baseline_app, cluster):
    """router.local_prefill_queue_tokens: with both prefill engines' vLLM processes stopped
    (SIGSTOP: their replicas still answer, so the router sees them healthy), prompts pile up in
    their lines until both are at the bound; a prompt sent then is prefilled by its decode engine
    instead of waiting (token-exact, nothing pushed, counted as
    pd_fallback_total{reason="prefill_queue"}); once the engines go on, the prompts in line end
    token-exact, and with the lines short prompts go to a prefill engine again."""
    import psutil

    wait_healthy(app)
    replicas = {name: psutil.Process(info["pid"]) for name, info in inspect(app, "prefill", []).items()}
    engines = [child for replica in replicas.values() for child in replica.children(recursive=True)]
    assert len(engines) >= 2 * len(replicas), engines  # each: vLLM's engine core and its worker
    held: list[list[int]] = []
    results: dict[int, list[int]] = {}

    def queued() -> dict[str, int]:
        return {n: e["router_reserved_tokens"] for n, e in app.snapshot()["engines"].items() if e["role"] == "prefill"}

    def send(i: int) -> None:
        results[i] = completion_ids(app, held[i], max_tokens=4)[1]

    threads: list[threading.Thread] = []
    for process in engines:
        process.suspend()
    try:
        # One at a time, so that each is in a line before the next is sent: while either line is
        # below the bound a prompt joins one (the balancer's choice), so they fill up.
        while min(queued().values()) < QUEUE_BOUND:
            assert len(held) < 12, f"the lines never reached the bound: {queued()}"
            held.append(token_pattern(1000, seed=600 + len(held)))
            threads.append(threading.Thread(target=send, args=(len(held) - 1,)))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while sum(queued().values()) < 1000 * len(held):
                assert time.monotonic() < deadline, f"prompt {len(held)} never reached a prefill engine's line: {queued()}"
                time.sleep(0.05)
        prompt = token_pattern(700, seed=650)
        response_id, got = completion_ids(app, prompt)
        assert min(queued().values()) >= QUEUE_BOUND  # nothing left the lines meanwhile
    finally:
        for process in engines:
            process.resume()
        for thread in threads:
            thread.join(timeout=120)
    assert got == completion_ids(baseline_app, prompt)[1]
    attempt_id = response_id + "-1"
    assert all(d["transfers"][attempt_id] is None for d in inspect(app, "decode", [attempt_id]).values())
    assert not any(p["transfers"][attempt_id] for p in inspect(app, "prefill", [attempt_id]).values())
    assert [results.get(i) for i in range(len(held))] == [completion_ids(baseline_app, p, max_tokens=4)[1] for p in held]
    wait_idle(app)
    prompt = token_pattern(700, seed=651)  # not in any cache
    response_id, got = completion_ids(app, prompt)
    assert got == completion_ids(baseline_app, prompt)[1]
    attempt_id = response_id + "-1"
    assert any(p["transfers"][attempt_id] for p in inspect(app, "prefill", [attempt_id]).values())
    wait_for_metrics(cluster.metrics_port, [("ray_pd_fallback_total{", 'reason="prefill_queue"')])
    wait_idle(app)


def test_a_busy_kv_port_is_replaced_by_a_free_one(app, held_kv_port, baseline_app):
    """Something (this test process, held_kv_port) holds the port the config gives decode-0's KV
    side channel: the engine starts on a free port instead, says so naming the holder, posts its
    real port with every KVReady, and prompts it decodes are prefilled elsewhere token-exact."""
    held = held_kv_port
    endpoint = app.snapshot()["engines"]["decode-0"]["kv_endpoint"]
    assert endpoint["port"] != held.port and endpoint["host"] == "127.0.0.1"
    text = held.logs.new_text()
    assert f"KV port {held.port} on 127.0.0.1 is in use by pid {os.getpid()}" in text, text[-2000:]
    # Prompts until decode-0 has decoded two (the balancer sends each where its prefix hashes).
    on_decode_0 = 0
    for i in range(16):
        prompt = token_pattern(200, seed=901 + i)
        response_id, tokens = completion_ids(app, prompt, max_tokens=8)
        attempt = response_id + "-1"
        decode_0 = inspect(app, "decode", [attempt])["decode-0"]
        if decode_0["requests"][attempt] is None:
            continue
        transfer = decode_0["transfers"][attempt]  # the prompt's KV came through the replaced port
        assert transfer is not None and transfer["outcome"] == "done" and transfer["layers_received"] == NUM_LAYERS, transfer
        assert tokens == completion_ids(baseline_app, prompt, max_tokens=8)[1]
        on_decode_0 += 1
        if on_decode_0 == 2:
            break
    assert on_decode_0 == 2, "decode-0 got too few of 16 prompts"
    wait_idle(app)


def test_hostile_peers_on_the_kv_port_change_nothing(app, baseline_app):
    """While real transfers run, something else on the host connects to each decode engine's KV
    port and sends garbage, an oversize header, and well-formed frames without the transfer's
    secret for the attempts in flight. Every real request still ends token-exact, and the
    decode engines stay healthy and release everything."""
    import socket

    import torch

    from serve_app.kv.wire import KIND_LAYER, MAGIC, PREAMBLE, WIRE_VERSION, compat_hash, encode_frame

    # The tiny model's KV layout on the CPU backend: 2 layers of [blocks, 2 kv heads, 128, 2 * 32].
    compat = compat_hash(torch.float32, (2, BLOCK, 64), BLOCK, NUM_LAYERS)

    endpoints = {n: e["kv_endpoint"] for n, e in app.snapshot()["engines"].items() if e["role"] == "decode"}
    assert all(endpoints.values()), endpoints
    prompts = [token_pattern(300 + 41 * i, seed=500 + i) for i in range(6)]
    want = [completion_ids(baseline_app, p, max_tokens=16)[1] for p in prompts]
    results: dict[int, list[int]] = {}
    stop = threading.Event()

    decode_handles = engine_handles(app, "decode")

    def in_flight() -> list[str]:
        """Attempt ids the decode engines are serving now (a local peer could learn them from
        logs): frames naming them, without their secret, must change nothing."""
        ids = []
        for handle in decode_handles.values():
            requests_ = handle.inspect.remote(None).result(timeout_s=10)["requests"]
            ids += [rid for rid, record in requests_.items() if record and record.get("finish_reason") is None]
        return ids

    def attack() -> None:
        n = 0
        while not stop.is_set():
            for endpoint in endpoints.values():
                for payload in (
                    b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64,
                    PREAMBLE.pack(MAGIC, WIRE_VERSION, KIND_LAYER, 0, compat, 1 << 30, 1 << 40),
                    b"".join(
                        bytes(p)
                        for p in encode_frame(KIND_LAYER, compat ^ 1, {"transfer": "t", "secret": "s", "layer": "x", "block_ids": [0]})
                    ),
                    *[
                        b"".join(bytes(p) for p in encode_frame(2, compat, {"transfer": tid, "secret": "guess", "frames": 0}))
                        for tid in in_flight()
                    ],
                ):
                    try:
                        with socket.create_connection((endpoint["host"], endpoint["port"]), timeout=2) as sock:
                            sock.sendall(payload)
                    except OSError:
                        pass
                n += 1
            time.sleep(0.01)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, completion_ids(app, prompts[i], max_tokens=16)[1]))
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        stop.set()
        attacker.join()
    assert [results.get(i) for i in range(len(prompts))] == want
    snap = wait_idle(app)
    assert all(e["healthy"] for e in snap["engines"].values())
    side = [e["extra"].get("kv_side_channel", {}) for e in snap["engines"].values() if e["role"] == "decode"]
    assert sum(c.get("broken_connections", 0) for c in side) > 0, side
    assert sum(c.get("rejected_frames", 0) for c in side) > 0, side  # wrong secrets for live transfers


def test_disaggregation_metrics_are_exported_per_engine(app, cluster):
    """Every engine's pd_* gauges, vLLM's own metrics and (for prefill) its KV push metrics."""
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: completion_ids(app, token_pattern(333, seed=71 + i)), range(6)))
    engines = ("prefill-0", "prefill-1", "decode-0", "decode-1")
    wanted = [
        ("ray_pd_kv_ready_seconds_bucket{", ""),
        ("ray_pd_prefill_seconds_bucket{", ""),
        *[("ray_pd_inflight{", f'engine="{name}"') for name in engines],
        *[("ray_pd_engine_kv_usage{", f'engine="{name}"') for name in engines],
        *[("ray_pd_leak_requests{", f'engine="{name}"') for name in engines],
        *[("ray_vllm_num_requests_running{", f'engine="{name}"') for name in engines],
        *[("ray_vllm_kv_cache_usage_perc{", f'engine="{name}"') for name in engines],
        *[("ray_pd_kv_push_bytes_total{", f'engine="{name}"') for name in engines if name.startswith("prefill")],
    ]
    wait_for_metrics(cluster.metrics_port, wanted)
    wait_idle(app)


def test_failing_prefill_is_retried_on_another_engine(app, baseline_app):
    prompt = faulty_prompt(PREFILL_RAISE, token_pattern(400, seed=21))
    response_id, got = completion_ids(app, prompt)
    assert got == completion_ids(baseline_app, prompt)[1]
    first, second = response_id + "-1", response_id + "-2"
    prefill = inspect(app, "prefill", [first, second])
    failed_on = [name for name, p in prefill.items() if (p["requests"][first] or {}).get("fault")]
    served_by = [name for name, p in prefill.items() if p["transfers"][second]]
    assert len(failed_on) == 1 and len(served_by) == 1 and failed_on != served_by
    decode = inspect(app, "decode", [first])
    aborted = [d["transfers"][first] for d in decode.values() if d["transfers"][first]]
    assert aborted and aborted[0]["outcome"] == "aborted"  # its blocks were given back
    wait_idle(app)


def test_a_broken_push_is_reported_by_prefill_and_retried_at_once(app, baseline_app, cluster):
    """The push breaks (decode unreachable from prefill): prefill's call fails with the push's
    error, so the router retries at once instead of waiting for decode's receive deadline."""
    prompt = faulty_prompt(BREAK_PUSH, token_pattern(350, seed=25))
    started = time.monotonic()
    response_id, got = completion_ids(app, prompt)
    assert time.monotonic() - started < 10  # decode's receive deadline here is 30 s
    assert got == completion_ids(baseline_app, prompt)[1]
    first = response_id + "-1"
    pushed = [p["transfers"][first] for p in inspect(app, "prefill", [first]).values() if p["transfers"][first]]
    assert pushed and pushed[0]["outcome"] == "failed" and "push to" in pushed[0]["error"]
    decode = [d["transfers"][first] for d in inspect(app, "decode", [first]).values() if d["transfers"][first]]
    assert decode and decode[0]["outcome"] == "aborted"  # the waiting decode request was freed
    wait_for_metrics(cluster.metrics_port, [("ray_pd_kv_push_failures_total{", "")])
    wait_idle(app)


def test_lost_metaserver_callback_times_out_and_retries(app, baseline_app):
    prompt = faulty_prompt(SKIP_METASERVER, token_pattern(256, seed=31))
    started = time.monotonic()
    _, got = completion_ids(app, prompt)
    assert time.monotonic() - started >= ARGS["router"]["timeouts"]["kv_ready_s"]
    assert got == completion_ids(baseline_app, prompt)[1]
    wait_idle(app)


def test_lost_callbacks_on_every_attempt_end_in_a_clear_error(app):
    started = time.monotonic()
    body = {"prompt": faulty_prompt(SKIP_METASERVER, token_pattern(64, seed=41), attempts=3), "max_tokens": 4}
    response = post(app, "/v1/completions", body)
    elapsed = time.monotonic() - started
    timeouts = ARGS["router"]["timeouts"]
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert "3 attempts" in error["message"] and error["type"] == "timeout"
    assert elapsed < 3 * timeouts["kv_ready_s"] + 20
    wait_idle(app)


def test_prefill_killed_mid_push_then_all_prefill_down_falls_back(app, baseline_app, cluster):
    prompt = faulty_prompt(PUSH_DELAY, token_pattern(900, seed=51))
    want = completion_ids(baseline_app, prompt)[1]
    result: dict[str, object] = {}

    def run() -> None:
        result["value"] = completion_ids(app, prompt)

    thread = threading.Thread(target=run)
    thread.start()
    victim = busy_engine(app, "prefill")
    time.sleep(0.8)  # the first layer is pushed, the second one is not
    pids = {name: info["pid"] for name, info in inspect(app, "prefill", []).items()}
    os.kill(pids[victim], signal.SIGKILL)
    thread.join(timeout=120)
    response_id, got = result["value"]  # type: ignore[misc]
    assert got == want
    second = response_id + "-2"
    served = [name for name, p in inspect(app, "prefill", [second], skip=(victim,)).items() if p["transfers"][second]]
    assert served and served[0] != victim
    # The decode request of the broken attempt was aborted and its blocks freed.
    deadline = time.monotonic() + 15
    while True:
        decode = {n: (e["kv_usage"], e["engine_inflight"]) for n, e in app.snapshot()["engines"].items() if e["role"] == "decode"}
        if all(v == (0.0, 0) for v in decode.values()):
            break
        assert time.monotonic() < deadline, f"decode engines still hold the killed attempt: {decode}"
        time.sleep(0.25)
    wait_healthy(app)

    # Every prefill engine down: requests are served colocated (and counted as fallbacks).
    for pid in {info["pid"] for info in inspect(app, "prefill", []).values()}:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(e["healthy"] for e in app.snapshot()["engines"].values() if e["role"] == "prefill"):
        assert time.monotonic() < deadline, "router still thinks a killed prefill engine is healthy"
        time.sleep(0.2)
    fallback_prompt = token_pattern(300, seed=61)
    assert completion_ids(app, fallback_prompt)[1] == completion_ids(baseline_app, fallback_prompt)[1]
    # In the fallback too, a client cannot hand the decode engine KV parameters of its own.
    started = time.monotonic()
    steer = {"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/x", "request_id": "x1"}
    refused = post(app, "/v1/completions", {"prompt": fallback_prompt, "max_tokens": 4, "kv_transfer_params": steer}, timeout=30)
    assert refused.status_code == 400 and time.monotonic() - started < 1.0
    deadline = time.monotonic() + 60
    while not any(line.startswith("ray_pd_fallback_total{") for line in metric_lines(cluster.metrics_port)):
        assert time.monotonic() < deadline, "pd_fallback_total not exported"
        time.sleep(2)
    wait_healthy(app)
    wait_idle(app)
