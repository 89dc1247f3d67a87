"""The goodput benchmark's workload and arithmetic (scripts/bench_goodput.py), without engines."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tests.support.scripts import scripts_loaded


@pytest.fixture(scope="module")
def goodput():
    with scripts_loaded("bench_goodput") as modules:
        yield modules["bench_goodput"]


def test_the_workload_is_the_same_for_every_target_and_has_the_stated_mix(goodput):
    first, again = goodput.workload(4.0, 2000, seed=3), goodput.workload(4.0, 2000, seed=3)
    assert first == again
    assert goodput.workload(4.0, 50, seed=4) != goodput.workload(4.0, 50, seed=3)
    assert sum(r.long for r in first) == round(goodput.LONG_SHARE * 2000)
    assert {len(r.prompt) for r in first} == {goodput.LONG_IN, goodput.SHORT_IN}
    assert all(len(r.prompt) == goodput.LONG_IN for r in first if r.long)
    # Poisson arrivals: increasing times, the last at count / rate (the offered rate is the label).
    times = [r.at_s for r in first]
    assert times == sorted(times) and times[0] > 0
    assert times[-1] == pytest.approx(2000 / 4.0)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.pstdev(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential: deviation = mean
    assert all(goodput.VOCAB_LOW <= t < goodput.VOCAB_HIGH for r in first[:20] for t in r.prompt)


def test_every_rate_offers_one_arrival_sequence_at_its_own_pace_with_new_prompts(goodput):
    """The rates differ in pace only: the same arrivals scaled, the long prompts at the same places;
    the tokens differ, so a rate does not find the prompts of the one before in the cache."""
    slow, fast = goodput.workload(4.0, 100, seed=4000), goodput.workload(8.0, 100, seed=8000)
    assert [f.at_s for f in fast] == pytest.approx([s.at_s / 2 for s in slow])
    assert [f.long for f in fast] == [s.long for s in slow]
    assert len(fast) / fast[-1].at_s == pytest.approx(8.0)
    assert not {tuple(s.prompt) for s in slow} & {tuple(f.prompt) for f in fast}


def test_a_request_meets_the_slos_only_when_it_finished_within_both(goodput):
    fast = goodput.Outcome(long=False, ok=True, ttft_s=0.2, e2e_s=0.2 + 0.01 * 127, tokens=128)
    assert fast.tpot_s == pytest.approx(0.01)
    assert fast.meets(ttft_slo_s=0.5, tpot_slo_s=0.02)
    assert not fast.meets(ttft_slo_s=0.1, tpot_slo_s=0.02)
    assert not fast.meets(ttft_slo_s=0.5, tpot_slo_s=0.005)
    failed = goodput.Outcome(long=False, ok=False, ttft_s=0.2, e2e_s=1.0, tokens=128)
    assert not failed.meets(ttft_slo_s=10, tpot_slo_s=10)
    assert goodput.Outcome(long=False, ok=True, ttft_s=0.2, e2e_s=0.2, tokens=1).tpot_s is None


def test_summary_counts_goodput_per_second_and_failed_requests_against_it(goodput):
    slo_ttft, slo_tpot = goodput.TTFT_SLO_S, goodput.TPOT_SLO_S
    good = goodput.Outcome(long=False, ok=True, ttft_s=slo_ttft / 2, e2e_s=slo_ttft / 2 + slo_tpot / 2 * 9, tokens=10)
    good.chunk_gaps_s, good.chunk_tokens = [slo_tpot / 2] * 9, [1] * 9
    slow = goodput.Outcome(long=True, ok=True, ttft_s=slo_ttft * 2, e2e_s=slo_ttft * 2 + 0.001 * 9, tokens=10)
    slow.chunk_gaps_s, slow.chunk_tokens = [0.001] * 8 + [0.5], [1] * 9
    failed = goodput.Outcome(long=False, error="HTTP 500")
    summary = goodput.summarize([good, good, slow, failed], wall_s=2.0, span_s=1.0)
    assert summary["requests"] == 4 and summary["failed"] == 1
    assert summary["goodput_rps"] == pytest.approx(2.0)  # per second of offered load, not of the drain
    assert summary["attainment"] == pytest.approx(0.5)
    assert summary["itl_p99_s"] == summary["itl_chunk_p99_s"] == pytest.approx(0.5)  # one token per chunk: the same
    assert summary["ttft_p90_s"] == pytest.approx(slo_ttft * 2)
    assert summary["short_ttft_p90_s"] == pytest.approx(slo_ttft / 2)
    assert summary["tokens_per_s"] == pytest.approx(15.0)


def test_itl_is_per_token_so_that_a_stream_of_several_tokens_per_chunk_is_weighed_as_one_of_single_tokens(goodput):
    """A reader who gets 4 tokens after 40 ms waited 40 ms once, not four times: the per-token
    gaps are as many as the tokens after the first, whatever the chunking."""
    paced = goodput.Outcome(long=False, ok=True, ttft_s=0.1, e2e_s=0.1 + 0.04 * 3, tokens=10, first_chunk_tokens=1)
    paced.chunk_gaps_s, paced.chunk_tokens = [0.04, 0.04, 0.04], [4, 4, 1]
    assert paced.token_gaps_s == [0.04, 0.0, 0.0, 0.0, 0.04, 0.0, 0.0, 0.0, 0.04]
    batched_first = goodput.Outcome(long=False, ok=True, ttft_s=0.1, e2e_s=0.2, tokens=4, first_chunk_tokens=3)
    batched_first.chunk_gaps_s, batched_first.chunk_tokens = [0.1], [1]
    assert batched_first.token_gaps_s == [0.0, 0.0, 0.1]
    # 10 streams of 100 tokens, each with one 0.5 s stall: one token per chunk puts the stall in
    # 1% of the gaps, 4 per chunk in 4%; per token it is 1% either way.
    single = goodput.Outcome(long=False, ok=True, ttft_s=0.1, e2e_s=1.0, tokens=100)
    single.chunk_gaps_s, single.chunk_tokens = [0.5] + [0.005] * 98, [1] * 99
    four = goodput.Outcome(long=False, ok=True, ttft_s=0.1, e2e_s=1.0, tokens=100, first_chunk_tokens=4)
    four.chunk_gaps_s, four.chunk_tokens = [0.5] + [0.02] * 23, [4] * 24
    a, b = goodput.summarize([single] * 10, 1.0, 1.0), goodput.summarize([four] * 10, 1.0, 1.0)
    assert a["itl_p99_s"] == b["itl_p99_s"] == pytest.approx(0.5)
    assert b["itl_chunk_p99_s"] == pytest.approx(0.5) and goodput.percentile([g for g in four.token_gaps_s], 95) < 0.5


def test_percentile_is_nearest_rank(goodput):
    assert goodput.percentile(list(range(1, 101)), 99) == 99
    assert goodput.percentile(list(range(1, 101)), 90) == 90
    assert goodput.percentile([5.0], 99) == 5.0
    assert math.isnan(goodput.percentile([], 50))


def test_distserve_goodput_is_the_highest_rate_with_enough_attainment(goodput):
    per_rate = {1.0: {"attainment": 1.0}, 2.0: {"attainment": 0.95}, 4.0: {"attainment": 0.5}, 3.0: {"attainment": 0.89}}
    assert goodput.max_rate_meeting(per_rate) == 2.0
    assert goodput.max_rate_meeting({1.0: {"attainment": 0.1}}) == 0.0



def test_the_knee_is_interpolated_between_the_rates_tried(goodput):
    per_rate = {4.0: {"attainment": 1.0}, 8.0: {"attainment": 0.95}, 12.0: {"attainment": 0.45}, 16.0: {"attainment": 0.2}}
    assert goodput.knee_rate(per_rate) == (pytest.approx(8.4), True)  # 0.95 -> 0.45 over 4/s crosses 0.9 a tenth in
    assert goodput.knee_rate({4.0: {"attainment": 1.0}, 8.0: {"attainment": 0.9}}) == (8.0, False)  # at least the last rate
    assert goodput.knee_rate({4.0: {"attainment": 0.5}}) == (0.0, False)
    assert goodput.knee_text("vllm", 0.0, False, 4.0) == "vllm below 4.0/s"
    assert goodput.knee_text("vllm", 8.0, False, 4.0) == "vllm >= 8.0/s" and goodput.knee_text("vllm", 8.4, True, 4.0) == "vllm 8.4/s"
    # DistServe's summary is the highest rate that met, even past a rate that did not.
    assert goodput.knee_rate({4.0: {"attainment": 0.95}, 8.0: {"attainment": 0.5}, 12.0: {"attainment": 0.9}}) == (12.0, False)


def test_every_target_uses_every_core_and_the_same_step_budget(goodput):
    colocated = goodput.app_args("colocated", chunk=256)
    assert colocated["prefill"]["num_replicas"] == 0 and colocated["router"]["mode"] == "colocated"
    assert colocated["decode"]["cpu_bind"] == ["0-1"]
    assert colocated["decode"]["engine_kwargs"]["max_num_batched_tokens"] == 256
    disaggregated = goodput.app_args("disaggregated", chunk=256)
    assert disaggregated["prefill"]["cpu_bind"] == ["0"] and disaggregated["decode"]["cpu_bind"] == ["1"]
    assert disaggregated["decode"]["engine_kwargs"]["max_num_batched_tokens"] == 256
    assert disaggregated["prefill"]["engine_kwargs"]["max_num_batched_tokens"] >= goodput.LONG_IN
    assert disaggregated["router"].get("local_prefill_max_tokens", 0) == 0  # every prompt goes to prefill
    conditional = goodput.app_args("conditional", chunk=256)
    assert conditional["router"]["local_prefill_max_tokens"] == goodput.LOCAL_PREFILL_MAX_TOKENS
    assert goodput.SHORT_IN <= goodput.LOCAL_PREFILL_MAX_TOKENS < goodput.LONG_IN  # the long prompts still move
    assert {k: v for k, v in conditional.items() if k != "router"} == {k: v for k, v in disaggregated.items() if k != "router"}
    for args in (colocated, disaggregated, conditional):
        assert args["model"].endswith("medium-llama") and args["max_model_len"] >= goodput.LONG_IN + goodput.OUT


def test_a_saved_run_is_reported_again_with_every_ratio(goodput, tmp_path, capsys):
    """--report: the table and ratios of a run saved with --out, from its numbers alone."""

    def rate_summary(itl_ms: float, goodput_rps: float, tpot_ms: float) -> dict[str, float]:
        return {
            "requests": 10,
            "failed": 0,
            "ttft_p90_s": 0.2,
            "itl_p99_s": itl_ms / 1000,
            "tpot_p90_s": tpot_ms / 1000,
            "short_ttft_p90_s": 0.1,
            "tokens_per_s": 100.0,
            "attainment": 1.0,
            "goodput_rps": goodput_rps,
        }

    host = [{"wakeup_us": 40.0, "loop_ms": 30.0}] * 2
    figures = {"vllm": (40, 4.0, 8), "colocated": (80, 2.0, 10), "disaggregated": (20, 6.0, 4)}
    saved = {
        "results": {t: {"host_speed": host, "rates": {"4.0": rate_summary(*f)}} for t, f in figures.items()},
        "prefill_alone_s": 0.1,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    assert goodput.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Disaggregated against vLLM's server" in out and "rate  4.0: ITL p99 0.50x, goodput 1.50x, TPOT p90 0.50x" in out
    assert "Disaggregated against pd-serve colocated" in out and "rate  4.0: ITL p99 0.25x, goodput 3.00x, TPOT p90 0.40x" in out
    assert "interpolated between the rates tried: vllm >= 4.0/s, colocated >= 4.0/s, disaggregated >= 4.0/s" in out


@pytest.mark.parametrize(
    "alone_key, alone, expected",
    [
        ("prefill_alone_runs_s", [0.100, 0.120, 0.110], "110 ms (100-120 ms) on the same core: 1.09x"),
        ("prefill_alone_s", 0.110, "prefill 110 ms on the same core: 1.09x"),  # saved before the runs were kept
    ],
)
def test_a_long_prompt_alone_is_reported_as_medians_with_their_spread(goodput, tmp_path, capsys, alone_key, alone, expected):
    host = [{"wakeup_us": 40.0, "loop_ms": 30.0}] * 2
    summary = {"requests": 1, "failed": 0, "ttft_p90_s": 0.2, "itl_p99_s": 0.02, "tpot_p90_s": 0.01}
    summary |= {"short_ttft_p90_s": 0.1, "tokens_per_s": 1.0, "attainment": 1.0, "goodput_rps": 1.0}
    results = {t: {"host_speed": host, "rates": {"4.0": summary}} for t in ("vllm", "disaggregated")}
    results["disaggregated"]["long_alone_ttft_s"] = [0.130, None, 0.115, 0.120]  # a failed one is left out
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": results, alone_key: alone}))
    assert goodput.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(3 one at a time, medians and ranges): disaggregated TTFT 120 ms (115-130 ms)," in out and expected in out


def test_a_knee_past_the_rates_tried_makes_its_ratio_a_bound(goodput):
    """vLLM's knee past the highest rate tried is at least that rate: a ratio to it was printed as
    exact, overstating the other target."""
    assert goodput.knee_ratio((16.4, True), (20.0, False)) == "<= 0.82x"
    assert goodput.knee_ratio((20.0, False), (16.4, True)) == ">= 1.22x"
    assert goodput.knee_ratio((8.4, True), (8.0, True)) == "1.05x"
    assert goodput.knee_ratio((20.0, False), (20.0, False)) == "n/a" and goodput.knee_ratio((0.0, False), (8.0, True)) == "n/a"


def test_ttft_is_the_first_chunk_that_brings_tokens_text_or_not(goodput):
    """As vLLM's client times it: a first token without text of its own (a third of the medium
    model's vocabulary decodes to nothing alone) stopped no clock, and TTFT took in decode steps."""
    import asyncio

    from aiohttp import web

    from tests.support.local_http import serving

    async def stream(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "", "token_ids": [900]}]}\n\n')
        await asyncio.sleep(0.3)
        for _ in range(goodput.OUT - 1):
            await response.write(b'data: {"choices": [{"text": "a", "token_ids": [5]}]}\n\n')
        await response.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\ndata: [DONE]\n\n' % goodput.OUT)
        return response

    async def main():
        async with serving("/v1/completions", stream) as port:
            (outcome,), _ = await asyncio.to_thread(lambda: asyncio.run(goodput.drive(port, [goodput.Request(0.0, [1, 2], False)])))
        return outcome

    outcome = asyncio.run(main())
    assert outcome.ok and outcome.ttft_s < 0.25 and outcome.first_chunk_tokens == 1


