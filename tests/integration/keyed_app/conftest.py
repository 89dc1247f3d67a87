"""The app of test_security.py and test_pacing.py: one deployment for both modules, deleted after
them (an engine app's start is most of a minute on 2 cores).

It is colocated but has a prefill engine, so its decode engine loads the KV connector (what
test_security.py attacks); clients need a key; its engines are a reasoning model's; and its
streams are paced at one item a second, which only streams sharing an engine notice: a lone
stream gets every token at once, and every test but test_pacing.py's sends one request at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import Cluster, DeployedApp, deployed


@pytest.fixture(scope="package")
def app(cluster: Cluster) -> Iterator[DeployedApp]:
    args = {
        "served_model_name": "tiny-llama",
        "max_model_len": 2048,
        # A reasoning model's engine (qwen3's parser; grammars hold its thinking too).
        "engine_kwargs": {"structured_outputs_config": {"reasoning_parser": "qwen3", "enable_in_reasoning": True}},
        "prefill": {"num_replicas": 1, "num_cpus": 0.1},
        "decode": {"num_replicas": 1, "num_cpus": 0.1},
        # Clients need a key (vLLM's --api-key): every request sends it (tests/support/cluster.py).
        "router": {"mode": "colocated", "num_cpus": 0.05, "api_keys": ["token-abc123"]},
        # With four streams on the engine, each may send an item every (4 - 1) / 1 = 3 s.
        "stream_items_per_s": 1.0,
    }
    with deployed(cluster, "sec", args) as app:
        yield app
