"""Engine processes die with their replica.

vLLM runs an engine in child processes (EngineCore, and its worker). Its workers watch the
EngineCore through a pipe, but the EngineCore does not watch its parent: when a replica dies
without shutting its engine down (the raylet killed, `ray stop --force`, a SIGKILL), the
EngineCore and its worker live on as orphans and keep their KV ports, so the next start fails.

``install`` is registered as a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry
point), which vLLM loads in every process it starts. In a child process of a pd-serve engine
(``PD_SERVE_PARENT_WATCHDOG=1`` in its environment) it starts a thread that ends the process as
soon as its parent is gone, that is, as soon as it has been re-parented.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from serve_app.vllm_plugins.processes import pd_serve_engine_child

logger = logging.getLogger("pd_serve.engine")

POLL_S = 0.5

_started = False


def install() -> None:
    global _started
    if _started or not pd_serve_engine_child():
        return
    _started = True
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent,), name="pd-serve-parent-watchdog", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    logger.warning("parent process %d is gone; ending engine process %d", parent, os.getpid())
    # Nothing is left to flush for a parent that is dead; SIGKILL cannot hang on a cleanup.
    os.kill(os.getpid(), signal.SIGKILL)
