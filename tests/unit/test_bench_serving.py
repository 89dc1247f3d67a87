"""The serving benchmark's choice among repetitions of one workload (scripts/bench_serving.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from tests.support.scripts import scripts_loaded

AFFINITY = os.sched_getaffinity(0)


@pytest.fixture(scope="module")
def bench():
    with scripts_loaded("bench_serving") as modules:
        yield modules["bench_serving"]


def run(tok_s: float, failed: int = 0, router_cpu: float = 1.0, ttft_ms: float = 10.0) -> dict:
    return {
        "result": {"output_throughput": tok_s, "failed": failed, "total_output_tokens": 1000, "median_ttft_ms": ttft_ms},
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
        "vllm": {
            "c=8": bench.representative([run(4000)]),
            "host_speed": [{"loop_ms": 61.0, "wakeup_us": 12.2}, {"loop_ms": 63.4, "wakeup_us": 14.0}],
        },
        "disaggregated": {
            "c=8": bench.representative([run(2000)]),
            "host_speed": [{"loop_ms": 95.2, "wakeup_us": 80.0}, {"loop_ms": 101.0, "wakeup_us": 95.0}],
        },
    }
    table = bench.report(results, workloads)
    assert "cross-core wake-up round trip, µs: vllm 12 / 14, disaggregated 80 / 95" in table
    assert "fixed Python loop, ms: vllm 61 / 63, disaggregated 95 / 101" in table
    assert "2000.0 (0.50x)" in table  # the speed is shown beside the ratios, never folded into them


def test_the_host_speed_probes_time_work_that_scales(bench):
    assert 0 < bench.loop_ms(loops=20_000) < bench.loop_ms(loops=400_000)
    speed = bench.host_speed()
    assert set(speed) == {"loop_ms", "wakeup_us"} and speed["wakeup_us"] > 0
    assert os.sched_getaffinity(0) == AFFINITY  # the probe gives the process its cores back


def test_a_dotted_override_changes_one_nested_field_and_keeps_the_rest(bench):
    args = {"prefill": {"num_replicas": 0, "num_cpus": 0.5}, "router": {"mode": "colocated"}}
    bench.set_arg(args, "prefill.env.PD_SERVE_ENGINE_CORE_BIND", "0")
    bench.set_arg(args, "replica_cpus", "all")
    assert args == {
        "prefill": {"num_replicas": 0, "num_cpus": 0.5, "env": {"PD_SERVE_ENGINE_CORE_BIND": "0"}},
        "router": {"mode": "colocated"},
        "replica_cpus": "all",
    }


def test_rounds_merge_into_the_median_run_of_all_starts_with_ratios_round_by_round(bench):
    """Each target is started once a round; the table shows the median run over every round, and
    the ratio to vLLM's server is also taken within each round (targets run minutes apart)."""
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    speed = [{"loop_ms": 50.0, "wakeup_us": 40.0}, {"loop_ms": 51.0, "wakeup_us": 41.0}]
    rounds = [
        {
            "vllm": {"host_speed": speed, "c=8": [run(4000, ttft_ms=5)]},
            "disaggregated": {"host_speed": speed, "c=8": [run(3000, ttft_ms=10)]},
        },
        {
            "vllm": {"host_speed": speed, "c=8": [run(1000, ttft_ms=20)]},
            "disaggregated": {"host_speed": speed, "c=8": [run(1500, failed=1, ttft_ms=30)]},
        },
        {
            "vllm": {"host_speed": speed, "c=8": [run(2000, ttft_ms=8)]},
            "disaggregated": {"host_speed": speed, "c=8": [run(1800, ttft_ms=20)]},
        },
    ]
    results = bench.merge_rounds(rounds, workloads)
    assert results["vllm"]["c=8"]["result"]["output_throughput"] == 2000
    assert results["disaggregated"]["c=8"]["result"]["output_throughput"] == 1800
    assert results["disaggregated"]["c=8"]["result"]["failed"] == 1  # a failure in any round counts
    assert results["disaggregated"]["c=8"]["repetitions"] == [3000, 1500, 1800]
    assert len(results["vllm"]["host_speed"]) == 6  # before and after every start
    assert bench.paired_ratios(results, "disaggregated", "c=8") == [0.75, 1.5, 0.9]
    table = bench.report(results, workloads)
    assert "1800.0 (0.90x)" in table  # the medians' ratio
    assert "  disaggregated  c=8     0.90x   (0.75x 1.50x 0.90x)" in table  # the median of the rounds' ratios
    # TTFT too, paired within each round: the median runs' TTFTs (8 and 20 ms, from different rounds) would say 2.50x.
    assert bench.paired_ratios(results, "disaggregated", "c=8", "paired_ttft") == [2.0, 1.5, 2.5]
    assert "TTFT p50 ratios to vLLM's server round by round" in table
    assert table.count("  disaggregated  c=8     2.00x   (2.00x 1.50x 2.50x)") == 1


