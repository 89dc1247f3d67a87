"""vLLM's ``prompt_logprobs`` field, fast: the whole app in this process on mock engines
(tests/support/inprocess.py). A reply that is not streamed carries each prompt token's logprob,
rank and text, with the top k (a completion's in each choice, a chat reply's at its top level, as
vLLM's server sends them); a chat echo carries them too, as on vLLM's server. The prompt's
logprobs are computed where the prompt is, once per prompt. test_cdcp.py reads them from real
engines. The mock model gives every prompt token logprob -0.25, rank 1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.wire.protocol import TokenLogprob
from tests.support.inprocess import PROMPT, App, args, body_of, completion, engine_calls, run, vllm_logprob_texts

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def own_entries(tokenizer: Any, prompt: list[int]) -> list[dict[str, Any] | None]:
    """The field for the mock model's prompt with k 0: each token's own entry alone, its text as
    vLLM's engine gives it."""
    texts = vllm_logprob_texts(tokenizer, prompt[1:])
    return [None] + [{str(t): {"logprob": -0.25, "rank": 1, "decoded_token": text}} for t, text in zip(prompt[1:], texts)]


def ranked(t: int, rank: int) -> TokenLogprob:
    """Token t ranked 1st or 3rd among itself and ids t + 1, t + 2 (best first), t + 3 below."""
    if rank == 1:
        return TokenLogprob(t, -0.5, ((t, -0.5), (t + 1, -1.0), (t + 2, -2.0), (t + 3, -3.0)), rank=1)
    return TokenLogprob(t, -2.0, ((t + 1, -0.5), (t + 2, -1.0), (t, -2.0), (t + 3, -3.0)), rank=3)


def with_alternatives(app: App, rank: int) -> None:
    """Engines whose prompt logprobs rank each token ``rank`` (``ranked``): what the router keeps
    of them depends on the k asked for."""
    for engine in app.engines.values():
        real = engine.runner.generate

        async def alternatives(request: Any, real: Any = real) -> Any:
            async for delta in real(request):
                if delta.prompt_logprobs is not None:
                    delta.prompt_logprobs = [None if lp is None else ranked(lp.token_id, rank) for lp in delta.prompt_logprobs]
                yield delta

        engine.runner.generate = alternatives


async def chat(app: App, **body: Any) -> tuple[int, Any]:
    request = {"messages": [{"role": "user", "content": "Describe the river"}], "max_tokens": 3, **body}
    return await body_of(await app.service.http("chat", json.dumps(request).encode()))


def test_a_completions_prompt_logprobs_are_in_each_choice_computed_once_where_the_prompt_is(tiny_tokenizer):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        other = [21, 22, 23, 24, 25]
        status, data = await completion(app, [PROMPT, other], max_tokens=3, n=2, temperature=1.0, prompt_logprobs=0)
        assert status == 200, data
        fields = [choice["prompt_logprobs"] for choice in data["choices"]]
        assert fields == [own_entries(tiny_tokenizer, PROMPT)] * 2 + [own_entries(tiny_tokenizer, other)] * 2
        assert all(choice["logprobs"] is None for choice in data["choices"])  # the output's are not asked for
        # Each prompt's first sample asks, on its decode engine, reading no cache (as vLLM); its
        # second takes them from it and goes through a prefill engine as usual.
        asked = sorted((c["prompt"], c["engine"][:6], c["kv"], c["skip_cache"]) for c in calls if c["prompt_logprobs"] is not None)
        assert asked == sorted([(PROMPT, "decode", None, True), (other, "decode", None, True)])
        assert all(not c["skip_cache"] for c in calls if c["prompt_logprobs"] is None)
        # Without the field, nothing is asked and the choices have none.
        calls.clear()
        status, data = await completion(app, PROMPT, max_tokens=3)
        assert "prompt_logprobs" not in data["choices"][0] and all(c["prompt_logprobs"] is None for c in calls)

    run(body, args(router={"mode": "disaggregated"}), tiny_tokenizer)


