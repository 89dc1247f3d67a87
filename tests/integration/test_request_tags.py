"""vLLM's per-request engine arguments through pd-serve, on real engines (1P1D): a request's
priority, and a reasoning model's state (``reasoning_ended``, the template's variables for the
engine's reasoning parser), both as vLLM's server hands them to its engine.

Priority: both roles run ``scheduling_policy: priority``. The decode engine runs one request at
a time (``max_num_seqs: 1``) and prefills prompts of at most 32 tokens itself
(``router.local_prefill_max_tokens``), so while a long request runs, the next ones wait in its
queue whole: of two waiting requests, the later one, with the lower (earlier) priority, is served
first. With the priority lost on its way (the router's or the engine runner's), the engine serves
them in arrival order and the test fails. A longer prompt with a priority takes the P/D hand-off.

Reasoning: the engines run qwen3's reasoning parser for structured output, whose grammar holds
only once the thinking is over. The tiny tokenizer has no ``</think>`` token, so an engine that is
not told that thinking is off (``enable_thinking: false`` in the template's variables) or hidden
(``include_reasoning: false``) never applies the grammar at all.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.support.cluster import deployed, inspect, sse_chunks, token_pattern, wait_idle

pytestmark = pytest.mark.engine

LOCAL_PREFILL = 32
ARGS = {
    "served_model_name": "tiny-llama",
    "max_model_len": 2048,
    "engine_kwargs": {
        "scheduling_policy": "priority",
        "kv_cache_memory_bytes": 64 << 20,
        "structured_outputs_config": {"reasoning_parser": "qwen3"},
    },
    "prefill": {"num_replicas": 1, "num_cpus": 0.1},
    "decode": {"num_replicas": 1, "num_cpus": 0.1, "engine_kwargs": {"max_num_seqs": 1}},
    "router": {"mode": "disaggregated", "local_prefill_max_tokens": LOCAL_PREFILL, "num_cpus": 0.05},
}


@pytest.fixture(scope="module")
def app(cluster):
    with deployed(cluster, "tags", ARGS) as app:
        yield app


def complete(app, prompt: str | list[int], max_tokens: int, headers: dict[str, str] | None = None, **extra) -> tuple[float, dict]:
    """(when it finished, the response)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    response = requests.post(app.base_url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return time.monotonic(), response.json()


def decode_queue(app) -> tuple[int, int]:
    """The decode engine's (running, waiting) requests, as it last reported them."""
    (engine,) = [e for e in app.snapshot()["engines"].values() if e["role"] == "decode"]
    return engine["engine_running"], engine["engine_waiting"]


def wait_for_queue(app, running: int, waiting: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := decode_queue(app)) != (running, waiting):
        assert time.monotonic() < deadline, f"decode engine (running, waiting) {seen}, not {(running, waiting)}"
        time.sleep(0.05)


def test_a_later_request_of_earlier_priority_is_served_first(app):
    long_one = {"prompt": "The long one", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(2) as pool, requests.post(app.base_url + "/v1/completions", json=long_one, stream=True, timeout=120) as stream:
        assert stream.status_code == 200, stream.text
        chunks = sse_chunks(stream)
        next(chunks)
        wait_for_queue(app, 1, 0)  # the engine's one running request, for seconds yet
        late = pool.submit(complete, app, "Priority five, sent first", 8, priority=5)
        wait_for_queue(app, 1, 1)  # queued behind it
        # The next as a gateway gives it (X-Vllm-Priority).
        early = pool.submit(complete, app, "Priority minus five, sent second", 8, headers={"X-Vllm-Priority": "-5"})
        wait_for_queue(app, 1, 2)  # both queued while the long one still runs
        assert not late.done() and not early.done()
        sum(1 for _ in chunks)  # the long one goes on to its end
        (late_done, late_reply), (early_done, early_reply) = late.result(), early.result()
    assert late_reply["usage"]["completion_tokens"] == early_reply["usage"]["completion_tokens"] == 8
    # One request at a time: the first served ended before the second began.
    assert early_done < late_done, "the engine served the requests in arrival order, not by priority"
    wait_idle(app)


def test_a_prompt_with_a_priority_takes_the_hand_off(app):
    prompt = token_pattern(4 * LOCAL_PREFILL, seed=11)
    _, reply = complete(app, prompt, 8, headers={"X-Request-Id": "prio-pd"}, priority=-3)
    assert reply["usage"]["completion_tokens"] == 8
    (decode,) = inspect(app, "decode", None).values()
    (attempt,) = [i for i in decode["requests"] if i.startswith("cmpl-prio-pd-")]
    transfer = decode["transfers"][attempt]
    assert transfer is not None and transfer["outcome"] == "done" and transfer["tokens_received"] > LOCAL_PREFILL, transfer
    wait_idle(app)


def test_a_reasoning_models_grammar_holds_from_the_first_token_where_thinking_is_off_or_hidden(app):
    regex = "(yes|no)( (yes|no)){7}"
    base = {"messages": [{"role": "user", "content": "Answer eight times"}], "max_tokens": 200, "temperature": 0}
    # Thinking off in the template: the engine's parser is told (its template variables), the
    # grammar holds from the first token, and the whole reply is the answer.
    off = {**base, "structured_outputs": {"regex": regex}, "chat_template_kwargs": {"enable_thinking": False}}
    response = requests.post(app.base_url + "/v1/chat/completions", json=off, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert re.fullmatch(regex, choice["message"]["content"] or "") and not choice["message"].get("reasoning"), choice
    # Thinking hidden: the engine is told it is over (vLLM's server's reasoning_ended), so the
    # grammar holds from the first token and ends the reply; the router's parser, as vLLM's
    # server's, still reads a reply without </think> as thinking, which it leaves out.
    hidden = {**base, "structured_outputs": {"regex": regex}, "include_reasoning": False}
    response = requests.post(app.base_url + "/v1/chat/completions", json=hidden, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    choice, usage = reply["choices"][0], reply["usage"]
    assert choice["finish_reason"] == "stop" and usage["completion_tokens"] < 8 * 4, reply  # the grammar's end, not max_tokens
    assert choice["message"]["content"] is None and "reasoning" not in choice["message"], choice
    wait_idle(app)
