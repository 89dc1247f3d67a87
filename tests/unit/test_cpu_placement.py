"""Where pd-serve's processes run (serve_app/runtime/cpu_placement.py): an EngineCore process of a CPU
engine runs on its workers' cores, every thread of it (the plug-in vllm_plugins/core_affinity.py), and
nothing else moves; the router and engine replicas keep off the engines' cores where the host has
others."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serve_app.runtime.cpu_placement import engines_cpus, spare_cpus, workers_cpus

PROBE = """
import multiprocessing, os, sys, threading, time
multiprocessing.current_process().name = sys.argv[1]  # as vLLM names its processes
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(30)), daemon=True).start()  # there before install
started.wait()
from serve_app.vllm_plugins import core_affinity
core_affinity.install()
later = threading.Thread(target=lambda: time.sleep(30), daemon=True)  # started after install
later.start()
masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
print(";".join(",".join(map(str, m)) for m in sorted(masks)), flush=True)
os._exit(0)
"""


def thread_masks(process_name: str, env: dict[str, str]) -> set[frozenset[int]]:
    base = {k: v for k, v in os.environ.items() if k not in ("PD_SERVE_ENGINE_CORE_BIND", "VLLM_CPU_OMP_THREADS_BIND")}
    done = subprocess.run([sys.executable, "-c", PROBE, process_name], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return {frozenset(int(c) for c in mask.split(",")) for mask in done.stdout.strip().split(";")}


@pytest.fixture
def one_core() -> int:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a host with one core cannot tell a bound process from a free one")
    return max(os.sched_getaffinity(0))


def test_an_engine_core_moves_every_thread_onto_its_workers_cores(one_core):
    env = {"PD_SERVE_ENGINE_CORE_BIND": "1", "VLLM_CPU_OMP_THREADS_BIND": str(one_core)}
    assert thread_masks("EngineCore_DP0", env) == {frozenset({one_core})}


@pytest.mark.parametrize(
    ("process_name", "env"),
    [
        ("VllmWorker-0", {"PD_SERVE_ENGINE_CORE_BIND": "1"}),  # workers bind themselves
        ("MainProcess", {"PD_SERVE_ENGINE_CORE_BIND": "1"}),  # the engine replica
        ("EngineCore_DP0", {}),  # not asked to
        ("EngineCore_DP0", {"PD_SERVE_ENGINE_CORE_BIND": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
        ("EngineCore_DP0", {"PD_SERVE_ENGINE_CORE_BIND": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}),
    ],
)
def test_nothing_else_moves(one_core, process_name, env):
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(one_core), **env}
    assert thread_masks(process_name, env) == {frozenset(os.sched_getaffinity(0))}


def test_worker_core_lists_are_read_as_vllm_reads_them():
    assert workers_cpus("0") == {0}
    assert workers_cpus("1,3") == {1, 3}
    assert workers_cpus("0-3|4-7") == set(range(8))  # every tensor-parallel rank's cores
    assert workers_cpus(" 2-3 ") == {2, 3}
    for chosen_by_vllm in ("auto", "nobind", "all", ""):
        assert workers_cpus(chosen_by_vllm) is None
    assert workers_cpus("0-x") is None and workers_cpus("cores") is None


def test_replicas_use_the_cores_no_engine_is_bound_to():
    assert spare_cpus({0}, {0, 1}) == {1}
    assert spare_cpus({0, 2}, {0, 1, 2, 3}) == {1, 3}
    assert spare_cpus({0, 1}, {0, 1}) is None  # engines hold every core: run anywhere
    assert spare_cpus(set(), {0, 1}) is None  # no engine bound: nothing to keep off
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "2-3|4"}, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {}]
    assert engines_cpus(envs) == {0, 2, 3, 4}


KEEP_OFF = """
import os, sys, threading, time
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(30)), daemon=True).start()
started.wait()
from serve_app.runtime.cpu_placement import keep_off_engine_cores
cpus = keep_off_engine_cores({int(c) for c in sys.argv[1].split(",") if c}, "probe")
masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
print(sorted(cpus) if cpus is not None else None, sorted(masks), flush=True)
os._exit(0)
"""


def keep_off(engines: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", KEEP_OFF, engines], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    returned, _, masks = done.stdout.strip().partition(" ")
    return returned, masks


def test_a_replica_moves_every_thread_off_the_engines_cores(one_core):
    host = sorted(os.sched_getaffinity(0))
    rest = [c for c in host if c != one_core]
    assert keep_off(str(one_core)) == (str(rest), str([tuple(rest)]))
    assert keep_off(",".join(map(str, host))) == ("None", str([tuple(host)]))  # engines hold every core
    assert keep_off("") == ("None", str([tuple(host)]))
