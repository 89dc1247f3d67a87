"""Nothing a client sends steers an engine's KV transfer, on real engines.

The app (conftest.py) is colocated but has a prefill engine, so its decode engine loads the KV
connector: a request carrying its own ``kv_transfer_params`` would otherwise make that connector post block
ids to any URL and wait for KV that never comes. A local HTTP server stands in for the target
and counts every request that reaches it.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from serve_app.wire.protocol import EngineRequest, KVReady, TokenDelta
from serve_app.wire.sampling import encode_sampling
from tests.support.cluster import engine_handles, inspect, post, sse_chunks, wait_idle

pytestmark = pytest.mark.engine


class Target:
    """A local HTTP server that records every request (the SSRF target)."""

    def __init__(self) -> None:
        hits: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                hits.append(self.path)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.hits = hits
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/steal"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def target() -> Iterator[Target]:
    """A target that demonstrably records what reaches it, so that finding it untouched means
    something."""
    t = Target()
    requests.post(t.url, json={"probe": True}, timeout=5)
    assert t.hits == ["/steal"]
    t.hits.clear()
    yield t
    t.close()


def steering(target: Target) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": target.url, "request_id": "x1"}


def test_a_client_without_the_api_key_is_refused_and_one_with_it_served(app):
    import openai

    url = app.base_url
    for key in ("token-abc12", "other"):
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny-llama", prompt="The river", max_tokens=4)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models", "/pd/engines"):  # no key at all
        refused = requests.request("GET" if path in ("/v1/models", "/pd/engines") else "POST", url + path, json={"prompt": "x"}, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == 401, refused.text
    assert requests.get(url + "/health", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="token-abc123", max_retries=0, timeout=60)
    served = client.completions.create(model="tiny-llama", prompt="The river", max_tokens=4, extra_body={"ignore_eos": True})
    assert served.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    wait_idle(app)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["top", "vllm_xargs"])
def test_client_kv_transfer_params_are_refused_at_once(app, target, path, stream, where):
    body: dict = {"max_tokens": 4, "stream": stream}
    body.update({"prompt": "The river"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    if where == "top":
        body["kv_transfer_params"] = steering(target)
    else:
        body["vllm_xargs"] = {"kv_transfer_params": steering(target)}
    started = time.monotonic()
    response = post(app, path, body, timeout=30)
    assert time.monotonic() - started < 1.0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "kv_transfer_params" in error["param"]
    # Refused by the router before any engine call (what an engine does with such parameters
    # is the next test's): nothing ever calls the client's "metaserver".
    wait_idle(app)
    time.sleep(0.5)
    assert target.hits == []


def test_the_engine_ignores_kv_transfer_params_in_extra_args(app, target):
    """Defence in depth: even if a request reached the decode engine with kv_transfer_params in
    its sampling params' extra_args, the engine wrapper replaces them with the router's (none,
    for a colocated attempt): the connector posts nothing and the request runs normally.

    First, the control that makes "nothing reached the target" mean something: this engine's
    connector is loaded and posts its callback to whatever ``metaserver`` the parameters it runs
    with name, as it does for the router's own decode-first parameters (the decode replica
    points those at its relay, which turns the post into a KVReady)."""
    from vllm import SamplingParams

    handle = engine_handles(app, "decode")["decode-0"]
    decode_first = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "sec-control-1"}
    control = EngineRequest("sec-control-1", [5, 6, 7, 8], encode_sampling(SamplingParams(max_tokens=6, temperature=0)), decode_first)
    stream = handle.options(stream=True).generate.remote(control)
    first = next(stream)
    assert isinstance(first, KVReady) and first.params["request_id"] == "sec-control-1", first
    stream.cancel()  # no prefill will push: the attempt ends here, as the router's would
    wait_idle(app)

    params = SamplingParams(max_tokens=6, temperature=0, extra_args={"kv_transfer_params": steering(target), "other": 1})
    request = EngineRequest("sec-direct-1", [5, 6, 7, 8], encode_sampling(params), None)
    events = list(handle.options(stream=True).generate.remote(request))
    assert not any(isinstance(e, KVReady) for e in events)
    tokens = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert len(tokens) == 6 and events[-1].finish_reason == "length"
    # The engine computed the whole prompt itself (KV received over the side channel counts as
    # cached tokens) and its connector kept no transfer, under the smuggled id or the request's.
    record = inspect(app, "decode", ["sec-direct-1", "x1"])["decode-0"]
    assert record["requests"]["sec-direct-1"]["num_cached_tokens"] == 0, record
    assert record["transfers"] == {"sec-direct-1": None, "x1": None}, record
    assert target.hits == []
    wait_idle(app)


def test_a_request_the_engine_refuses_is_a_400_not_a_retry(app):
    """vLLM checks some fields against the model only when a request is added (a logit_bias
    token outside the vocabulary): that is the client's error, answered at once, never retried."""
    started = time.monotonic()
    response = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {"999999": 5}}, timeout=30)
    assert time.monotonic() - started < 5
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    wait_idle(app)


def test_the_unchanged_request_still_works(app):
    response = post(app, "/v1/completions", {"prompt": "The river", "max_tokens": 5}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    assert json.loads(json.dumps(response.json()))["choices"][0]["finish_reason"] == "length"
    wait_idle(app)


def test_a_reasoning_models_thinking_is_split_from_its_answer(app, tiny_tokenizer):
    """The decode engine's reasoning parser (qwen3) is the router's: a client's regex makes the
    random model think between <think> tags, then answer, and the reply has the thinking as
    ``reasoning`` and the answer as ``content``, exactly the text of its tokens, streamed or not;
    ``include_reasoning: false`` leaves the thinking out, and the token ids that spell it."""
    words = "[a-z]{2,8}( [a-z]{2,8}){2,6}"
    body = {
        "messages": [{"role": "user", "content": "Should I take a coat?"}],
        "max_tokens": 150,
        "temperature": 0,
        "return_token_ids": True,
        "structured_outputs": {"regex": f"<think>{words}</think>{words}"},
    }
    response = post(app, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    # Usage counts the thinking's tokens, as vLLM 0.32's server: some of the reply, not all.
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"], usage
    reasoning, content = choice["message"]["reasoning"], choice["message"]["content"]
    assert re.fullmatch(words, reasoning) and re.fullmatch(words, content), choice
    assert tiny_tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == f"<think>{reasoning}</think>{content}"

    stream = {**body, "stream": True}
    with requests.post(app.base_url + "/v1/chat/completions", json=stream, headers=app.headers, stream=True, timeout=120) as streamed:
        deltas = [chunk["choices"][0]["delta"] for chunk in sse_chunks(streamed) if chunk["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning and "".join(d.get("content") or "" for d in deltas) == content

    hidden = post(app, "/v1/chat/completions", {**body, "include_reasoning": False}).json()["choices"][0]
    assert hidden["message"]["content"] == content and "reasoning" not in hidden["message"] and "token_ids" not in hidden
    wait_idle(app)