def test_the_mocks_router_added_ttft_is_the_median_over_rounds(bench):
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    speed = [{"loop_ms": 50.0, "wakeup_us": 40.0}]
    added = [1.0, 3.0, 2.0]
    rounds = [{"mock": {"host_speed": speed, "c=8": [run(9000)], "router_added_ttft": {"router_added_ttft_p50_ms": a}}} for a in added]
    assert bench.merge_rounds(rounds, workloads)["mock"]["router_added_ttft"] == {"router_added_ttft_p50_ms": 2.0}


def test_a_failed_start_reports_the_end_of_its_log(bench, tmp_path):

    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "print('starting'); print('OSError: [Errno 98] Address already in use'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="Address already in use"):
        with bench.started(cmd, {}, log, "http://127.0.0.1:9/health", bench.REPO_ROOT, timeout_s=30):
            pass


def test_a_stopped_target_waits_for_its_own_serving_processes_not_for_others(bench, tmp_path):
    """Another app's engines (the test suite's own cluster, a server a user left running) are not
    the stopped target's: its stop waits for those it started only, not for its whole timeout."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "vllm.entrypoints.openai.api_server"])
    try:
        deadline = time.monotonic() + 30
        while stranger.pid not in bench.serving_pids():
            assert time.monotonic() < deadline, "the stand-in server is not seen as one"
            time.sleep(0.1)
        log = tmp_path / "server.log"
        server = [sys.executable, "-c", "import time; time.sleep(300)", "vllm.entrypoints.openai.api_server"]
        ours: list[int] = []

        def start_and_stop() -> None:
            with pytest.raises(TimeoutError):
                with bench.started(server, {}, log, "http://127.0.0.1:9/health", bench.REPO_ROOT, timeout_s=1):
                    pass
            ours.extend(bench.serving_pids() - {stranger.pid})

        stop = threading.Thread(target=start_and_stop, daemon=True)
        stop.start()
        stop.join(40)  # the server's SIGTERM and a second or two; waiting for the stranger: 60 s
        assert not stop.is_alive(), "the stop waited for a server it did not start"
        assert stranger.poll() is None and ours == []
    finally:
        stranger.kill()
        stranger.wait()


def test_a_streams_events_are_its_json_data_lines_without_done_comments_or_blank_lines(bench):
    async def lines():
        for line in [
            b": keep-alive\n",
            b"data: {\"choices\": [{\"text\": \"a\"}]}\n",
            b"\n",
            b"data:{\"choices\": [{\"text\": \"b\"}]}\r\n",  # no space after the colon is valid SSE
            b"event: ping\n",
            b"data: [DONE]\n",
        ]:
            yield line

    async def read():
        return [event async for event in bench.sse_events(SimpleNamespace(content=lines()))]

    assert asyncio.run(read()) == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]


def test_vllms_server_runs_the_engine_arguments_without_pd_serves_plug_ins(bench):
    """The baseline is vLLM's own server: no pd-serve connector, scheduler or logits processor,
    and every argument a plain string its CLI parses (a list's items one by one)."""
    cmd, _ = bench.vllm_server_command(8000)
    assert all(isinstance(a, str) and not a.startswith("[") for a in cmd), cmd
    assert not any("serve_app" in a for a in cmd), cmd
    assert "--logits-processors" not in cmd and "--scheduler-cls" not in cmd
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64"


def test_every_workload_draws_its_own_prompts(bench, monkeypatch):
    """vLLM's random dataset draws each prompt's start from the seed: with one seed for all, the
    warm-up's prompts were the c=8 workload's first ones and c=32's first draws c=8's, whole
    prompts the engines held in their prefix caches (74% of c=32's on the tiny model)."""
    seen = []
    monkeypatch.setattr(bench, "vllm_client", lambda port, name, tok, argv: seen.append(argv[argv.index("--seed") + 1]) or {})
    for workload in (*bench.WARM_UP, *bench.WORKLOADS):
        bench.bench(8000, workload, "tok", "name")
    assert len(set(seen)) == len(seen) == len(bench.WARM_UP) + len(bench.WORKLOADS)
    assert [w.seed for w in bench.QUICK] == [w.seed for w in bench.WORKLOADS]


def test_vllms_server_gets_a_false_engine_argument_too(bench, monkeypatch):
    """A False argument was left out, so vLLM's server kept its default (prefix caching on) while
    pd-serve's engines ran without."""
    monkeypatch.setitem(bench.OVERRIDES, "decode.engine_kwargs", {"enable_prefix_caching": False})
    cmd, _ = bench.vllm_server_command(8000)
    assert "--no-enable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd


def test_a_serve_target_is_measured_once_every_engine_it_starts_with_has_joined(bench, tmp_path, monkeypatch):
    """The router answers /health once one decode engine is in; a disaggregated app then served
    colocated until its prefill engine joined, and the first measurements were of that."""
    path = tmp_path / "app.yaml"
    path.write_text(bench.yaml.safe_dump({"applications": [{"args": {"prefill": {"num_replicas": 2}, "decode": {"num_replicas": 1}}}]}))
    expected = bench.engines_expected(["serve", "run", str(path)])
    assert expected == {"prefill": 2, "decode": 1}
    assert bench.engines_expected(["python", "-m", "vllm.entrypoints.openai.api_server"]) == {}
    listed = {"decode-0": {"role": "decode", "healthy": True}, "prefill-0": {"role": "prefill", "healthy": True}}
    monkeypatch.setattr(bench.requests, "get", lambda url, timeout: SimpleNamespace(json=lambda: {"engines": listed}))
    assert not bench.engines_joined("http://x", expected)
    listed["prefill-1"] = {"role": "prefill", "healthy": False}
    assert not bench.engines_joined("http://x", expected)
    listed["prefill-1"]["healthy"] = True
    assert bench.engines_joined("http://x", expected) and bench.engines_joined("http://x", {})


def test_a_stream_cut_short_that_vllms_client_took_for_complete_is_counted_failed(bench):
    """vLLM's client counts a stream as a success once any chunk came; every run here ignores EOS,
    so an output shorter than asked is one that was cut off."""
    assert bench.short_outputs({"output_lens": [64, 64, 12, 0, 64]}, 64) == 1  # (0: a failure it counted)
    assert bench.short_outputs({"output_lens": [64] * 3}, 64) == 0 and bench.short_outputs({}, 64) == 0


def test_a_disaggregated_figure_that_was_partly_colocated_is_flagged(bench):
    """The router falls back to colocated while no prefill engine is healthy: the share of the
    prompt tokens a prefill engine computed says whether a disaggregated run was one."""
    assert bench.handed_off_share({"prefill": 100, "decode": 100}, {"prefill": 1100, "decode": 1100}) == 1.0
    assert bench.handed_off_share({"prefill": 0, "decode": 0}, {"prefill": 600, "decode": 1000}) == 0.6
    assert bench.handed_off_share({"decode": 5}, {"decode": 5}) is None  # nothing reached a decode engine
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    whole, partly = run(2000), run(1900)
    whole["handed_off"], partly["handed_off"] = 1.0, 0.6
    results = {
        "vllm": {"c=8": bench.representative([run(4000)])},
        "colocated": {"c=8": bench.representative([{**run(3000), "handed_off": 0.0}])},
        "disaggregated": {"c=8": bench.representative([whole, partly])},
    }
    assert results["disaggregated"]["c=8"]["handed_off"] == 0.6  # the least of any repetition
    (warning,) = bench.fallback_warnings(results, workloads)  # colocated's 0% is what it should be
    assert warning.startswith("WARNING: disaggregated c=8: a prefill engine computed only 60.0%")
    assert warning in bench.report(results, workloads)
    results["disaggregated"]["c=8"] = bench.representative([whole])
    assert bench.fallback_warnings(results, workloads) == [] and "WARNING" not in bench.report(results, workloads)


def test_each_run_asks_vllms_client_for_the_output_lengths_and_keeps_little_else(bench, monkeypatch):
    """vLLM's client returns its per-request lists only with --save-detailed: without them the
    check of short outputs had nothing to read. Of those lists only the lengths are kept."""
    seen = []

    def client(port, served, tokenizer, argv):
        seen.append(argv)
        return {"output_lens": [64, 3], "ttfts": [0.1, 0.2], "itls": [[0.01]], "generated_texts": ["a", "b"], "errors": ["", "cut", "cut"]}

    monkeypatch.setattr(bench, "vllm_client", client)
    result = bench.bench(1, bench.Workload("c=8", 8, 256, 64, 2), "tok", "m")
    assert "--save-detailed" in seen[0] and result == {"output_lens": [64, 3], "errors": ["cut"]}
    assert bench.short_outputs(result, 64) == 1


def test_a_router_that_does_not_answer_leaves_the_share_unknown_not_the_run_failed(bench):
    from serve_app.runtime.ports import free_port

    assert bench.prompt_tokens_by_role(free_port()) is None  # nothing listens there
    assert bench.handed_off_share(None, {"prefill": 1, "decode": 1}) is None
    workloads = [bench.Workload("c=8", 8, 256, 64, 16)]
    nothing = {**run(1000), "handed_off": 0.0}  # a disaggregated run no prefill engine served: shown
    results = {"vllm": {"c=8": bench.representative([run(2000)])}, "disaggregated": {"c=8": bench.representative([nothing])}}
    table = bench.report(results, workloads)
    assert "  disaggregated       c=8     0.0%" in table and "WARNING: disaggregated c=8" in table
