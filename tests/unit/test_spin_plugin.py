"""The engine spin plug-in (serve_app/vllm_plugins/spin.py), in a fresh interpreter (it patches vLLM's
module state): it bounds the readers' spin and their recheck interval, gives the engine core its
own bound, and keeps every wake-up a writer sends, only when asked to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Each test starts fresh interpreters that import vLLM: seconds of CPU each.
pytestmark = pytest.mark.slow

PROBE = """
import multiprocessing, os, sys, time
import zmq
from serve_app.vllm_plugins import spin
from vllm.distributed.device_communicators import shm_broadcast as shm
spin.install()
multiprocessing.current_process().name = sys.argv[1]  # as vLLM names its processes
context = zmq.Context()
reader = shm.SpinCondition(True, context, "inproc://pd-serve-spin-probe")
# A writer, and a plain subscriber that counts what it was sent: every notify() the writer makes
# while earlier ones are still in flight either arrives or was dropped by the writer.
writer = shm.SpinCondition(False, context, "ipc:///tmp/pd-serve-spin-probe-%d" % id(context))
counter = context.socket(zmq.SUB)
counter.setsockopt_string(zmq.SUBSCRIBE, "")
counter.connect(writer.local_notify_socket.getsockopt_string(zmq.LAST_ENDPOINT))
time.sleep(0.3)  # the subscription reaches the writer
for _ in range(10):
    writer.notify()
received = 0
while counter.poll(300):
    counter.recv()
    received += 1
print(reader.busy_loop_s, shm.SHM_READER_RECHECK_INTERVAL_MS, received, flush=True)
os._exit(0)  # skip ZeroMQ's teardown of the half-connected probe sockets
"""


def probe(spin: str | None, core_spin: str | None = None, process_name: str = "VllmWorker-0") -> tuple[float, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_SERVE_ENGINE_")}
    if spin is not None:
        env["PD_SERVE_ENGINE_SPIN_S"] = spin
    if core_spin is not None:
        env["PD_SERVE_ENGINE_CORE_SPIN_S"] = core_spin
    done = subprocess.run([sys.executable, "-c", PROBE, process_name], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    busy_loop_s, recheck_ms, received = done.stdout.split()
    return float(busy_loop_s), int(recheck_ms), int(received)


def test_the_plugin_bounds_the_spin_and_the_recheck_of_pd_serve_engines():
    from serve_app.vllm_plugins.spin import RECHECK_MS

    busy_loop_s, recheck_ms, _ = probe("0.005")
    assert busy_loop_s == 0.005
    assert recheck_ms == RECHECK_MS < 5000


def test_the_engine_core_gets_its_own_spin_and_workers_keep_theirs():
    assert probe("0.005", "0.0001", process_name="EngineCore")[0] == 0.0001
    assert probe("0.005", "0.0001", process_name="EngineCore_DP0")[0] == 0.0001
    assert probe("0.005", "0.0001", process_name="VllmWorker-0")[0] == 0.005
    assert probe("0.005", None, process_name="EngineCore")[0] == 0.005


def test_no_wakeup_is_dropped_while_another_is_in_flight():
    """vLLM's writer keeps one notification in flight and drops the next: a reader asleep on the
    dropped one sleeps until its recheck. With the plug-in every one is delivered."""
    assert probe("0.005")[2] == 10


def test_other_vllm_processes_keep_vllms_defaults():
    busy_loop_s, recheck_ms, received = probe(None, None, process_name="EngineCore")
    assert busy_loop_s == 1.0
    assert recheck_ms == 5000
    assert received < 10  # vLLM's own writer drops what is sent while one is in flight
