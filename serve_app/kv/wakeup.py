"""Wakes a decode engine's core when a KV transfer settles, instead of at its next poll.

While every request a decode engine holds waits for its KV, vLLM's engine core runs steps without
a forward, each asking the worker whether a transfer finished, and sleeps 1 ms after each (the
``time.sleep`` in ``EngineCoreProc._process_engine_step``, vllm/v1/engine/core.py). Between a
prompt's last KV frame and its first decode step that poll puts two sleeps: one before the step
whose worker reports the transfer, and one after it, before the step that schedules the request.
That is every lone request's hand-off, and under load the start of every batch whose requests
all wait for their KV (docs/performance.md, "What made the difference").

So the consumer's two processes get a doorbell: the engine core's scheduler side binds a UDP
socket on the loopback (its port goes to the worker in each step's connector metadata), and the
engine core's sleep after a forward-less step becomes a wait on that socket for at most the same
time. The worker rings it when a transfer can be settled (its done or failed frame came, or its
connection broke), and the scheduler side marks the doorbell when a step reported a finished
receive, so the step that schedules the request follows at once. Anything else still waits out
vLLM's interval, and a lost datagram costs at most one poll, never correctness.

Any local process can send a datagram to a loopback port, so a bare datagram must not count as a
ring, or a flood of them would keep the engine core running forward-less steps instead of
sleeping. Each doorbell makes a random token (its only copy outside the engine-core process goes
to the worker in the step metadata, next to the port); a ring is a datagram carrying exactly that
token, and anything else is read and dropped while the wait goes on to the end of its interval.

The wait is installed by replacing ``time`` in vLLM's engine-core module with a proxy whose
``sleep`` waits on the doorbell, only after checking the module's source: its one ``time.sleep``
must be that poll (as in vLLM 0.32); where vLLM's module differs it is left alone
and the engine polls as before. The connector installs it in the engine-core process of decode
engines that use it (vLLM's CPU backend here).
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

LOOPBACK = "127.0.0.1"
MAX_DATAGRAMS_PER_DRAIN = 1024  # a flood is read in bounded batches, between checks of the clock


class Doorbell:
    """The engine core's end: a wait that a datagram or ``ring_here`` cuts short."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((LOOPBACK, 0))
        self._sock.setblocking(False)
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
                readable, _, _ = select.select([self._sock], [], [], remaining)
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
    waits on the doorbell."""

    def __init__(self, real: ModuleType, doorbell: Doorbell) -> None:
        self._real = real
        self._doorbell = doorbell
        self.__wrapped__ = real  # what the manifest's check reads (serve_app/runtime/private_symbols.py)

    def sleep(self, seconds: float) -> None:
        self._doorbell.wait(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install_core_wait(doorbell: Doorbell, module: ModuleType | None = None) -> bool:
    """Route the engine core's forward-less-step sleep to ``doorbell``; False (and nothing
    changed) where vLLM's engine-core module is not the one this was written against."""
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
    module.time = _CoreTime(time, doorbell)  # type: ignore[attr-defined]
    logger.info("engine core: waits for KV transfers on doorbell 127.0.0.1:%d instead of polling", doorbell.port)
    return True


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
