"""Load scoring and engine selection (pure: no Ray, no I/O).

The router keeps integer counters of what it has sent to each engine and not yet got back
(reserved tokens: prompt + max_tokens for decode, prompt tokens for prefill) and merges in what
each engine last reported about itself (KV cache usage). Scores are integers, so counters never
drift the way float scores added and subtracted for every request do.

Decode score: reserved tokens of this router + KV tokens the engine reports in use.
Prefill score: the prompt tokens in the engine's line, this router's or, where more, every
router's as the engine last reported them (the larger of the two: the report lags this router's
newest calls and holds the other router replicas' calls, which this router's counters never see).
Ties rotate (the ``turn`` argument), so equal engines share work instead of index 0 taking all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from serve_app.wire.protocol import Role


@dataclass
class EngineLoad:
    """The router's view of one engine."""

    name: str
    role: Role
    reserved_tokens: int = 0  # this router's outstanding work on the engine
    inflight: int = 0  # this router's outstanding requests on the engine
    kv_used_tokens: int = 0  # reported by the engine
    kv_capacity_tokens: int = 0  # reported by the engine
    num_waiting: int = 0  # reported by the engine
    queued_prompt_tokens: int = 0  # reported by a prefill engine: its calls' prompt tokens, every router's
    healthy: bool = False  # until its first stats answer, or Serve lists it running (EnginePool.join)
    draining: bool = False  # Serve is stopping it: never chosen again
    # Calls to it failed (unreachable): not healthy again, whatever its stats say, until then
    # (monotonic time), which doubles with each failure in a row (``EnginePool.mark_unhealthy``).
    call_backoff_until: float = 0.0
    call_failures: int = 0
    last_call_failure: float = 0.0


ScoreFn = Callable[[EngineLoad], int]


def decode_score(load: EngineLoad) -> int:
    return load.reserved_tokens + load.kv_used_tokens


def prefill_score(load: EngineLoad) -> int:
    return max(load.reserved_tokens, load.queued_prompt_tokens)


def every_line_at_least(loads: Iterable[EngineLoad], tokens: int) -> bool:
    """Whether every healthy engine has at least ``tokens`` of this router's prompt tokens queued
    (being computed or waiting): a prompt sent now would start behind that many at best. An
    unhealthy or leaving engine's line does not count (true when none is healthy)."""
    return all(load.reserved_tokens >= tokens for load in loads if load.healthy)


def candidates(loads: Iterable[EngineLoad], avoid: Iterable[str] = ()) -> list[EngineLoad]:
    """The healthy engines, those not in ``avoid`` if any: ``avoid`` is a preference, not a ban
    (when every healthy engine is avoided, one decode engine say, they are all still candidates).
    Empty when no engine is healthy."""
    healthy = [load for load in loads if load.healthy]
    avoided = set(avoid)
    return [load for load in healthy if load.name not in avoided] or healthy


def select(
    loads: Iterable[EngineLoad],
    score: ScoreFn,
    *,
    turn: int = 0,
    avoid: Iterable[str] = (),
) -> EngineLoad | None:
    """Of the ``candidates``, the one with the lowest score (None when no engine is healthy)."""
    preferred = candidates(loads, avoid)
    if not preferred:
        return None
    best = min(score(load) for load in preferred)
    tied = [load for load in preferred if score(load) == best]
    return tied[turn % len(tied)]
