"""Fixtures of the fast tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def engines_without_ray(monkeypatch):
    """Engine replicas report to Ray's metrics; in the in-process app they report to nothing."""
    import serve_app.engines.server as server
    from tests.unit.inprocess import null_engine_metrics

    monkeypatch.setattr(server, "engine_metrics", null_engine_metrics)
