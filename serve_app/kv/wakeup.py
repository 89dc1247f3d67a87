"""Wakes a decode engine's core when a KV transfer moves on, instead of polling its worker.

While every request a decode engine holds waits for its KV, vLLM's engine core runs steps without
a forward, each asking the worker whether a transfer finished, and sleeps 1 ms after each (the
``time.sleep`` in ``EngineCoreProc._process_engine_step``, vllm/v1/engine/core.py). That poll
costs twice. Between a prompt's last KV frame and its first decode step it puts two sleeps: one
before the step whose worker reports the transfer, and one after it, before the step that
schedules the request. And for the whole of a prompt's prefill, each step is a round trip to the
worker, whose reader then spins for its next message: the decode engine's worker and core keep a
core busy doing nothing, and on a small host the router, the replicas and Ray move onto the core
the prefill forward runs on (docs/performance.md, "What made the difference").

So the consumer's two processes get a doorbell: the engine core's scheduler side binds a UDP
socket on the loopback (its port goes to the worker in each step's connector metadata), and the
engine core's sleep after a forward-less step becomes a wait on that socket. The worker rings it
when a transfer has something for a step to do: a layer frame to write, a done or failed frame,
a connection that broke. The scheduler side marks the doorbell when a step reported a finished
receive, so the step that schedules the request follows at once.

How long the wait lasts depends on what the scheduler holds. When every request it holds waits
for its KV (and none finished), only a ring or new input can give a step anything to do, so the
wait goes on in slices of vLLM's interval until a ring, until the engine core's input queue has a
message (a new request or an abort: admission is not slowed), or for at most ``KV_WAIT_MAX_S``,
after which a step runs anyway (transfer deadlines, lost datagrams). In any other state, a
request waiting for its grammar for example, the wait lasts vLLM's interval, as before. A lost
datagram costs at most one bound, never correctness.

Any local process can send a datagram to a loopback port, so a bare datagram must not count as a
ring, or a flood of them would keep the engine core running forward-less steps instead of
sleeping. Each doorbell makes a random token (its only copy outside the engine-core process goes
to the worker in the step metadata, next to the port); a ring is a datagram carrying exactly that
token, and anything else is read and dropped while the wait goes on to the end of its interval.

The wait is installed by replacing ``time`` in vLLM's engine-core module with a proxy whose
``sleep`` waits on the doorbell, only after checking the module's source: its one ``time.sleep``
must be that poll (as in vLLM 0.32); where vLLM's module differs it is left alone
and the engine polls as before. The proxy finds the engine core and its scheduler once, as the
caller of that sleep; where it cannot, where the engine core is a data-parallel rank (which
steps in lock-step with the others), or where the scheduler's attributes it reads changed
(``runtime/private_symbols.py``), every wait lasts vLLM's interval. The connector installs it in
the engine-core process of decode engines that use it (vLLM's CPU backend here).
"""

from __future__ import annotations

import hmac
import inspect
import logging
import re
import secrets
import select
import socket
import time
from types import ModuleType
from typing import Any

from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.kv")

SYMBOLS = ("vllm.v1.engine.core.time", "vllm.v1.engine.core.EngineCoreProc._process_engine_step")
# What the long wait reads of the engine core and its scheduler (runtime/private_symbols.py).
LONG_WAIT_SYMBOLS = (
    "vllm.v1.engine.core.EngineCoreProc.input_queue",
    "vllm.v1.engine.core.EngineCoreProc.scheduler",
    "vllm.v1.core.sched.scheduler.Scheduler.requests",
    "vllm.v1.core.sched.scheduler.Scheduler.running",
    "vllm.v1.core.sched.scheduler.Scheduler.has_finished_requests",
    "vllm.v1.request.RequestStatus.WAITING_FOR_REMOTE_KVS",
    "vllm.v1.engine.core.DPEngineCoreProc",
)

LOOPBACK = "127.0.0.1"
MAX_DATAGRAMS_PER_DRAIN = 1024  # a flood is read in bounded batches, between checks of the clock
# The longest wait while every request waits for its KV: a step then checks transfer deadlines
# (seconds) and sends what a ring did not announce (answers to late frames); short enough that a
# lost ring is not felt, long enough that an idle wait costs a step every 50 ms, not every 1 ms.
KV_WAIT_MAX_S = 0.05
ENGINE_STEP = "_process_engine_step"  # the engine core's method whose sleep is the poll
MIN_SLICE_S = 0.001  # vLLM's interval: the slice of a long wait, should a caller ask for none