@pytest.mark.parametrize("rank", [1, 3])
def test_the_top_k_follow_the_token_with_their_ranks_and_an_echo_reads_the_same_k(tiny_tokenizer, rank):
    """As vLLM's server: the engine is asked for the client's prompt_logprobs (else the echo's
    logprobs); the field has the token, then the top k; the echo's top_logprobs the first
    logprobs + 1 of the same entries (the token first)."""

    async def body(app: App) -> None:
        with_alternatives(app, rank)
        calls = engine_calls(app)
        status, data = await completion(app, PROMPT, max_tokens=2, prompt_logprobs=2, echo=True, logprobs=1, return_token_ids=False)
        assert status == 200, data
        assert [c["prompt_logprobs"] for c in calls] == [2]  # the client's k, once
        field = data["choices"][0]["prompt_logprobs"]
        assert field[0] is None and len(field) == len(PROMPT)
        text = {t: piece for t, piece in zip(range(1, 40), vllm_logprob_texts(tiny_tokenizer, list(range(1, 40))))}
        for t, entries in zip(PROMPT[1:], field[1:]):
            if rank == 3:
                want = [(t, -2.0, 3), (t + 1, -0.5, 1), (t + 2, -1.0, 2)]
            else:
                want = [(t, -0.5, 1), (t + 1, -1.0, 2)]
            assert list(entries.items()) == [(str(i), {"logprob": lp, "rank": r, "decoded_token": text[i]}) for i, lp, r in want]
        top = data["choices"][0]["logprobs"]["top_logprobs"]
        assert top[0] is None
        t = PROMPT[1]
        assert top[1] == ({text[t]: -2.0, text[t + 1]: -0.5} if rank == 3 else {text[t]: -0.5, text[t + 1]: -1.0})
        # With no prompt_logprobs, the echo's k is asked and the field shows it too.
        calls.clear()
        status, data = await completion(app, PROMPT, max_tokens=2, echo=True, logprobs=1, return_token_ids=False)
        assert [c["prompt_logprobs"] for c in calls] == [1] and len(data["choices"][0]["prompt_logprobs"][1]) == (2 if rank == 3 else 1)
        # A client's smaller k is what the engine computes, for the echo too.
        calls.clear()
        status, data = await completion(app, PROMPT, max_tokens=2, echo=True, logprobs=2, prompt_logprobs=0, return_token_ids=False)
        assert status == 200 and [c["prompt_logprobs"] for c in calls] == [0]

    run(body, args(), tiny_tokenizer)


def test_a_multi_byte_characters_pieces_are_read_together_as_vllms_engine_reads_them(tiny_tokenizer):
    """A byte-level vocabulary splits CJK text into byte tokens whose own text is "\ufffd":
    vLLM's engine gives each the character it completes ("" before that), so the texts add up to
    the prompt's; the output's logprobs the same, across chunks."""

    async def body(app: App) -> None:
        text = "say 日本語 ok"
        prompt = tiny_tokenizer.encode(text)
        request = {"prompt": text, "max_tokens": 1, "prompt_logprobs": 0}
        status, data = await body_of(await app.service.http("completions", json.dumps(request).encode()))
        assert status == 200, data
        pieces = [None if e is None else next(iter(e.values()))["decoded_token"] for e in data["choices"][0]["prompt_logprobs"]]
        assert pieces[1:] == vllm_logprob_texts(tiny_tokenizer, prompt[1:]) and "".join(pieces[1:]) == tiny_tokenizer.decode(prompt[1:])
        assert "\ufffd" in tiny_tokenizer.decode(prompt[5:6]) and "日" in pieces  # (byte tokens there, read together)

    run(body, args(), tiny_tokenizer)


