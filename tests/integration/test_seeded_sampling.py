"""Seeded sampling on a real vLLM CPU engine (vllm_plugins/seeded_sampling.py), without Ray: a
prompt longer than the engine's step budget, which vLLM alone cannot sample seeded (its undo of
a chunk's draw raises on a CPU generator and the engine core dies), and a resumed attempt, which
must go on with the draws where the request left off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.vllm_plugins.seeded_sampling import ENV
from tests.support.seeded_engine_driver import EARLIER, PROMPT

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "seeded_engine_driver.py"
WHOLE_BUDGET = 2048  # the prompt in one step
CHUNK_BUDGET = 64  # the prompt in five


def run_driver(budgets: list[int], plugin: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: "1" if plugin else "0", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(DRIVER), ",".join(map(str, budgets))], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def result_of(proc: subprocess.CompletedProcess) -> dict[str, dict[str, list[int]]]:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_seeded_sampling_survives_chunked_prefill_and_resumes_where_it_left_off():
    assert len(PROMPT) > 4 * CHUNK_BUDGET
    result = result_of(run_driver([WHOLE_BUDGET, CHUNK_BUDGET], plugin=True))
    whole, chunked = result[str(WHOLE_BUDGET)], result[str(CHUNK_BUDGET)]
    # The chunks' thrown-away draws were undone: the same tokens as in one step.
    assert chunked["whole"] == whole["whole"]
    # A resumed attempt samples what the uninterrupted request sampled next.
    assert whole["resumed"] == whole["whole"][EARLIER:]
    assert chunked["resumed"] == whole["whole"][EARLIER:]


def test_without_the_plugin_vllm_loses_the_engine_or_the_place():
    """The premises: vLLM alone makes a resumed attempt's generator from the seed afresh, and its
    engine core dies on a seeded prompt it computes in chunks."""
    result = result_of(run_driver([WHOLE_BUDGET], plugin=False))[str(WHOLE_BUDGET)]
    assert result["resumed"] != result["whole"][EARLIER:]
    chunked = run_driver([CHUNK_BUDGET], plugin=False)
    assert chunked.returncode != 0 and "CPU Generator does not use offset" in chunked.stderr, chunked.stderr[-3000:]
