"""How long a vLLM engine's processes spin waiting for their next message.

vLLM's EngineCore and its worker pass every step through a shared-memory queue whose reader,
after each message, busy-loops (``sched_yield``) for one second before it falls back to sleeping
on a socket: the lowest latency when one engine owns its cores. pd-serve runs several engines,
its router, Ray and Serve's proxy on the same few cores, and there a prefill engine that gets a
prompt every few hundred milliseconds spins its core away for good, taking it from everything
else on the host.

A reader that stopped spinning sleeps on a ZeroMQ notification, and vLLM's writer drops a
notification while the previous one is still in flight (its high-water mark is 1): on a busy
small host that happens, and the reader then sleeps until its recheck interval, 5 s, with the
step it should have read waiting (vLLM's own server stalls the same way). So the plug-in lets the
writer keep ``NOTIFY_HWM`` notifications in flight (the reader conflates them: nothing piles up),
and shortens the recheck to ``RECHECK_MS`` as a backstop.

``install`` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point), loaded
in every process vLLM starts before its queues exist. When the engine's environment sets
``PD_SERVE_ENGINE_SPIN_S`` (the CPU backend does), the readers spin that long instead: still long
enough to catch the next step of a busy engine without sleeping, short enough that an idle one
gives its core back. ``PD_SERVE_ENGINE_CORE_SPIN_S`` bounds the engine core's own wait on its
workers, which lasts a whole forward pass: spinning through it would keep a second core busy for
every running engine (docs/performance.md, "What made the difference"). Once no wake-up is lost,
sleeping through a forward costs the core one wake-up of some tens of microseconds.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.engine")

ENV = "PD_SERVE_ENGINE_SPIN_S"
CORE_ENV = "PD_SERVE_ENGINE_CORE_SPIN_S"
RECHECK_MS = 10
NOTIFY_HWM = 64

SPIN_CONDITION = "vllm.distributed.device_communicators.shm_broadcast.SpinCondition.__init__"
RECHECK_INTERVAL = "vllm.distributed.device_communicators.shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS"


def install() -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # not a vLLM with shared-memory queues: nothing to tune
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if getattr(condition, "_pd_serve_spin_s", None) is not None:
        return
    if unchanged([SPIN_CONDITION], logger, "the bound on the engine's spin and the kept wake-ups"):
        _bound_spin(condition, float(value))
    if unchanged([RECHECK_INTERVAL], logger, f"the {RECHECK_MS} ms recheck of the engine's queues"):  # read at every wait
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)


def _bound_spin(condition: Any, spin_s: float) -> None:
    original = condition.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s=spin_s):  # noqa: N807
        if not is_reader:
            context = _NotifyContext(context)
        else:
            busy_loop_s = _reader_spin_s(busy_loop_s)
        original(self, is_reader, context, notify_address, busy_loop_s)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]  # what the manifest's check reads
    condition.__init__ = __init__
    condition._pd_serve_spin_s = spin_s


def _reader_spin_s(default: float) -> float:
    """The engine core waits on its workers for a whole forward pass: spinning through it keeps a
    second core busy for nothing, so it has its own, shorter, bound (``CORE_ENV``). A worker waits
    only for the core's short bookkeeping between two steps and keeps ``ENV``'s."""
    from serve_app.vllm_plugins.processes import ENGINE_CORE_PROCESS, named

    value = os.environ.get(CORE_ENV)
    if value and named(ENGINE_CORE_PROCESS):
        return float(value)
    return default


class _NotifyContext:
    """The writer's ZeroMQ context, as ``SpinCondition`` sees it: its notification socket keeps
    ``NOTIFY_HWM`` wake-ups in flight instead of one. With one, a wake-up sent while the last is
    still between the two processes is dropped, and the reader that went to sleep waiting for it
    sleeps until its recheck. Readers conflate what they receive, so nothing piles up."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def socket(self, socket_type: int, **kwargs: Any) -> Any:
        return self._context.socket(socket_type, socket_class=_notify_socket_class(), **kwargs)


@functools.cache
def _notify_socket_class() -> type:
    import zmq

    class NotifySocket(zmq.Socket):
        def setsockopt(self, option: int, value: Any) -> None:  # vLLM sets SNDHWM=1 before binding
            if option == zmq.SNDHWM:
                value = max(value, NOTIFY_HWM) if value else value
            super().setsockopt(option, value)

    return NotifySocket
