"""The autoscaling benchmark's load, configs and arithmetic (scripts/bench_autoscale.py), without engines."""

from __future__ import annotations

import math

import pytest

from tests.support.scripts import scripts_loaded


@pytest.fixture(scope="module")
def bench():
    with scripts_loaded("bench_goodput", "bench_autoscale") as modules:
        yield modules["bench_autoscale"]


def test_the_step_load_has_each_phases_rate_and_is_the_same_for_both_apps(bench):
    phases = (bench.Phase("low", 2.0, 200.0), bench.Phase("high", 20.0, 100.0), bench.Phase("low again", 2.0, 200.0))
    load = bench.step_load(phases)
    assert load == bench.step_load(phases)
    times = [r.at_s for _, r in load]
    assert times == sorted(times)
    for phase, (lo, hi) in bench.phase_bounds(phases).items():
        arrivals = [r.at_s for name, r in load if name == phase]
        assert all(lo <= t < hi for t in arrivals)
        rate = next(p.rate for p in phases if p.name == phase)
        assert abs(len(arrivals) / (hi - lo) - rate) < 0.2 * rate
    assert {len(r.prompt) for _, r in load} == {bench.PROMPT}


def test_scaling_times_and_per_phase_figures_come_from_the_timeline_and_the_outcomes(bench):
    phases = (bench.Phase("low", 1.0, 10.0), bench.Phase("high", 1.0, 10.0), bench.Phase("low again", 1.0, 10.0))

    def timeline(up: float, down: float) -> list[tuple[float, dict[str, int]]]:
        """The router's pools (decode 2 from ``up`` to ``down``), and Serve's target and RUNNING before it."""
        return [
            (
                t,
                {
                    "prefill": 1,
                    "decode": 2 if up <= t < down else 1,
                    "decode.target": 2 if up - 1.5 <= t < down else 1,
                    "decode.running": 2 if up - 0.5 <= t < down else 1,
                },
            )
            for t in (x * 0.5 for x in range(80))
        ]

    def outcome(ok: bool, ttft: float, gaps: list[float]):
        o = bench.Outcome(long=False, ok=ok, ttft_s=ttft, chunk_gaps_s=gaps)
        if not ok:
            o.error = "HTTP 503"
        return o

    results = [("low", outcome(True, 0.1, [0.01, 0.02])), ("high", outcome(True, 0.5, [0.05])), ("high", outcome(False, 0.0, []))]
    summary = bench.summarize(results, timeline(13.0, 24.0), phases)
    assert summary["scaling"]["decode"] == {"decided_after_s": 1.5, "running_after_s": 2.5, "up_after_s": 3.0, "down_after_s": 4.0}
    assert summary["scaling"]["prefill"] == {"decided_after_s": None, "running_after_s": None, "up_after_s": None, "down_after_s": None}
    # A second engine that came only after the high phase: back to one counts from its arrival.
    late = bench.summarize(results, timeline(22.0, 28.0), phases)["scaling"]["decode"]
    assert late["up_after_s"] == 12.0 and late["down_after_s"] == 8.0
    assert summary["high"]["requests"] == 2 and summary["high"]["lost"] == 1 and summary["high"]["errors"] == ["HTTP 503"]
    assert summary["high"]["ttft_p90_s"] == 0.5 and summary["low"]["itl_p90_s"] == 0.02
    assert summary["high"]["engines"] == {"prefill": (1, 1), "decode": (1, 2)}  # the router's view only
    assert math.isnan(summary["low again"]["ttft_p90_s"])


def test_the_shipped_configs_pass_pd_serves_validation_and_only_the_autoscaled_one_autoscales(bench):
    from serve_app.config.settings import load_config

    for target in ("static", "autoscaled"):
        (app,) = bench.app_config(target, 8123)["applications"]
        config = load_config(app["args"])  # pd-serve's own validation, Serve's autoscaling model included
        assert config.router.http.port == 8123
        for role in ("prefill", "decode"):
            group = getattr(config, role)
            if target == "autoscaled":
                assert group.autoscaling_config is not None and "num_replicas" not in app["args"][role]
                assert group.autoscaling_config["max_replicas"] == 2
            else:
                assert group.initial_replicas == 1 and group.autoscaling_config is None


def test_the_verdict_counts_lost_requests_and_outputs_missing_or_unequal(bench):
    phases = (bench.Phase("low", 1.0, 1.0),)
    results = {
        "static": {"low": {"lost": 1}, "token_ids": [[1, 2], [], [5]]},
        "autoscaled": {"low": {"lost": 0}, "token_ids": [[1, 2], [], [6]]},
    }
    assert bench.verdict(results, phases) == (1, 2)  # the empty pair (a lost request) and [6] != [5]
    assert bench.verdict({"static": results["static"]}, phases) == (1, None)


def test_a_run_whose_decode_pool_never_scaled_is_not_a_pass(bench):
    """Nothing lost proves nothing where nothing moved: a pool that never grew or never shrank
    back is named, and the run exits non-zero."""
    scaled = {"up_after_s": 60.0, "down_after_s": 24.0}
    assert bench.never_scaled({"autoscaled": {"scaling": {"decode": scaled}}}) == []
    assert bench.never_scaled({"static": {}}) == []  # the autoscaled app did not run
    (line,) = bench.never_scaled({"autoscaled": {"scaling": {"decode": {**scaled, "down_after_s": None}}}})
    assert line == "the autoscaled decode pool never went back to one within the run: scaling was not tested"
    assert len(bench.never_scaled({"autoscaled": {"scaling": {"decode": {"up_after_s": None, "down_after_s": None}}}})) == 2
