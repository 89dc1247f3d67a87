"""Which of vLLM's processes a plug-in is loaded in.

vLLM loads its general plug-ins in every process of an engine: the engine's own (here, the Serve
replica), the engine core and each worker. A plug-in acts where the code it changes runs, and
nowhere else: importing the scheduler or the model runner elsewhere costs start-up for nothing.
vLLM names the engine core's process ``EngineCore...`` and each worker's ``VllmWorker-...``
(``WorkerProc.make_worker_process``, in the private-symbol manifest); with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine's own process runs both.
"""

from __future__ import annotations

import multiprocessing
import os

ENGINE_CORE_PROCESS = "EngineCore"
WORKER_PROCESS = "VllmWorker-"
# Set to "1" in a pd-serve engine replica's environment (config/backends.py), which its engine's
# processes inherit; named for the first plug-in that needed it.
ENGINE_CHILD_ENV = "PD_SERVE_PARENT_WATCHDOG"


def named(prefix: str) -> bool:
    return multiprocessing.current_process().name.startswith(prefix)


def engine_in_process() -> bool:
    """vLLM runs the engine core and the model in the engine's own process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def in_engine_core() -> bool:
    """The process that runs vLLM's scheduler: the EngineCore process, or a process that runs its
    engine in-process."""
    return engine_in_process() or named(ENGINE_CORE_PROCESS)


def runs_the_model() -> bool:
    """A vLLM worker process, or a process that runs its engine (and model) in-process."""
    return engine_in_process() or named(WORKER_PROCESS)


def pd_serve_engine_child() -> bool:
    """A child process of a pd-serve engine: the EngineCore or a worker. The replica itself, and
    an engine run in-process, have no multiprocessing parent."""
    return os.environ.get(ENGINE_CHILD_ENV) == "1" and multiprocessing.parent_process() is not None
