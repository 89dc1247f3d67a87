"""The cache-aware routing benchmark's multi-turn client (scripts/bench_prefix.py), against a fake
server: every policy must get the same prompts, and a failed turn must count, with the turns it
leaves unsent."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from serve_app.runtime.ports import free_port
from tests.support.scripts import scripts_loaded

TURNS, ANSWER = 6, 48  # bench_prefix's multi-turn shape


@pytest.fixture(scope="module")
def prefix():
    with scripts_loaded("bench_serving", "bench_prefix") as modules:
        yield modules["bench_prefix"]


class FakeServer:
    """Streams ANSWER token ids per completion; answers 500 to the prompts ``fail`` picks."""

    def __init__(self, fail=lambda prompt: False) -> None:
        self.fail = fail
        self.prompts: list[tuple[int, ...]] = []
        self.port = free_port()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = tuple(body["prompt"])
        self.prompts.append(prompt)
        if self.fail(prompt):
            return web.json_response({"error": {"message": "no", "type": "InternalServerError"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, body["max_tokens"], 8):
            ids = [(sum(prompt) + start + i) % 997 for i in range(8)]
            await response.write(f"data: {json.dumps({'choices': [{'text': 'x', 'token_ids': ids}]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
def serving() -> Iterator:
    """Start a FakeServer on an event loop in a thread of its own (the benchmark runs its own)."""
    running = []

    def start(server: FakeServer) -> FakeServer:
        loop = asyncio.new_event_loop()

        async def setup() -> web.AppRunner:
            app = web.Application()
            app.router.add_post("/v1/completions", server.complete)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", server.port).start()
            return runner

        runner = loop.run_until_complete(setup())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        running.append((loop, runner, thread))
        return server

    yield start
    for loop, runner, thread in running:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_every_run_sends_the_same_prompts_whatever_order_the_conversations_run_in(prefix, serving):
    first, second = serving(FakeServer()), serving(FakeServer())
    a, b = prefix.multi_turn(first.port, quick=True), prefix.multi_turn(second.port, quick=True)
    assert a["failed"] == b["failed"] == 0 and a["completed"] == b["completed"] == 16 * TURNS
    assert sorted(first.prompts) == sorted(second.prompts)
    assert len(set(first.prompts)) == 16 * TURNS


def test_a_failed_turn_counts_with_every_turn_it_leaves_unsent(prefix, serving):
    # Fail every conversation's third turn: its prompt is the system prompt and three user turns
    # plus two answers (128 + 3 * 96 + 2 * 48 tokens).
    server = serving(FakeServer(fail=lambda prompt: len(prompt) == 128 + 3 * 96 + 2 * ANSWER))
    result = prefix.multi_turn(server.port, quick=True)
    assert result["completed"] == 16 * 2
    assert result["failed"] == 16 * (TURNS - 2)
    assert len(server.prompts) == 16 * 3  # nothing is sent after a failed turn


def test_a_run_with_failed_requests_exits_non_zero(prefix, monkeypatch, capsys):
    clean = {"prefix_repetition": {"prefix": {"failed": 0}}, "multi-turn": {"prefix": {"failed": 0}}}
    failed = {"prefix_repetition": {"prefix": {"failed": 0}}, "multi-turn": {"prefix": {"failed": 3}}}
    monkeypatch.setattr(prefix, "routing_cost", lambda: {})
    monkeypatch.setattr(prefix, "report", lambda results, cost: "table")
    for results, code in ((clean, 0), (failed, 1)):
        monkeypatch.setattr(prefix, "run_policy", lambda policy, workload, quick, workdir, results=results: results[workload]["prefix"])
        assert prefix.main(["--policies", "prefix", "--quick"]) == code
    assert "requests failed: the figures above are not a clean run" in capsys.readouterr().err


def test_a_run_whose_engines_changed_or_fell_back_to_colocated_is_not_comparable(prefix, monkeypatch, capsys):
    """A replaced engine comes back under its name with its counts at zero, and one that left
    drops out of the sums; prompts the decode engines prefilled themselves (no healthy prefill
    engine) make a disaggregated app's hit rates a colocated one's. Each is named, and the run
    exits non-zero."""

    def engine(role, replica, prompt, healthy=True):
        return {"role": role, "replica": replica, "healthy": healthy, "prompt": prompt, "hits": 0, "pushed": 0}

    before = {"prefill-0": engine("prefill", "p", 100), "decode-0": engine("decode", "d", 100)}
    assert prefix.engines_changed(before, {"prefill-0": engine("prefill", "p", 1100), "decode-0": engine("decode", "d", 1100)}) == []
    replaced = {"prefill-0": engine("prefill", "p2", 300), "decode-0": engine("decode", "d", 1100)}
    assert prefix.engines_changed(before, replaced)[0].startswith("the engines changed during the run")
    fell_back = {"prefill-0": engine("prefill", "p", 600, healthy=False), "decode-0": engine("decode", "d", 1100)}
    assert prefix.engines_changed(before, fell_back) == [
        "prefill-0 is not healthy after the run",
        "a prefill engine computed only 50.0% of the prompt tokens (the rest fell back to the decode engines)",
    ]
    results = {"prefix_repetition": {"prefix": {"failed": 0, "problems": ["the engines changed during the run: x"]}}}
    monkeypatch.setattr(prefix, "routing_cost", lambda: {})
    monkeypatch.setattr(prefix, "report", lambda results, cost: "table")
    monkeypatch.setattr(prefix, "run_policy", lambda policy, workload, quick, workdir: results["prefix_repetition"]["prefix"])
    assert prefix.main(["--policies", "prefix", "--quick"]) == 1
    assert "prefix / prefix_repetition: the engines changed during the run: x: its figures are not comparable" in capsys.readouterr().err
