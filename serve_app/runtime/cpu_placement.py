"""Which host cores pd-serve's processes run on (CPU backend).

vLLM binds each CPU engine's worker threads to cores (``VLLM_CPU_OMP_THREADS_BIND``; pd-serve's
``cpu_bind`` chooses them). Two rules follow from how the processes take turns:

* an engine's EngineCore runs on its workers' cores (``vllm_plugins/core_affinity.py``): the two
  alternate every step, and a core running elsewhere would queue for a CPU at every step;
* the router and engine replicas run on the cores no engine is bound to, when the host has any
  (``replica_cpus: spare``): a replica on an engine's core preempts that engine's forward
  (docs/performance.md, "What made the difference"). Where engines hold every core (two engines
  on two cores) the replicas run anywhere.

The engines' cores are read from the app's own engine specs, which assume every engine runs on a
host like the one the app was built on; on a cluster of unlike hosts, set ``replica_cpus: all``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

logger = logging.getLogger("pd_serve")

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def usable_cores() -> list[int]:
    """The cores this process may run on, in order: a container's cpuset may hold cores 8-11 of
    a 64-core host, and a binding to cores outside it fails (libgomp refuses it)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(max(1, os.cpu_count() or 1)))


def workers_cpus(bind: str) -> set[int] | None:
    """The cores an explicit ``VLLM_CPU_OMP_THREADS_BIND`` gives an engine's workers, all ranks
    together ("0-3|4-7" -> 0..7); None where vLLM chooses (``auto``) or binds nothing."""
    bind = bind.strip()
    if not bind or bind in ("auto", "nobind", "all"):
        return None
    cpus: set[int] = set()
    for part in bind.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return None  # not a core list vLLM would take either: leave the placement alone
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus or None


def engines_cpus(envs: Iterable[dict[str, str]]) -> set[int]:
    """Every core some engine's workers are bound to, from the engines' environments."""
    cpus: set[int] = set()
    for env in envs:
        cpus |= workers_cpus(env.get(BIND_ENV, "")) or set()
    return cpus


def spare_cpus(engines: set[int], allowed: set[int]) -> set[int] | None:
    """The cores a replica may use, keeping off the engines' cores; None (leave it where it is)
    when no engine is bound or the engines hold every core."""
    spare = allowed - engines
    if not engines or not spare:
        return None
    return spare


def bind_process(cpus: set[int]) -> None:
    """Every thread the process has so far; threads started later inherit their creator's."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def keep_off_engine_cores(engines: set[int], what: str) -> set[int] | None:
    """Move this replica onto the cores no engine is bound to; the cores it runs on now, or None
    where it stays."""
    cpus = spare_cpus(engines, os.sched_getaffinity(0))
    if cpus is None:
        return None
    bind_process(cpus)
    logger.info("%s runs on cores %s, off the engines' cores %s", what, sorted(cpus), sorted(engines))
    return cpus
