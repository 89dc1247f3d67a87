"""The engine spin plug-in (serve_app/engines/spin.py), in a fresh interpreter (it patches vLLM's
module state): it bounds the readers' spin and their recheck interval only when asked to."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import zmq
from serve_app.engines import spin
from vllm.distributed.device_communicators import shm_broadcast as shm
spin.install()
cond = shm.SpinCondition(True, zmq.Context(), "inproc://pd-serve-spin-probe")
print(cond.busy_loop_s, shm.SHM_READER_RECHECK_INTERVAL_MS)
"""


def probe(env_value: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PD_SERVE_ENGINE_SPIN_S"}
    if env_value is not None:
        env["PD_SERVE_ENGINE_SPIN_S"] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_the_plugin_bounds_the_spin_and_the_recheck_of_pd_serve_engines():
    from serve_app.engines.spin import RECHECK_MS

    busy_loop_s, recheck_ms = probe("0.005")
    assert float(busy_loop_s) == 0.005
    assert int(recheck_ms) == RECHECK_MS < 5000


def test_other_vllm_processes_keep_vllms_defaults():
    busy_loop_s, recheck_ms = probe(None)
    assert float(busy_loop_s) == 1.0
    assert int(recheck_ms) == 5000
