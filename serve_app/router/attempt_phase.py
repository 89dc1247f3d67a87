"""The phase of one attempt and its deadline: one table, the only place either moves (pure).

An attempt has two moving parts, the decode stream and (disaggregated) the prefill call, and each
phase is a combination of where they are, with the timeout that bounds the wait it is in:

=====================  ==========================================  ====================
phase                  decode stream / prefill call                 deadline
=====================  ==========================================  ====================
awaiting_kv            no KVReady yet / not started                 ``kv_ready_s``
prefilling             KVReady, no token / running                  ``prefill_s``
prefill_ending         tokens flow / still running (its last acks)  ``prefill_s`` (kept)
awaiting_first_token   no token / done (or colocated: none)         ``first_token_s``
decoding               tokens flow / done or none                   the request's only
=====================  ==========================================  ====================

In ``prefill_ending`` the tokens show the prompt's KV whole on the decode engine: a prefill call
that then outlives ``prefill_s``, whose engine leaves or that fails is let go and the stream
decodes on (``cdcp.AttemptRun``). Anything the table does not name (a second KVReady, a prefill
result nobody started) is a protocol error: ``cdcp.py`` asks ``allowed`` first and fails the
attempt (retried elsewhere) instead of guessing; ``advance`` raises ``PhaseError`` for it.
"""

from __future__ import annotations

import enum
from typing import Protocol


class AttemptPhase(str, enum.Enum):
    STARTING = "starting"
    AWAITING_KV = "awaiting_kv"
    PREFILLING = "prefilling"
    PREFILL_ENDING = "prefill_ending"
    AWAITING_FIRST_TOKEN = "awaiting_first_token"
    DECODING = "decoding"


class PhaseEvent(str, enum.Enum):
    OPEN_DISAGGREGATED = "open_disaggregated"  # the decode stream is open, asking for a remote prefill
    OPEN_COLOCATED = "open_colocated"  # the decode stream is open; the engine prefills itself
    KV_READY = "kv_ready"  # the decode engine holds blocks: the prefill call starts
    TOKENS = "tokens"  # the decode stream sent tokens (or its end)
    PREFILL_DONE = "prefill_done"  # the prefill call returned


class Deadline(str, enum.Enum):
    """Which timeout (``router.timeouts``) a phase waits under; ``KEEP``: the one it had."""

    KV_READY = "kv_ready_s"
    PREFILL = "prefill_s"
    FIRST_TOKEN = "first_token_s"
    NONE = "none"
    KEEP = "keep"


P, E, D = AttemptPhase, PhaseEvent, Deadline
TRANSITIONS: dict[tuple[AttemptPhase, PhaseEvent], tuple[AttemptPhase, Deadline]] = {
    (P.STARTING, E.OPEN_DISAGGREGATED): (P.AWAITING_KV, D.KV_READY),
    (P.STARTING, E.OPEN_COLOCATED): (P.AWAITING_FIRST_TOKEN, D.FIRST_TOKEN),
    (P.AWAITING_KV, E.KV_READY): (P.PREFILLING, D.PREFILL),
    # A decode engine that held the whole prompt in its prefix cache needs no KV: it just decodes.
    (P.AWAITING_KV, E.TOKENS): (P.DECODING, D.NONE),
    # The push reached the decode engine ahead of the prefill call's own return.
    (P.PREFILLING, E.TOKENS): (P.PREFILL_ENDING, D.KEEP),
    (P.PREFILLING, E.PREFILL_DONE): (P.AWAITING_FIRST_TOKEN, D.FIRST_TOKEN),
    (P.PREFILL_ENDING, E.TOKENS): (P.PREFILL_ENDING, D.KEEP),
    (P.PREFILL_ENDING, E.PREFILL_DONE): (P.DECODING, D.NONE),
    (P.AWAITING_FIRST_TOKEN, E.TOKENS): (P.DECODING, D.NONE),
    (P.DECODING, E.TOKENS): (P.DECODING, D.NONE),
}
del P, E, D

# What an attempt in each phase waits for, for the timeout message.
WAITING_FOR: dict[AttemptPhase, str] = {
    AttemptPhase.AWAITING_KV: "KVReady",
    AttemptPhase.PREFILLING: "prefill",
    AttemptPhase.PREFILL_ENDING: "prefill",
    AttemptPhase.AWAITING_FIRST_TOKEN: "the first token",
    AttemptPhase.DECODING: "tokens",
}


class PhaseError(Exception):
    """An event the attempt's phase does not allow: the engines broke the protocol."""


class PhaseTimeouts(Protocol):
    """The three phase timeouts of ``router.timeouts`` (config.settings.TimeoutsConfig)."""

    kv_ready_s: float
    prefill_s: float
    first_token_s: float


def advance(
    phase: AttemptPhase, event: PhaseEvent, deadline: float | None, now: float, timeouts: PhaseTimeouts
) -> tuple[AttemptPhase, float | None]:
    """The next (phase, deadline) of an attempt in ``phase`` on ``event`` at ``now`` (monotonic)."""
    try:
        nxt, which = TRANSITIONS[(phase, event)]
    except KeyError:
        raise PhaseError(f"{event.value} while {phase.value}") from None
    match which:
        case Deadline.KEEP:
            return nxt, deadline
        case Deadline.NONE:
            return nxt, None
        case _:
            return nxt, now + getattr(timeouts, which.value)


def allowed(phase: AttemptPhase, event: PhaseEvent) -> bool:
    return (phase, event) in TRANSITIONS


def prefill_running(phase: AttemptPhase) -> bool:
    """The phases in which a timeout is the prefill engine's (the wait is for its call)."""
    return phase in (AttemptPhase.PREFILLING, AttemptPhase.PREFILL_ENDING)
