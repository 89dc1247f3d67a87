"""How long a vLLM engine's processes spin waiting for their next message.

vLLM's EngineCore and its worker pass every step through a shared-memory queue whose reader,
after each message, busy-loops (``sched_yield``) for one second before it falls back to sleeping
on a socket: the lowest latency when one engine owns its cores. pd-serve runs several engines,
its router, Ray and Serve's proxy on the same few cores, and there a prefill engine that gets a
prompt every few hundred milliseconds spins its core away for good (measured on the 2-core
development host: the prefill worker spent 72% of its time in that loop under load, and
disaggregated throughput was a fifth of colocated).

A reader that stopped spinning sleeps on a ZeroMQ notification, and vLLM drops a notification
when the previous one is still in flight (the writer's high-water mark is 1): on a busy small host
that happens, and the reader then sleeps until its recheck interval, 5 s, with the step it should
have read waiting (seen as 5-second stalls in the serving benchmark, in pd-serve and in vLLM's own
server alike). So the plug-in also shortens that recheck to ``RECHECK_MS``: a lost notification
costs at most that, and an idle reader wakes that often to look, which costs next to nothing.

``install`` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point), loaded in
every process vLLM starts before its queues exist. When the engine's environment sets
``PD_SERVE_ENGINE_SPIN_S`` (the CPU backend does), the readers spin that long instead: still
long enough to catch the next step of a busy engine without sleeping, short enough that an idle
one gives its core back.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pd_serve.engine")

ENV = "PD_SERVE_ENGINE_SPIN_S"
RECHECK_MS = 10


def install() -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # not a vLLM with shared-memory queues: nothing to tune
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or getattr(condition, "_pd_serve_spin_s", None) is not None:
        return
    spin_s = float(value)
    original = condition.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s=spin_s):  # noqa: N807
        original(self, is_reader, context, notify_address, busy_loop_s)

    condition.__init__ = __init__
    condition._pd_serve_spin_s = spin_s
    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):  # read at every wait
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)
