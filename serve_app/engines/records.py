"""What an engine keeps about recent requests and KV transfers, for inspection and for
``Prefill.run`` to learn how its push went."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

RECENT = 2048  # per-request records kept for inspection (tests, operators)


class Recent(OrderedDict):
    """A bounded map: the oldest entries go first."""

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > RECENT:
            self.popitem(last=False)


class TransferRecords:
    """The connector's per-transfer records, as they arrive, and waiters for a given one."""

    def __init__(self) -> None:
        self._records = Recent()
        self._waiters: dict[str, asyncio.Event] = {}

    def add(self, records: dict[str, Any]) -> None:
        for transfer_id, record in records.items():
            self._records.put(transfer_id, record)
            waiter = self._waiters.get(transfer_id)
            if waiter is not None:
                waiter.set()

    def get(self, transfer_id: str) -> dict[str, Any] | None:
        return self._records.get(transfer_id)

    def all(self) -> dict[str, Any]:
        return dict(self._records)

    async def wait_for(self, transfer_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The record of ``transfer_id``, waiting up to ``timeout_s`` for it to arrive (a vLLM
        connector's records ride with the engine's stats, usually in the same batch as the
        request's last output)."""
        if transfer_id not in self._records:
            waiter = self._waiters.setdefault(transfer_id, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), timeout_s)
            except TimeoutError:
                pass
            finally:
                self._waiters.pop(transfer_id, None)
        return self._records.get(transfer_id)


def _after(at: Any, origin: float) -> str:
    """A timeline's time of ``at`` (wall clock) in ms after ``origin``, or "-" when it has none."""
    return "-" if at is None else f"+{(float(at) - origin) * 1000:.1f}"


def push_timeline(transfer_id: str, record: dict[str, Any], since: float) -> str:
    """One line that says when each layer of a push left, against the prefill call's arrival
    (``since``, wall clock, as the connector's times): whether the push overlapped the forward
    or trailed it is read off this (README, "Performance"; logged at DEBUG)."""

    def ms(at: Any) -> str:
        return _after(at, since)

    layers = " ".join(ms(at) for at in record.get("push_times") or [])
    return (
        f"transfer {transfer_id}: {record.get('layers_pushed', 0)} layers, {record.get('bytes_pushed', 0)} bytes; "
        f"layers sent at [{layers}] ms, done sent {ms(record.get('done_sent_at'))} ms, forward done "
        f"{ms(record.get('forward_done_at'))} ms, acknowledged {ms(record.get('acked_at'))} ms after the call arrived "
        f"(at {since:.4f}, wall clock)"
    )


def receive_timeline(transfer_id: str, record: dict[str, Any], first_token_at: float) -> str:
    """The decode side of a push in one line, against the moment its receive was armed (the
    decode engine's blocks held, its KV parameters on their way to the router): when the first
    and last layers came in, when the transfer settled, and when the engine's first token reached
    the replica (``first_token_at``, wall clock, as the connector's times). With the prefill engine's
    ``push_timeline`` (both name their wall-clock origin) it splits a TTFT into the hand-off,
    the push and what follows it (docs/performance.md; logged at DEBUG)."""
    armed = record.get("armed_at")
    if armed is None:
        return f"transfer {transfer_id}: {record.get('outcome', 'no')} receive, never armed"
    armed = float(armed)

    def ms(at: Any) -> str:
        return _after(at, armed)

    return (
        f"transfer {transfer_id}: {record.get('frames_received', 0)} frames of {record.get('layers_received', 0)} layers, "
        f"{record.get('bytes_received', 0)} bytes "
        f"{record.get('outcome', '?')}; first layer in {ms(record.get('first_layer_at'))} ms, last layer in "
        f"{ms(record.get('last_layer_at'))} ms, settled {ms(record.get('settled_at'))} ms, first token in the replica "
        f"{ms(first_token_at)} ms after the receive was armed (at {armed:.4f}, wall clock)"
    )