def test_a_chat_reply_has_one_prompt_logprobs_field_and_a_chat_echo_asks_for_it(tiny_tokenizer):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        status, data = await chat(app, prompt_logprobs=1, n=2, temperature=1.0, return_token_ids=True)
        assert status == 200, data
        prompt = data["prompt_token_ids"]
        assert data["prompt_logprobs"] == own_entries(tiny_tokenizer, prompt)  # (k 1: the mock's top is the token)
        assert all("prompt_logprobs" not in choice for choice in data["choices"])
        assert [c["prompt_logprobs"] for c in calls].count(1) == 1
        # vLLM's server asks on every chat echo, with top_logprobs (0 by default) as k.
        calls.clear()
        status, data = await chat(app, echo=True, return_token_ids=True)
        assert status == 200 and data["prompt_logprobs"] == own_entries(tiny_tokenizer, data["prompt_token_ids"])
        assert [c["prompt_logprobs"] for c in calls] == [0]
        # Streamed, no reply carries them: nothing is asked.
        calls.clear()
        status, events = await chat(app, echo=True, stream=True)
        assert status == 200 and not any("prompt_logprobs" in e for e in events if isinstance(e, dict))
        assert calls and all(c["prompt_logprobs"] is None for c in calls)

    run(body, args(), tiny_tokenizer)


def test_prompt_logprobs_are_refused_where_vllms_server_refuses_them(tiny_tokenizer):
    async def body(app: App) -> None:
        calls = engine_calls(app)
        for fields, message in (
            ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
            ({"prompt_logprobs": 21}, "more than this server's most logprobs per token (20)"),
            ({"prompt_logprobs": -1}, "prompt_logprobs of -1 (the whole vocabulary"),
            ({"prompt_logprobs": -2}, "must be a positive value or -1"),
        ):
            status, data = await completion(app, PROMPT, max_tokens=2, **fields)
            assert status == 400 and data["error"]["param"] == "prompt_logprobs" and message in data["error"]["message"], (fields, data)
        assert calls == []
        # 0 in a stream is taken, as on vLLM's server, and the stream has none of them.
        status, events = await completion(app, PROMPT, max_tokens=2, stream=True, prompt_logprobs=0)
        assert status == 200 and not any("prompt_logprobs" in c for e in events if isinstance(e, dict) for c in e["choices"])
        assert calls and all(c["prompt_logprobs"] is None for c in calls)

    run(body, args(), tiny_tokenizer)


def test_prompt_logprobs_count_toward_the_requests_bound_and_survive_a_resumed_attempt(tiny_tokenizer, monkeypatch):
    import serve_app.router.parsing as parsing

    monkeypatch.setattr(parsing, "MAX_PROMPT_LOGPROB_ENTRIES", 8 * 3 + 8 * 2)

    async def body(app: App) -> None:
        calls = engine_calls(app)
        # The field's 8 tokens x (2 + 1) and the echo's 8 x (1 + 1): the bound.
        status, data = await completion(app, PROMPT, max_tokens=3, prompt_logprobs=2, echo=True, logprobs=1, return_token_ids=False)
        assert status == 200, data
        status, data = await completion(app, PROMPT, max_tokens=3, prompt_logprobs=3, echo=True, logprobs=1)
        assert status == 400 and data["error"]["param"] == "prompt_logprobs" and "48 logprobs of the prompts" in data["error"]["message"]
        # An attempt resumed after the first fails keeps the first's (its prompt holds output).
        for faults in app.faults.values():
            faults.stream_raises_after = 3
        calls.clear()
        status, data = await completion(app, PROMPT, max_tokens=10, prompt_logprobs=0)
        assert status == 200, data
        assert len(calls) >= 2 and calls[0]["prompt_logprobs"] == 0 and all(c["prompt_logprobs"] is None for c in calls[1:])
        assert data["choices"][0]["prompt_logprobs"] == own_entries(tiny_tokenizer, PROMPT)

    run(body, args(router={"mode": "colocated", "max_attempts": 8}), tiny_tokenizer)
