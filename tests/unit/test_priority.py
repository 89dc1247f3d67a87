"""vLLM's request priority (the body's ``priority``, a gateway's ``X-Vllm-Priority`` before it):
where the engines schedule by priority (``scheduling_policy: priority``) both engines of every
attempt get it, a resumed one too; where they serve first come, first served, anything but 0 is
refused rather than dropped. That the engines order their queues by it is
tests/integration/test_request_tags.py's (real vLLM engines)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serve_app.config.settings import AppConfig
from tests.support.inprocess import App, args, engine_calls, expected
from tests.support.inprocess import run_http as run

PRIORITY = {"scheduling_policy": "priority"}
COMPLETION = {"prompt": [11, 12, 13], "max_tokens": 3, "return_token_ids": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_a_priority_is_refused_where_the_engines_serve_first_come_first_served(tiny_tokenizer):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        for payload, headers, where in (
            ({**COMPLETION, "priority": 1}, {}, "priority 1"),
            ({**CHAT, "priority": -2}, {}, "priority -2"),
            (COMPLETION, {"X-Vllm-Priority": "5"}, "X-Vllm-Priority 5"),
            ({**COMPLETION, "priority": 0}, {"x-vllm-priority": "-1"}, "X-Vllm-Priority -1"),
        ):
            route = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
            out = await client.post(route, json=payload, headers=headers)
            assert out.status_code == 400, out.text
            error = out.json()["error"]
            assert error["param"] == "priority" and error["type"] == "invalid_request_error", error
            assert error["message"].startswith(f"{where} is not supported by this server"), error
        assert calls == []  # refused before any engine saw it
        # 0, the default, is every request's priority there: served. A header that is not an
        # integer is ignored there, as vLLM's server ignores it (a gateway may send one to all).
        for payload, headers in (
            ({**COMPLETION, "priority": 0}, {}),
            (COMPLETION, {"X-Vllm-Priority": "0"}),
            (COMPLETION, {"X-Vllm-Priority": "high"}),
            (COMPLETION, {"X-Vllm-Priority": ""}),
            (COMPLETION, [("X-Vllm-Priority", "\x1c5")]),
            (COMPLETION, [("X-Vllm-Priority", "x"), ("X-Vllm-Priority", "0")]),
        ):
            out = await client.post("/v1/completions", json=payload, headers=headers)
            assert out.status_code == 200, (headers, out.text)
        assert {call["priority"] for call in calls} == {0}
        repeated = await client.post("/v1/completions", json=COMPLETION, headers=[("X-Vllm-Priority", "0"), ("X-Vllm-Priority", "3")])
        assert repeated.status_code == 400 and repeated.json()["error"]["message"].startswith("X-Vllm-Priority 3 is not supported")

    run(body, tiny_tokenizer)


def test_the_priority_reaches_both_engines_and_the_header_comes_before_the_body(tiny_tokenizer, transport):
    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        for payload, headers, priority in (
            ({**COMPLETION, "priority": -3}, {}, -3),
            ({**COMPLETION, "priority": 4}, {"X-Vllm-Priority": "-7"}, -7),  # a gateway's, as on vLLM's server
            (COMPLETION, {"X-Vllm-Priority": " +2 "}, 2),
            ({**COMPLETION, "priority": 2**63 - 1}, {}, 2**63 - 1),
        ):
            before = len(calls)
            out = await client.post("/v1/completions", json=payload, headers=headers)
            assert out.status_code == 200 and out.json()["choices"][0]["token_ids"] == expected(COMPLETION["prompt"], 3)
            sent = calls[before:]
            assert sorted(call["engine"].split("-")[0] for call in sent) == ["decode", "prefill"], sent
            assert {call["priority"] for call in sent} == {priority}, sent
        # The handle API: the body's.
        before = len(calls)
        await app.service.complete({**CHAT, "priority": 9})
        assert {call["priority"] for call in calls[before:]} == {9}
        for headers, payload in (
            ({"X-Vllm-Priority": "high"}, COMPLETION),
            ({"X-Vllm-Priority": "1.5"}, COMPLETION),
            ({"X-Vllm-Priority": "9" * 20}, COMPLETION),
            ({"X-Vllm-Priority": str(2**63)}, COMPLETION),
            ({"X-Vllm-Priority": ""}, COMPLETION),
            ([("X-Vllm-Priority", "\x1c5")], COMPLETION),  # not a blank HTTP strips
            ([("X-Vllm-Priority", "-1"), ("X-Vllm-Priority", "-9")], COMPLETION),  # a client's beside a gateway's
            ({}, {**COMPLETION, "priority": 2**63}),
            ({}, {**COMPLETION, "priority": -(2**63) - 1}),
        ):
            before = len(calls)
            out = await client.post("/v1/completions", json=payload, headers=headers)
            assert out.status_code == 400 and out.json()["error"]["param"] == "priority", (headers, out.text)
            assert calls[before:] == []

    run(body, tiny_tokenizer, app_args=args(engine_kwargs=PRIORITY, router={"engine_transport": transport}))


def test_a_resumed_attempt_keeps_the_priority(tiny_tokenizer):
    """Under KV pressure the decode engines give requests back and the router resumes them: each
    resumed attempt's engine requests carry the request's priority as its first did."""

    async def body(app: App, client: httpx.AsyncClient) -> None:
        calls = engine_calls(app)
        prompts = [[40 + i] * 10 for i in range(6)]
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json={"prompt": p, "max_tokens": 60, "return_token_ids": True, "priority": i - 3})
              for i, p in enumerate(prompts))
        )
        for i, out in enumerate(replies):
            assert out.status_code == 200 and out.json()["choices"][0]["token_ids"] == expected(prompts[i], 60), i
        resumed = [call for call in calls if not call["request_id"].endswith("-1")]
        assert resumed, "no request was resumed: the KV pressure did not bite"
        assert {call["engine"].split("-")[0] for call in resumed} == {"decode", "prefill"}
        for call in calls:
            # Each prompt's first token names the request, and so its priority.
            assert call["priority"] == call["prompt"][0] - 40 - 3, call

    pressure = args(engine_kwargs=PRIORITY, router={"max_attempts": 30}, mock={"decode_step_s": 0.001, "kv_capacity_tokens": 200})
    run(body, tiny_tokenizer, app_args=pressure)


def test_the_engine_runner_hands_the_request_tags_to_vllm():
    """VLLMRunner gives AsyncLLM.generate the request's priority (its engine core's scheduler
    orders by it) and a reasoning model's state, only where set, as vLLM's server does
    (tests/integration/test_request_tags.py: their effect on real engines)."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from serve_app.engines.pacing import StreamPacer
    from serve_app.engines.vllm_runner import VLLMRunner
    from serve_app.wire.protocol import EngineRequest
    from serve_app.wire.sampling import encode_sampling

    given: list[dict] = []

    class FakeLLM:
        async def generate(self, prompt, params, request_id, **kwargs):
            given.append(kwargs)
            completion = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)
            yield SimpleNamespace(outputs=[completion], finished=True, num_cached_tokens=0)

    thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    cases = [
        ({"priority": -4}, {"priority": -4}),
        ({}, {"priority": 0}),
        ({"priority": 2**63 - 1, "reasoning_ended": True}, {"priority": 2**63 - 1, "reasoning_ended": True}),
        ({"reasoning_parser_kwargs": thinking}, {"priority": 0, "reasoning_parser_kwargs": thinking}),
    ]

    async def main() -> None:
        runner = VLLMRunner("decode-0", "decode", {}, pacer=StreamPacer(100.0))
        runner.llm = FakeLLM()
        params = encode_sampling(SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
        for i, (tags, _) in enumerate(cases):
            deltas = [d async for d in runner.generate(EngineRequest(f"r{i}", [1, 2], params, None, **tags))]
            assert [d.token_ids for d in deltas] == [[7]]

    asyncio.run(main())
    assert given == [expected for _, expected in cases]


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        ({"engine_kwargs": PRIORITY}, False),
        ({"prefill": {"engine_kwargs": PRIORITY}, "decode": {"engine_kwargs": PRIORITY}}, False),
        ({"decode": {"engine_kwargs": PRIORITY}}, True),
        ({"prefill": {"engine_kwargs": PRIORITY}}, True),
        ({"engine_kwargs": PRIORITY, "prefill": {"engine_kwargs": {"scheduling_policy": "fcfs"}}}, True),
        ({"router": {"mode": "colocated"}, "prefill": {"num_replicas": 0}, "decode": {"engine_kwargs": PRIORITY}}, False),  # decode alone
        ({"engine_kwargs": {"scheduling_policy": "PRIORITY"}}, "scheduling_policy 'PRIORITY': vLLM's policies are fcfs, priority"),
    ],
)
def test_prefill_and_decode_schedule_alike(kwargs, refused):
    """A priority orders both engines' queues, or it would order half of a request's way; and a
    policy vLLM lacks is refused here, not when the engines start."""
    if refused:
        match = refused if isinstance(refused, str) else "prefill's and decode's scheduling_policy differ"
        with pytest.raises(ValueError, match=match):
            AppConfig(model="m", **kwargs)
    else:
        assert AppConfig(model="m", **kwargs).priority_scheduling
    assert not AppConfig(model="m").priority_scheduling