class Doorbell:
    """The engine core's end: a wait that a datagram or ``ring_here`` cuts short."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((LOOPBACK, 0))
        self._sock.setblocking(False)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        self.port: int = self._sock.getsockname()[1]
        self.token: str = secrets.token_hex(16)
        self._token = self.token.encode()
        self._rung = False  # set and read by the engine core's main thread only
        self.stray_datagrams = 0  # datagrams without the token: not rings

    def ring_here(self) -> None:
        """From the engine core's own process: the next wait returns at once."""
        self._rung = True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a ring; True when rung. Rings that came meanwhile are
        consumed: one wait answers all of them, since one step settles every transfer that is
        ready."""
        if self._rung:
            self._rung = False
            self._drain()
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                # poll, not select(): an engine core's descriptors can pass FD_SETSIZE
                readable = self._poller.poll(remaining * 1000)
                if any(events & select.POLLNVAL for _, events in readable):
                    raise OSError("the doorbell's socket is closed")
            except (OSError, ValueError):  # closed under us: behave like vLLM's plain sleep
                time.sleep(remaining)
                return False
            if readable and self._drain():
                return True

    def _drain(self) -> bool:
        """Read what is queued; True when a datagram carried the token."""
        rung = False
        try:
            for _ in range(MAX_DATAGRAMS_PER_DRAIN):
                data = self._sock.recv(64)
                if hmac.compare_digest(data, self._token):
                    rung = True
                else:
                    self.stray_datagrams += 1
        except (BlockingIOError, OSError):
            pass
        return rung

    def close(self) -> None:
        self._sock.close()


class DoorbellRinger:
    """The worker's end: one datagram to the engine core's doorbell, best effort."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.port: int | None = None
        self.token: str | None = None

    def aim(self, port: int | None, token: str | None) -> None:
        """The doorbell a step's metadata named (its port and token), or none."""
        self.port, self.token = port, token

    def ring(self) -> None:
        port, token = self.port, self.token
        if port is None or token is None:
            return
        try:
            self._sock.sendto(token.encode(), (LOOPBACK, port))
        except OSError:  # a full buffer means rings are already waiting to be read
            pass

    def close(self) -> None:
        self._sock.close()


class _CoreTime:
    """What vLLM's engine-core module sees as ``time``: the real module, except that ``sleep``
    waits on the doorbell, for as long as the scheduler's state allows (module docstring)."""

    def __init__(self, real: ModuleType, doorbell: Doorbell, waiting_for_kv: Any = None, lockstep: tuple[type, ...] = ()) -> None:
        self._real = real
        self._doorbell = doorbell
        # The scheduler status of a request whose KV is on its way; None: every wait is one interval.
        self._waiting_for_kv = waiting_for_kv
        # Engine cores that step in lock-step with others (vLLM's data parallel ranks): a long wait
        # in one would hold the others back, so theirs last one interval.
        self._lockstep = lockstep
        self._core: Any = None  # the engine core, found at the first sleep
        self._looked = False
        self.__wrapped__ = real  # what the manifest's check reads (serve_app/runtime/private_symbols.py)

    def sleep(self, seconds: float) -> None:
        core = self._engine_core() if self._waiting_for_kv is not None else None
        if core is None or not waits_only_for_kv(core.scheduler, self._waiting_for_kv):
            self._doorbell.wait(seconds)
            return
        deadline = self._real.monotonic() + KV_WAIT_MAX_S
        slice_s = seconds if seconds > 0 else MIN_SLICE_S
        while core.input_queue.empty():
            if self._doorbell.wait(slice_s) or self._real.monotonic() >= deadline:
                return

    def _engine_core(self) -> Any:
        """The engine core whose step called this sleep (looked for once: one per process)."""
        if not self._looked:
            self._looked = True
            here = inspect.currentframe()  # this method, called by sleep, called by the engine step
            caller = here.f_back.f_back if here is not None and here.f_back is not None else None
            core = caller.f_locals.get("self") if caller is not None and caller.f_code.co_name == ENGINE_STEP else None
            del here, caller  # frames hold references: do not keep them
            if core is not None and isinstance(core, self._lockstep):
                logger.info("engine core: a data-parallel rank; KV waits last one poll interval")
            elif core is None or not hasattr(core, "input_queue"):
                logger.warning("engine core: its poll is not called from %s; KV waits last one poll interval", ENGINE_STEP)
            elif not reads_like_vllms(getattr(core, "scheduler", None)):
                logger.warning(
                    "engine core: its scheduler (%s) lacks vLLM's requests, running or has_finished_requests; "
                    "KV waits last one poll interval",
                    type(getattr(core, "scheduler", None)).__name__,
                )
            else:
                self._core = core
        return self._core

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def reads_like_vllms(scheduler: Any) -> bool:
    """Whether the engine's scheduler has what ``waits_only_for_kv`` reads: a scheduler class of
    the user's own (vLLM's ``scheduler_cls``) may not, and reading it must not stop the engine."""
    return all(hasattr(scheduler, name) for name in ("requests", "running", "has_finished_requests"))


