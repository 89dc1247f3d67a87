"""One Gloo device per engine process, shared by all its process groups.

torch's Gloo backend gives every process group a TCP device of its own, and every device an
event-loop thread that wakes every 10 ms (gloo's loop polls with that timeout) whether or not
its group ever communicates. vLLM makes two groups per parallel dimension (world, TP, PP, DP,
EP, DCP, PCP, ...: a device group and a CPU group, both Gloo on the CPU), so each CPU worker
runs 13 such threads, waking on the cores the worker is bound to, and each wake-up is a chance
to preempt a forward pass (docs/performance.md, "What made the difference").

A Gloo device is a transport endpoint that any number of groups (contexts) can share: their
pairs multiplex over its one loop. ``install`` is a vLLM general plugin (pyproject's
``vllm.general_plugins`` entry point), loaded in every process vLLM starts before the workers
set up torch.distributed. Where the engine's environment sets ``PD_SERVE_SHARED_GLOO_DEVICE=1``
(the CPU backend does) it makes the Gloo groups torch creates from then on share one device (one
per interface named in ``GLOO_SOCKET_IFNAME``, as torch would make per group), so a worker keeps
one loop thread. Groups stay separate process groups: collectives, sequence numbers and
``destroy_process_group`` are unchanged.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.engine")

ENV = "PD_SERVE_SHARED_GLOO_DEVICE"
# torch reads this to pick the interfaces of a Gloo group's devices.
IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_GLOO = "torch.distributed.distributed_c10d.ProcessGroupGloo"
SYMBOLS = tuple(
    f"{_GLOO}.{name}"
    for name in ("__init__", "_Options", "_Options._timeout", "_Options._devices", "create_device", "create_default_device")
)


def install() -> None:
    if os.environ.get(ENV) != "1":
        return
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # a torch without distributed support: nothing creates Gloo groups
        return
    gloo = getattr(c10d, "ProcessGroupGloo", None)
    if gloo is None or getattr(gloo.__init__, "_pd_serve_shared_device", False):
        return
    if not unchanged(SYMBOLS, logger, "one Gloo device shared by a process's groups"):
        return
    # The class itself is kept (torch checks its groups' backends with isinstance against it, and
    # those come back from C++ as this class); only how torch constructs one changes.
    gloo.__init__ = shared_device_init(gloo)


def shared_device_init(gloo: type) -> Any:
    """An ``__init__`` for torch's ProcessGroupGloo, which torch calls as ``(store, rank, size,
    timeout=...)``: the group's devices are taken from one set, made for the first group."""
    original = gloo.__init__
    lock = threading.Lock()
    devices: list[Any] = []

    def shared_devices() -> list[Any]:
        with lock:
            if not devices:
                interfaces = [i for i in os.environ.get(IFNAME_ENV, "").split(",") if i]
                if interfaces:
                    devices.extend(gloo.create_device(interface=i) for i in interfaces)
                else:
                    devices.append(gloo.create_default_device())
            return list(devices)

    def __init__(self: Any, store: Any, rank: int, size: int, timeout: Any = None) -> None:  # noqa: N807
        if isinstance(timeout, gloo._Options):  # the caller built its own options: keep them
            original(self, store, rank, size, timeout)
            return
        options = gloo._Options()
        if timeout is not None:
            options._timeout = timeout
        options._devices = shared_devices()
        original(self, store, rank, size, options)

    __init__._pd_serve_shared_device = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]  # what the manifest's check reads
    return __init__
