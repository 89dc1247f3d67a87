"""Fixtures of the tests on the app of configs/serve.yaml (test_foundation.py, test_fuzz.py): one
deployment of it for both modules, deleted after them (an engine app's start is most of a
minute on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import Cluster, DeployedApp, deploy, serve_yaml_app


@pytest.fixture(scope="package")
def app(cluster: Cluster) -> Iterator[DeployedApp]:
    from ray import serve

    spec = serve_yaml_app()
    deployed = deploy(cluster, spec["name"], spec["route_prefix"], spec["args"])
    yield deployed
    serve.delete(deployed.name)
