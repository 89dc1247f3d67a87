"""The router, its OpenAI parsing and the engine deployments on vLLM 0.23, the vLLM that
vllm-ascend 0.23.0.post1 runs on: the fast tests of those parts, run again in a Python whose
``vllm`` is 0.23.0 (the overlay scripts/make_vllm023_overlay.py builds; `make test` builds it).

What this cannot cover: a vLLM 0.23 *engine* (its compiled kernels need torch 2.11, which this
machine lacks), and serve_app/kv (the CPU backend's plug-ins, written for vLLM 0.32's connector
API, which the Ascend path never imports: checked below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
OVERLAY = REPO_ROOT / ".cache" / "vllm-0.23"

# The fast tests of everything on the Ascend path (no Ray cluster, no engine).
ROUTER_TESTS = [
    "tests/unit/test_orchestration.py",
    "tests/unit/test_parsing.py",
    "tests/unit/test_choices.py",
    "tests/unit/test_echo.py",
    "tests/unit/test_prompt_logprobs.py",
    "tests/unit/test_tokenization.py",
    "tests/unit/test_request_ids.py",
    "tests/unit/test_priority.py",
    "tests/unit/test_tools.py",
    "tests/unit/test_reasoning.py",
    "tests/unit/test_recompute.py",
    "tests/unit/test_sampling_defaults.py",
    "tests/unit/test_balancer.py",
    "tests/unit/test_text.py",
    "tests/unit/test_config.py",
    "tests/unit/test_backends.py",
    "tests/unit/test_metaserver.py",
    "tests/unit/test_mock_engine.py",
    "tests/unit/test_logs.py",
    "tests/unit/test_vllm_metrics_throttle.py",
    "tests/unit/test_private_symbols.py",
    # Ascend engine cores load it too: checked on 0.23's xgrammar backend.
    "tests/unit/test_resumed_grammar.py",
    # Not loaded on Ascend by default, but docs/ascend.md tells how: checked on 0.23's sampler ops.
    "tests/unit/test_resumed_output.py",
]


def on_vllm_023(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    if not (OVERLAY / ".built").exists():
        pytest.fail(f"{OVERLAY} is missing: `make test` builds it (scripts/make_vllm023_overlay.py)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE")}
    env["PYTHONPATH"] = str(OVERLAY)
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_ascend_path_imports_on_vllm_023_without_the_cpu_plugins():
    probe = (
        "import sys, vllm\n"
        "import serve_app.app, serve_app.router.deployment, serve_app.router.service\n"
        "import serve_app.engines.decode, serve_app.engines.prefill, serve_app.engines.vllm_runner\n"
        "print(vllm.__version__)\n"
        "print(sorted(m for m in sys.modules if m.startswith('serve_app.kv')))\n"
    )
    done = on_vllm_023("-c", probe)
    assert done.returncode == 0, done.stderr[-4000:]
    version, kv_modules = done.stdout.strip().splitlines()[-2:]
    assert version == "0.23.0"
    assert kv_modules == "[]"


def test_the_routers_fast_tests_pass_on_vllm_023():
    # Same interpreter and PYTHONPATH as the probe above, which checked that vLLM is 0.23.0.
    done = on_vllm_023("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov", "-m", "not engine", "-W", "ignore", *ROUTER_TESTS)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail
