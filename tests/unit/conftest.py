"""Fixtures of the fast tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["grpc", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    """``router.engine_transport`` of the in-process app (tests/support/inprocess.py): its calls to
    the engines through the Serve handle stand-ins (grpc), or over the engines' own HTTP endpoints
    (http). A test that takes it runs once over each."""
    return request.param