def test_a_disaggregated_run_that_fell_back_to_colocated_and_late_sends_are_reported(goodput, tmp_path, capsys):
    """The share of prompt tokens the prefill engine computed, per rate, for the 1P1D targets (the
    conditional one's short prompts are its decode engine's by design); a disaggregated rate below
    99% is flagged; a client that sent requests late (it shares the cores) is named."""
    host = [{"wakeup_us": 40.0, "loop_ms": 30.0}] * 2
    summary = {"requests": 1, "failed": 0, "ttft_p90_s": 0.2, "itl_p99_s": 0.02, "tpot_p90_s": 0.01}
    summary |= {"short_ttft_p90_s": 0.1, "tokens_per_s": 1.0, "attainment": 1.0, "goodput_rps": 1.0, "send_late_max_s": 0.002}
    targets = ("vllm", "disaggregated", "conditional")
    results = {t: {"host_speed": host, "rates": {"4.0": dict(summary), "8.0": dict(summary)}} for t in targets}
    results["disaggregated"]["rates"]["4.0"]["handed_off"] = 1.0
    results["disaggregated"]["rates"]["8.0"]["handed_off"] = 0.75
    results["conditional"]["rates"]["4.0"]["handed_off"] = results["conditional"]["rates"]["8.0"]["handed_off"] = 0.8
    results["vllm"]["rates"]["8.0"]["send_late_max_s"] = 0.035
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"results": results}))
    goodput.main(["--report", str(path)])
    out = capsys.readouterr().out
    assert "  disaggregated: 4/s 100%, 8/s 75%" in out and "  conditional: 4/s 80%, 8/s 80%" in out
    (warning,) = [line for line in out.splitlines() if "WARNING" in line]
    assert warning == "  WARNING: disaggregated at 8/s: prompts fell back to the decode engine; not disaggregated figures"
    assert "  vllm 8/s: 35 ms" in out and "disaggregated 4/s:" not in out


def test_a_send_is_timed_from_its_arrival_and_the_run_keeps_the_latest(goodput):
    late = [goodput.Outcome(long=False, ok=True, ttft_s=0.1, e2e_s=1.0, tokens=goodput.OUT, late_s=s) for s in (0.001, 0.02, 0.0)]
    assert goodput.summarize(late, wall_s=2.0, span_s=1.0)["send_late_max_s"] == 0.02


def test_every_target_is_held_to_the_two_cores_its_engines_are_bound_to(goodput, monkeypatch):
    held = []
    monkeypatch.setattr(goodput.os, "sched_setaffinity", lambda pid, cores: held.append(set(cores)))
    monkeypatch.setattr(goodput.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    goodput.hold_to_cores()
    assert held == [{0, 1}]
    monkeypatch.setattr(goodput.os, "sched_getaffinity", lambda pid: {0, 1})
    goodput.hold_to_cores()
    assert held == [{0, 1}]  # already there
    monkeypatch.setattr(goodput.os, "sched_getaffinity", lambda pid: {2, 3})
    with pytest.raises(SystemExit, match=r"needs cores \[0, 1\]"):
        goodput.hold_to_cores()
