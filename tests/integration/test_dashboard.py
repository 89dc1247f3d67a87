"""The shipped Grafana dashboard (configs/grafana/pd-serve.json) against a real app: after
traffic that exercises every panel (disaggregated requests, recompute under KV pressure, a broken
push, a fallback to colocated, a prefix-cache hit), every metric its panels query is on Ray's
Prometheus endpoint."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.config.settings import REPO_ROOT
from tests.support.cluster import completion_ids, deployed, kv_pressure_args, metric_lines, token_pattern, wait_idle
from tests.support.faults import BREAK_PUSH, FAULTS, PREFILL_UNHEALTHY, faulty_prompt

pytestmark = pytest.mark.engine

DASHBOARD = REPO_ROOT / "configs" / "grafana" / "pd-serve.json"
# One decode engine with 16 blocks: three long generations at once cannot all fit.
ARGS = kv_pressure_args(decode_replicas=1)


def dashboard_metrics() -> set[str]:
    """The series names the dashboard's queries read (as Prometheus exposes them)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    return {name for expr in exprs for name in re.findall(r"\b(ray_[a-z0-9_]+)", expr)}


@pytest.fixture(scope="module")
def app(cluster):
    with deployed(cluster, "dashboard", ARGS, FAULTS) as app:
        yield app


def test_every_metric_the_dashboard_queries_is_exported_after_traffic(app, cluster):
    long = [token_pattern(300, seed=80 + i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:  # recompute: 3 x (300 + 700) tokens > 2048 of KV
        list(pool.map(lambda p: completion_ids(app, p, max_tokens=700), long))
    completion_ids(app, faulty_prompt(BREAK_PUSH, token_pattern(200, seed=90)))  # a push that breaks
    shared = token_pattern(400, seed=91)
    completion_ids(app, shared)
    completion_ids(app, shared)  # a prefix-cache hit
    completion_ids(app, faulty_prompt(PREFILL_UNHEALTHY, token_pattern(120, seed=92)))
    time.sleep(1.5)  # the router's next stats poll sees prefill unhealthy
    completion_ids(app, token_pattern(120, seed=93))  # served colocated: a fallback

    wanted = dashboard_metrics()
    deadline = time.monotonic() + 90
    while True:
        exported = {line.split("{", 1)[0].split(" ", 1)[0] for line in metric_lines(cluster.metrics_port, prefix="ray_")}
        missing = wanted - exported
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"the dashboard queries metrics that are not exported: {sorted(missing)}"
    wait_idle(app)
