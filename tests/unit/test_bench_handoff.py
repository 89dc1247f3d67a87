"""The hop-by-hop TTFT split (scripts/bench_handoff.py), from the very lines the engines log."""

from __future__ import annotations

import pytest

from serve_app.engines.records import push_timeline, receive_timeline
from tests.support.local_http import serving
from tests.support.scripts import scripts_loaded


@pytest.fixture(scope="module")
def handoff():
    with scripts_loaded("bench_handoff") as modules:
        yield modules["bench_handoff"]


def logged(attempt: str, t0: float) -> str:
    """A prefill and a decode replica's DEBUG lines for one attempt whose client sent at ``t0``:
    armed at +4 ms, the prefill call at +6, last layer at +11, settled at +12, token at +17."""
    push = {"layers_pushed": 2, "bytes_pushed": 10, "push_times": [t0 + 0.009, t0 + 0.011], "done_sent_at": t0 + 0.011}
    push |= {"forward_done_at": t0 + 0.0115, "acked_at": t0 + 0.012}
    receive = {"outcome": "done", "frames_received": 2, "layers_received": 2, "bytes_received": 10, "armed_at": t0 + 0.004}
    receive |= {"first_layer_at": t0 + 0.0095, "last_layer_at": t0 + 0.0113, "settled_at": t0 + 0.012}
    return "\n".join(
        [
            f"INFO 2026-12-04 pd_serve.engine -- transfer other-1: {push_timeline('other-1', push, since=t0)}",
            f"DEBUG 2026-12-04 pd_serve.engine -- {push_timeline(attempt, push, since=t0 + 0.006)}",
            f"DEBUG 2026-12-04 pd_serve.engine -- {receive_timeline(attempt, receive, first_token_at=t0 + 0.017)}",
        ]
    )


def test_a_ttft_is_split_at_the_points_both_engines_logged(handoff):
    t0 = 1_800_000_000.0
    sent = handoff.Sent("cmpl-a", t0, t0 + 0.020)
    split = handoff.split_ttft(sent, logged("cmpl-a-1", t0))
    expected = dict(zip(handoff.SEGMENTS, (4.0, 2.0, 5.0, 1.0, 5.0, 3.0)))
    assert split.keys() == {*handoff.SEGMENTS, "TTFT"}
    assert all(abs(split[k] - v) < 0.05 for k, v in expected.items()), split
    assert abs(sum(split[k] for k in handoff.SEGMENTS) - split["TTFT"]) < 1e-6 and abs(split["TTFT"] - 20.0) < 1e-3
    assert "settled -> first token in decode replica   median     5.0 ms" in handoff.summary([split])


@pytest.mark.parametrize(
    "sent, text",
    [
        ("cmpl-b", "logged for cmpl-a only"),  # another request's lines
        ("cmpl-a", "decode line only"),
        ("cmpl-a", "no first token"),
    ],
)
def test_a_request_without_both_lines_or_a_token_is_left_out(handoff, sent, text):
    t0 = 1_800_000_000.0
    lines = logged("cmpl-a-1", t0)
    if text == "decode line only":
        lines = lines.splitlines()[-1]
    first = None if text == "no first token" else t0 + 0.02
    assert handoff.split_ttft(handoff.Sent(sent, t0, first), lines) is None


@pytest.mark.parametrize("concurrency", [1, 3])
def test_requests_are_sent_one_at_a_time_or_from_that_many_clients_back_to_back(handoff, concurrency):
    """Every request is recorded but the three warm-ups, from at most ``concurrency`` at once,
    each timed to its first chunk with a choice, whether or not that chunk has text yet."""
    import asyncio
    import json
    import time

    from aiohttp import web

    seen = {"requests": 0, "in_flight": 0, "most": 0, "max_tokens": set()}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen["requests"] += 1
        seen["max_tokens"].add(body["max_tokens"])
        seen["in_flight"] += 1
        seen["most"] = max(seen["most"], seen["in_flight"])
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        rid = f"cmpl-{seen['requests']}"
        for text in ("", "a"):  # a first token whose text is not complete yet, then one that is
            await asyncio.sleep(0.25 if text else 0.0)
            seen[rid, text] = time.time()
            await response.write(f"data: {json.dumps({'id': rid, 'choices': [{'text': text}]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        seen["in_flight"] -= 1
        return response

    async def run() -> list:
        async with serving("/v1/completions", completions) as port:
            return await handoff.send_all(f"http://127.0.0.1:{port}", "m", 4, 7, 0.0, concurrency=concurrency, max_tokens=5)

    sent = asyncio.run(run())
    assert len(sent) == 7 and seen["requests"] == 10 and seen["most"] == concurrency and seen["max_tokens"] == {5}
    assert {s.request_id for s in sent} == {f"cmpl-{i}" for i in range(4, 11)}
    assert all(seen[s.request_id, ""] <= s.first_token_at < seen[s.request_id, "a"] for s in sent), sent  # not the first text