def waits_only_for_kv(scheduler: Any, waiting_for_kv: Any) -> bool:
    """Whether nothing but a KV transfer (or new input) can give the scheduler's next step work:
    it holds requests, all of them waiting for their KV, and no finished request to report."""
    requests = scheduler.requests
    if not requests or scheduler.running or scheduler.has_finished_requests():
        return False
    return all(request.status == waiting_for_kv for request in requests.values())


def install_core_wait(doorbell: Doorbell, module: ModuleType | None = None, waiting_for_kv: Any = None) -> bool:
    """Route the engine core's forward-less-step sleep to ``doorbell``; False (and nothing
    changed) where vLLM's engine-core module is not the one this was written against.

    ``waiting_for_kv`` is the request status of a request whose KV is on its way (vLLM's own,
    by default); without it every wait lasts one poll interval."""
    real_vllm = module is None
    if module is None:
        try:
            from vllm.v1.engine import core as module
        except ImportError:
            return False
    current = getattr(module, "time", None)
    if isinstance(current, _CoreTime):
        current._doorbell = doorbell  # one scheduler per engine core: the latest one's doorbell
        return True
    if real_vllm and not unchanged(SYMBOLS, logger, "the KV doorbell (the engine core polls for KV transfers as before)"):
        return False
    if current is not time or not sleeps_only_after_forwardless_steps(module):
        logger.warning("vLLM's engine core does not poll where pd-serve expects: KV transfers are polled as before")
        return False
    if real_vllm and waiting_for_kv is None:
        waiting_for_kv = _vllms_waiting_for_kv()
    lockstep = getattr(module, "DPEngineCoreProc", None)
    module.time = _CoreTime(time, doorbell, waiting_for_kv, (lockstep,) if isinstance(lockstep, type) else ())  # type: ignore[attr-defined]
    logger.info("engine core: waits for KV transfers on doorbell 127.0.0.1:%d instead of polling", doorbell.port)
    return True


def _vllms_waiting_for_kv() -> Any:
    """vLLM's status of a request waiting for remote KV, or None (and one warning) where what
    the long wait reads of vLLM changed."""
    if not unchanged(LONG_WAIT_SYMBOLS, logger, "the long KV wait (the engine core's KV waits last one poll interval)"):
        return None
    from vllm.v1.request import RequestStatus

    return RequestStatus.WAITING_FOR_REMOTE_KVS


def sleeps_only_after_forwardless_steps(module: ModuleType) -> bool:
    """Whether the module's one ``time.sleep`` is the poll after a step that ran no forward:
    only then does routing the module's ``sleep`` to the doorbell change that poll and nothing
    else."""
    proc = getattr(module, "EngineCoreProc", None)
    step = getattr(proc, "_process_engine_step", None)
    if step is None:
        return False
    try:
        source, step_source = inspect.getsource(module), inspect.getsource(step)
    except (OSError, TypeError):
        return False
    return len(_SLEEP.findall(source)) == 1 and _POLL.search(step_source) is not None


_SLEEP = re.compile(r"\btime\.sleep\(")
_POLL = re.compile(r"if not model_executed\b.*:\s*\n\s*time\.sleep\(")
