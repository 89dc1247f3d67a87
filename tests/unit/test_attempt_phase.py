"""The attempt's phase table (router/attempt_phase.py), read as a table: every phase reachable,
every deadline the one its wait needs, and anything else refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve_app.router.attempt_phase import (
    TRANSITIONS,
    WAITING_FOR,
    AttemptPhase,
    Deadline,
    PhaseError,
    PhaseEvent,
    advance,
    allowed,
    prefill_running,
)

TIMEOUTS = SimpleNamespace(kv_ready_s=1.0, prefill_s=2.0, first_token_s=3.0)
P, E = AttemptPhase, PhaseEvent


def walk(*events: PhaseEvent, now: float = 100.0) -> list[tuple[AttemptPhase, float | None]]:
    phase, deadline, seen = P.STARTING, None, []
    for i, event in enumerate(events):
        phase, deadline = advance(phase, event, deadline, now + i, TIMEOUTS)
        seen.append((phase, deadline))
    return seen


def test_disaggregated_with_tokens_before_the_prefill_call_returns():
    assert walk(E.OPEN_DISAGGREGATED, E.KV_READY, E.TOKENS, E.TOKENS, E.PREFILL_DONE, E.TOKENS) == [
        (P.AWAITING_KV, 101.0),  # opened at 100: kv_ready_s
        (P.PREFILLING, 103.0),  # the prefill call started at 101: prefill_s
        (P.PREFILL_ENDING, 103.0),  # tokens do not lift the prefill call's deadline
        (P.PREFILL_ENDING, 103.0),
        (P.DECODING, None),  # both parts done: the request's own deadline alone
        (P.DECODING, None),
    ]


def test_disaggregated_prefill_returning_first_waits_for_the_first_token():
    assert walk(E.OPEN_DISAGGREGATED, E.KV_READY, E.PREFILL_DONE, E.TOKENS)[2:] == [(P.AWAITING_FIRST_TOKEN, 105.0), (P.DECODING, None)]


def test_colocated_and_a_decode_engine_that_had_the_prompt_cached():
    assert walk(E.OPEN_COLOCATED, E.TOKENS) == [(P.AWAITING_FIRST_TOKEN, 103.0), (P.DECODING, None)]
    assert walk(E.OPEN_DISAGGREGATED, E.TOKENS) == [(P.AWAITING_KV, 101.0), (P.DECODING, None)]


@pytest.mark.parametrize(
    "events",
    [
        (E.OPEN_DISAGGREGATED, E.KV_READY, E.KV_READY),  # a second KVReady: never a second prefill
        (E.OPEN_DISAGGREGATED, E.KV_READY, E.TOKENS, E.KV_READY),
        (E.OPEN_COLOCATED, E.KV_READY),  # a colocated attempt asked for no remote prefill
        (E.OPEN_COLOCATED, E.PREFILL_DONE),  # a prefill nobody started
        (E.OPEN_DISAGGREGATED, E.KV_READY, E.PREFILL_DONE, E.PREFILL_DONE),
        (E.TOKENS,),  # nothing before the stream is open
        (E.OPEN_COLOCATED, E.OPEN_COLOCATED),
    ],
)
def test_what_the_table_does_not_name_is_refused(events):
    *before, last = events
    phase = walk(*before)[-1][0] if before else P.STARTING
    assert not allowed(phase, last)
    with pytest.raises(PhaseError, match=f"{last.value} while {phase.value}"):
        walk(*events)


def test_every_phase_is_reached_and_every_waiting_phase_has_its_message():
    reached = {nxt for nxt, _ in TRANSITIONS.values()}
    assert reached == set(P) - {P.STARTING}
    assert set(WAITING_FOR) == reached
    # Only the decoding phase waits without a deadline of its own.
    assert {nxt for nxt, d in TRANSITIONS.values() if d is Deadline.NONE} == {P.DECODING}
    assert [p for p in P if prefill_running(p)] == [P.PREFILLING, P.PREFILL_ENDING]
