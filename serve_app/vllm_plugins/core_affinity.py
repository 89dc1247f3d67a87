"""A CPU engine's EngineCore process runs on its workers' cores.

vLLM binds a CPU engine's worker threads to cores (``VLLM_CPU_OMP_THREADS_BIND``) and lets its
EngineCore process run anywhere. The two take turns, every step: the worker computes the forward
while the core sleeps (vllm_plugins/spin.py), then the core reads the output, schedules the next step
and hands it over while the worker waits. A free-running core, woken for that turn, queues for a
CPU behind whatever else runs there: on a small host the router, the engine replicas, the other
engine and Ray, so every decode step waits for it. On its workers' own cores the only other thread
ready to run is the worker that is waiting for it (and yields: it spins with ``sched_yield``).
See docs/performance.md, "What made the difference".

``install`` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point); vLLM
loads the plugins in the EngineCore process before it starts the workers. It acts only there,
only when the engine's environment sets ``PD_SERVE_ENGINE_CORE_BIND=1`` (the CPU backend does for
engines whose threads it binds) and only for explicit core lists, never vLLM's ``auto`` or
``nobind``. Workers started afterwards bind their own threads as before.
"""

from __future__ import annotations

import logging
import os

from serve_app.runtime.cpu_placement import BIND_ENV, bind_process, workers_cpus
from serve_app.vllm_plugins.processes import ENGINE_CORE_PROCESS, named

logger = logging.getLogger("pd_serve.engine")

ENV = "PD_SERVE_ENGINE_CORE_BIND"


def install() -> None:
    if os.environ.get(ENV) != "1" or not named(ENGINE_CORE_PROCESS):
        return
    cpus = workers_cpus(os.environ.get(BIND_ENV, ""))
    if cpus is None:
        return
    try:
        # Not limited to the mask inherited from the replica: the workers' cores are the point.
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("engine core not bound to %s=%s: %s", BIND_ENV, os.environ.get(BIND_ENV), exc)
        return
    bind_process(cpus)
    logger.info("engine core %d runs on its workers' cores %s", os.getpid(), sorted(cpus))
