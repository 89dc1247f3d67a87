"""The serving benchmark's choice among repetitions of one workload (scripts/bench_serving.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_serving", None)


def run(tok_s: float, failed: int = 0, router_cpu: float = 1.0) -> dict:
    return {
        "result": {"output_throughput": tok_s, "failed": failed, "total_output_tokens": 1000},
        "cpu": {"router": router_cpu},
        "wall_s": 1.0,
    }


def test_the_median_run_is_the_one_reported_with_every_repetition_beside_it(bench):
    chosen = bench.representative([run(3000, router_cpu=0.3), run(2000, router_cpu=0.2), run(4000, router_cpu=0.4)])
    assert chosen["result"]["output_throughput"] == 3000
    assert chosen["cpu"] == {"router": 0.3}  # the CPU of that same run, not of another
    assert chosen["repetitions"] == [3000, 2000, 4000]  # in the order run


def test_an_even_count_reports_the_lower_middle_run(bench):
    assert bench.representative([run(4000), run(1000), run(3000), run(2000)])["result"]["output_throughput"] == 2000
    assert bench.representative([run(5)])["result"]["output_throughput"] == 5


def test_a_failure_in_any_repetition_is_counted(bench):
    chosen = bench.representative([run(3000), run(2000, failed=2), run(4000, failed=1)])
    assert chosen["result"]["output_throughput"] == 3000
    assert chosen["result"]["failed"] == 3


def test_the_report_shows_the_median_run_and_each_repetition(bench):
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    results = {
        "vllm": {"c=8": bench.representative([run(4000), run(3800), run(4200)])},
        "colocated": {"c=8": bench.representative([run(3000), run(3300), run(2900)])},
    }
    table = bench.report(results, workloads)
    assert "3000.0 (0.75x)" in table
    assert "  colocated      c=8     3000 3300 2900" in table


def test_the_report_shows_the_host_speed_each_target_met(bench):
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    results = {
        "vllm": {"c=8": bench.representative([run(4000)]), "host_speed_ms": [61.0, 63.4]},
        "disaggregated": {"c=8": bench.representative([run(2000)]), "host_speed_ms": [95.2, 101.0]},
    }
    table = bench.report(results, workloads)
    assert "vllm 61 / 63, disaggregated 95 / 101" in table
    assert "2000.0 (0.50x)" in table  # the speed is shown beside the ratios, never folded into them


def test_the_host_speed_probe_times_work_that_scales(bench):
    small, large = bench.host_speed_ms(loops=20_000, samples=3), bench.host_speed_ms(loops=400_000, samples=3)
    assert 0 < small < large


def test_a_dotted_override_changes_one_nested_field_and_keeps_the_rest(bench):
    args = {"prefill": {"replicas": 0, "num_cpus": 0.5}, "router": {"mode": "colocated"}}
    bench.set_arg(args, "prefill.env.PD_SERVE_ENGINE_CORE_BIND", "0")
    bench.set_arg(args, "replica_cpus", "all")
    assert args == {
        "prefill": {"replicas": 0, "num_cpus": 0.5, "env": {"PD_SERVE_ENGINE_CORE_BIND": "0"}},
        "router": {"mode": "colocated"},
        "replica_cpus": "all",
    }
