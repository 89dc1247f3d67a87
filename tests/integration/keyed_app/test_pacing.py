"""Paced streams on a real vLLM engine: an engine replica spaces each stream's items out
(``stream_items_per_s``), and a stream's last tokens still leave the moment its request finishes
in the engine, not when its interval is up (engines/pacing.py). The app is conftest.py's, whose
streams are paced at one item a second."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from serve_app.config.settings import load_config
from tests.support.cluster import wait_idle

pytestmark = pytest.mark.engine

STREAMS = 4  # each may send an item every (4 - 1) / 1 = 3 s
MAX_TOKENS = 24


def stream_once(app, i: int) -> tuple[float, list[list[int]]]:
    """(seconds from request to the stream's end, the token ids of each content chunk)."""
    body = {
        "prompt": f"Stream {i}: the river ran past the old mill",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    started = time.monotonic()
    chunks: list[list[int]] = []
    with requests.post(app.base_url + "/v1/completions", json=body, headers=app.headers, stream=True, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: ") :])
            ids = event["choices"][0].get("token_ids") if event.get("choices") else None
            if ids:
                chunks.append(ids)
    return time.monotonic() - started, chunks


def test_a_paced_streams_last_tokens_leave_when_its_request_finishes(app):
    assert load_config(app.args).stream_items_per_s == 1.0
    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(lambda i: stream_once(app, i), range(STREAMS)))
    for seconds, chunks in results:
        assert sum(len(c) for c in chunks) == MAX_TOKENS
        # Paced: the engine merged the steps between items (unpaced, each token is an item).
        assert len(chunks) < MAX_TOKENS / 2, [len(c) for c in chunks]
        # Not held: the request took a small part of the 3 s a held last item would wait.
        assert seconds < 1.5, (seconds, [len(c) for c in chunks])
    wait_idle(app)
