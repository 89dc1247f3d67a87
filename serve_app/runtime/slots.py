"""An engine replica's slot on its node: the KV port block it listens on.

Serve gives each replica a rank, unique among the deployment's replicas when given, but it
renumbers the live replicas' ranks to keep them contiguous when the pool shrinks (Ray Serve
2.60's minimal rank reassignment), and a replica started later is given a rank that a live one
was started with. A replica reads its rank once, at start, so by rank alone two live engines on
one node would take one KV port block (vllm-ascend's connector then fails to start, again and
again). So a replica claims its block's slot on the node: the first free one from its rank, held
by an exclusive ``flock`` on a file of that slot for as long as its process lives; the kernel
releases it when the process ends, however it ends. (Its name and cores still follow its rank:
the router tells two engines of one name apart, and an autoscaled pool already shares cores
round-robin by rank, which the router and replicas' placement plan on.)
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

SLOT_DIR_ENV = "PD_SERVE_SLOT_DIR"  # where the slots' lock files are (default: <tmp>/pd-serve-slots)


def slot_dir() -> Path:
    return Path(os.environ.get(SLOT_DIR_ENV) or Path(tempfile.gettempdir()) / "pd-serve-slots")


class Slot:
    """A claimed slot; it stays claimed while this object (its open lock file) lives."""

    def __init__(self, number: int, lock: IO[bytes]) -> None:
        self.number = number
        self._lock = lock

    def release(self) -> None:
        self._lock.close()


def claim_slot(group: str, first: int, tries: int = 4096) -> Slot:
    """The first slot of ``group`` (one pool's engines of one app on this node, e.g.
    ``"36000-decode"``) from ``first`` upwards that no live process holds."""
    directory = slot_dir()
    directory.mkdir(parents=True, exist_ok=True)
    for number in range(first, first + tries):
        lock = open(directory / f"{group}-{number}.lock", "ab")  # noqa: SIM115 - held for the process's life
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return Slot(number, lock)
    raise RuntimeError(f"no free slot of {group} in {first}..{first + tries - 1} under {directory}")
