"""Gauges that keep their last value on Ray's Prometheus endpoint (runtime/metrics.KeptGauges):
Ray drops a gauge series that is not set again within some 20-30 s, so the router's gauges that
change now and then and vLLM's gauges on an idle engine are set again every second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from serve_app.config.settings import REPO_ROOT
from serve_app.runtime.metrics import KeptGauge, KeptGauges


class FakeGauge:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []
        self.fail = fail
        self.lock = threading.Lock()

    def set(self, value: float, tags: dict[str, str]) -> None:
        with self.lock:
            self.calls.append((value, dict(tags)))
        if self.fail and len(self.calls) > 1:
            raise RuntimeError("ray is shutting down")


def test_each_series_is_set_again_to_its_last_value():
    keeper = KeptGauges(interval_s=3600)  # refreshed by hand here
    pool, inflight = FakeGauge(), FakeGauge()
    keeper.set(pool, 2, {"role": "decode"})
    keeper.set(pool, 1, {"role": "prefill"})
    keeper.set(pool, 3, {"role": "decode"})  # the latest value of a series wins
    keeper.set(inflight, 0)
    assert pool.calls == [(2, {"role": "decode"}), (1, {"role": "prefill"}), (3, {"role": "decode"})]
    pool.calls.clear()
    inflight.calls.clear()
    keeper.refresh()
    assert sorted(pool.calls, key=lambda c: c[1]["role"]) == [(3, {"role": "decode"}), (1, {"role": "prefill"})]
    assert inflight.calls == [(0, {})]


def test_a_gauge_that_fails_to_set_again_does_not_stop_the_others():
    keeper = KeptGauges(interval_s=3600)
    broken, fine = FakeGauge(fail=True), FakeGauge()
    keeper.set(broken, 1)
    keeper.set(fine, 5)
    keeper.refresh()
    keeper.refresh()
    assert fine.calls == [(5, {})] * 3


def test_one_thread_sets_them_again_on_its_interval():
    keeper = KeptGauges(interval_s=0.02)
    gauge = FakeGauge()
    before = {t.ident for t in threading.enumerate()}
    try:
        KeptGauge(gauge, keeper).set(7, tags={"role": "router"})
        KeptGauge(gauge, keeper).set(8, tags={"role": "router"})
        started = [t for t in threading.enumerate() if t.ident not in before and t.name == "pd-kept-gauges"]
        assert len(started) == 1 and started[0].daemon
        deadline = time.monotonic() + 10
        while gauge.calls[-4:] != [(8, {"role": "router"})] * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        with gauge.lock:
            assert gauge.calls[-4:] == [(8, {"role": "router"})] * 4, gauge.calls
    finally:
        keeper.stop()
    started[0].join(timeout=5)
    assert not started[0].is_alive()


def test_the_routers_gauges_that_change_now_and_then_are_kept():
    from serve_app.runtime.metrics import router_metrics

    metrics = router_metrics()
    assert isinstance(metrics.pool_replicas, KeptGauge) and isinstance(metrics.router_inflight, KeptGauge)


def test_vllms_gauges_keep_their_last_value_and_its_counters_are_not_repeated(monkeypatch):
    from serve_app.vllm_plugins import stat_logger

    keeper = KeptGauges(interval_s=3600)
    monkeypatch.setattr(stat_logger, "kept_gauges", lambda: keeper)
    cls = stat_logger.ray_stat_logger("decode-0", "decode")
    gauge = cls._gauge_cls("vllm:num_requests_running", "running requests", labelnames=["model_name", "engine"]).labels("tiny", "0")
    counter = cls._counter_cls("vllm:prompt_tokens", "prompt tokens", labelnames=["model_name", "engine"]).labels("tiny", "0")
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(gauge.metric, "set", lambda value, tags: calls.append(("set", value, tags)))
    monkeypatch.setattr(counter.metric, "inc", lambda value, tags: calls.append(("inc", value, tags)))
    gauge.set(4)
    counter.inc(10)
    keeper.refresh()
    tags = {"model_name": "tiny", "engine": "decode-0", "role": "decode", "ReplicaId": ""}
    assert calls == [("set", 4, tags), ("inc", 10, tags), ("set", 4, tags)]
    # The LoRA info gauge (a series per set of adapters, its value a time) is not kept.
    info = cls._gauge_cls("vllm:lora_requests_info", "adapters", labelnames=["running_lora_adapters"]).labels("a,b")
    monkeypatch.setattr(info.metric, "set", lambda value, tags: calls.append(("info", tags)))
    calls.clear()
    info.set_to_current_time()
    keeper.refresh()
    assert calls == [("info", {"running_lora_adapters": "a,b", "engine": "decode-0", "role": "decode", "ReplicaId": ""}), ("set", 4, tags)]


PROBE = """
import json, socket, sys, time, urllib.request
import ray
from ray.util.metrics import Gauge

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})

@ray.remote
class Owner:
    def __init__(self):
        self.kept = Gauge("pd_probe_kept", "kept", tag_keys=("k",))
        self.plain = Gauge("pd_probe_plain", "not kept", tag_keys=("k",))

    def set_once(self):
        from serve_app.runtime.metrics import KeptGauge
        KeptGauge(self.kept).set(3, tags={"k": "a"})
        self.plain.set(3, tags={"k": "a"})

owner = Owner.remote()
ray.get(owner.set_once.remote())
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[1]):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    names = sorted({line.split("{")[0] for line in text.splitlines() if line.startswith("ray_pd_probe_")})
    print(json.dumps([round(time.monotonic() - start, 1), names]), flush=True)
    if names == ["ray_pd_probe_kept"]:
        break
    time.sleep(1)
"""


@pytest.mark.slow
def test_on_ray_a_kept_gauge_stays_on_the_endpoint_after_an_unkept_one_set_with_it_has_left(tmp_path):
    """Ray's own behaviour is the control: the gauge set once, as the kept one was, leaves."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "90"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    seen = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert done.returncode == 0 and seen, done.stderr[-3000:]
    both = [at for at, names in seen if names == ["ray_pd_probe_kept", "ray_pd_probe_plain"]]
    assert both, seen  # exported at all
    after = [names for at, names in seen if at > both[0]]
    assert after and after[-1] == ["ray_pd_probe_kept"], seen  # the plain one left, the kept one stayed
    assert all("ray_pd_probe_kept" in names for names in after), seen


def test_vllms_scheduler_gauges_are_recorded_idle_when_the_logger_starts(monkeypatch):
    """An engine that has not stepped yet (a prefill engine before its first prompt) is on the
    dashboard at 0, as on vLLM's own server, not missing."""
    from vllm.v1.metrics import ray_wrappers
    from vllm.v1.metrics.stats import SchedulerStats

    from serve_app.vllm_plugins import stat_logger

    base = ray_wrappers.RayPrometheusStatLogger
    recorded: list[tuple[Any, ...]] = []

    def init(self: Any, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]

    cls = stat_logger.ray_stat_logger("prefill-0", "prefill")  # checks vLLM's real record() first
    monkeypatch.setattr(base, "__init__", init)
    monkeypatch.setattr(base, "record", lambda self, *args: recorded.append(args))
    cls(None, [0])
    ((scheduler, iteration, mm, index),) = recorded
    assert scheduler == SchedulerStats() and iteration is None and mm is None and index == 0
