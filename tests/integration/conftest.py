"""Fixtures of the integration tests: one Ray cluster and Serve instance per session, and the
colocated reference app. The helpers (deploying apps, ports, the idle check, metrics, engine
handles, log files) are in tests/support/cluster.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import yaml

from tests.support.cluster import BASELINE_ARGS, SERVE_YAML, Cluster, DeployedApp, deploy, free_port


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    metrics_port = free_port()
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False, _metrics_export_port=metrics_port)
    file = yaml.safe_load(SERVE_YAML.read_text())
    http = dict(file.get("http_options", {}))
    http["port"] = free_port()
    serve.start(http_options=http, proxy_location=file.get("proxy_location", "HeadOnly"))
    try:
        yield Cluster(http_port=http["port"], metrics_port=metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def baseline_app(cluster: Cluster) -> Iterator[DeployedApp]:
    """Colocated, one decode engine, no KV pressure: the reference for token-exact checks."""
    from ray import serve

    app = deploy(cluster, "baseline", "/baseline", BASELINE_ARGS)
    yield app
    serve.delete(app.name)
