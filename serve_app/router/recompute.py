"""The recompute-retry state machine of one client request (pure: no Ray, no I/O).

A client request is served by one or more *attempts*. An attempt ends early when its decode
engine gives the request back (``stop_reason == "recomputed"``, when it ran out of KV blocks),
when its engine dies or fails, or when a deadline passes; the request then resumes with a new
attempt whose prompt is the original prompt plus every token generated so far and whose budget
is what is left of ``max_tokens``. Budgets are counted in tokens, never in chunks, and tokens are
never re-tokenized from text, so greedy output with recomputes equals greedy output without them,
token for token.

The request's state: ``dispatch -> attempting -> finished``, and ``attempting -> dispatch`` on a
retry. Where an attempt is within itself (waiting for KV, prefilling, decoding) is the attempt's
own phase (router/attempt_phase.py), not the request's. The caller executes each attempt and
feeds its tokens and its failure back in; the machine answers with what to release to the client
and whether to continue, retry or finish.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.utils import check_sequence_repetition

from serve_app.router.text import StopMatcher, TextStream
from serve_app.wire.protocol import MOVED, RECOMPUTED, TokenDelta, TokenLogprob

# Attempts that ended because their engine was being stopped (a pool shrinking, a redeploy) do
# not count against max_attempts, up to this many: a move is not a failure, but a request must
# not move forever.
MAX_FREE_MOVES = 8
# Finish reasons of an engine request that mean "this attempt failed", not "the response ended".
RETRYABLE_FINISH_REASONS = frozenset({"abort", "error"})
# vLLM's stop_reason for a request its repetition_detection ended (finish_reason "repetition").
REPETITION_STOP_REASON = "repetition_detected"


@dataclass(frozen=True)
class RepetitionCheck:
    """A request's ``repetition_detection``, checked with the function vLLM's engine core calls
    in ``check_stop``."""

    params: Any  # vLLM's RepetitionDetectionParams

    @property
    def window(self) -> int:
        """The most output tokens one check looks at: an attempt with this many of its own sees
        every repetition its engine's check does."""
        return max(0, self.params.max_pattern_size) * self.params.min_count

    def __call__(self, token_ids: Sequence[int]) -> bool:
        return check_sequence_repetition(token_ids, self.params)


def repetition_check(sampling_params: Any) -> RepetitionCheck | None:
    """The check of a request's ``repetition_detection``; None for a request without it."""
    detection = getattr(sampling_params, "repetition_detection", None)
    return None if detection is None else RepetitionCheck(detection)


class Phase(str, enum.Enum):
    DISPATCH = "dispatch"  # between attempts: the next one is to start
    ATTEMPTING = "attempting"
    FINISHED = "finished"


class Action(str, enum.Enum):
    CONTINUE = "continue"  # keep reading this attempt
    RETRY = "retry"  # end this attempt (abort what it holds) and start the next one
    FINISH = "finish"  # the response is complete (or failed); abort what the attempt holds


@dataclass(frozen=True)
class AttemptPlan:
    attempt_id: str  # "<request id>-<number>"
    number: int  # 1-based
    prompt_token_ids: list[int]
    max_tokens: int
    disaggregated: bool
    avoid: frozenset[str] = frozenset()  # engines (either role) not preferred: the last one that failed
    min_tokens: int = 0  # what is left of the request's min_tokens
    resumed_output_tokens: int = 0  # the prompt's last tokens that earlier attempts produced

    @property
    def request_id(self) -> str:
        return self.attempt_id.rsplit("-", 1)[0]


@dataclass
class Emission:
    """What the client receives from one step: new text, the tokens behind it, and the end."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The prompt's logprobs (a completion's echo with logprobs), with the response's first tokens.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # the response failed; the message for the client
    error_status: int = 500  # and the HTTP status that failure maps to

    @property
    def empty(self) -> bool:
        return not (self.text or self.token_ids or self.finish_reason or self.error)


@dataclass
class Step:
    action: Action
    emission: Emission
    wasted_tokens: int = 0  # tokens whose KV an ended attempt threw away (prompt + its output)
    recomputed: bool = False  # the attempt ended because its decode engine recomputed
    moved: bool = False  # ... because its decode engine is being stopped


class RecomputeStateMachine:
    def __init__(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        max_attempts: int,
        text: TextStream,
        stops: StopMatcher | None = None,
        min_tokens: int = 0,
        logprobs: bool = False,
        repeats: RepetitionCheck | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.max_attempts = max_attempts
        self.min_tokens = min_tokens
        self._text = text
        self._stops = stops or StopMatcher([])
        self._want_logprobs = logprobs
        # vLLM's repetition_detection over the whole output, for resumed attempts: their engine
        # sees only its own output.
        self._repeats = repeats

        self.phase = Phase.DISPATCH
        self.attempts = 0
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        # The prompt's logprobs, from the first attempt that gives them (only an attempt on the
        # original prompt is asked for them), and whether an emission has carried them yet.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._prompt_logprobs_sent = False
        self.text = ""  # released so far
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.current: AttemptPlan | None = None
        self.recomputes = 0
        self.moves = 0  # attempts ended by their engine's drain (decode, or the prefill engine called)
        self.wasted_tokens = 0
        self._attempt_tokens = 0
        self._last_engine: str | None = None

    # ------------------------------------------------------------------ queries
    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_token_ids)

    @property
    def counted_attempts(self) -> int:
        """Attempts that count against max_attempts: all but the first few moves."""
        return self.attempts - min(self.moves, MAX_FREE_MOVES)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_token_ids)

    # ------------------------------------------------------------------ transitions
    def start_attempt(self, disaggregated: bool) -> AttemptPlan:
        """dispatch -> attempting."""
        self._expect(Phase.DISPATCH)
        assert self.remaining > 0 and self.counted_attempts < self.max_attempts
        self.attempts += 1
        self._attempt_tokens = 0
        avoid = frozenset({self._last_engine}) if self._last_engine else frozenset()
        self.current = AttemptPlan(
            attempt_id=f"{self.request_id}-{self.attempts}",
            number=self.attempts,
            prompt_token_ids=self.prompt_token_ids + self.output_token_ids,
            max_tokens=self.remaining,
            disaggregated=disaggregated,
            avoid=avoid,
            min_tokens=max(0, self.min_tokens - len(self.output_token_ids)),
            resumed_output_tokens=len(self.output_token_ids),
        )
        self.phase = Phase.ATTEMPTING
        return self.current

    @property
    def last_engine(self) -> str | None:
        """The engine the latest attempt streamed from or failed on (None: none yet)."""
        return self._last_engine

    def on_delta(self, delta: TokenDelta, engine: str | None = None) -> Step:
        """Tokens (and maybe the end) of the current attempt's decode stream."""
        if self.phase is Phase.FINISHED:
            return Step(Action.FINISH, Emission())
        self._expect(Phase.ATTEMPTING)
        if engine is not None:
            self._last_engine = engine
        emission = Emission(logprobs=[] if self._want_logprobs else None)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None and not self.output_token_ids:
            self.prompt_logprobs = list(delta.prompt_logprobs[: self.prompt_tokens])
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent and delta.token_ids:
            emission.prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        # An engine's own "stop" (stop_reason None or an int) is a stop token, EOS or one of
        # stop_token_ids (stop strings are the router's; "recomputed" and "moved" are not an end):
        # its text is left out unless include_stop_str_in_output, as vLLM's detokenizer does.
        token_stop = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
        silent_last = len(delta.token_ids) - 1 if token_stop and not self._stops.include else -1
        # The token the engine ended the request on: its own end (a stop token, the length, its
        # own repetition) comes before a repetition, as in vLLM's check_stop.
        engine_last = len(delta.token_ids) - 1 if self._ends_response(delta) else -1
        check_repeats = self._repeats is not None and self.current is not None and self.current.resumed_output_tokens > 0
        for i, token_id in enumerate(delta.token_ids):
            if self.remaining <= 0:
                break
            self.output_token_ids.append(token_id)
            self._attempt_tokens += 1
            emission.token_ids.append(token_id)
            if self._want_logprobs and delta.logprobs is not None and i < len(delta.logprobs):
                self.output_logprobs.append(delta.logprobs[i])
                assert emission.logprobs is not None
                emission.logprobs.append(delta.logprobs[i])
            if i == silent_last:
                break
            repeated = check_repeats and i != engine_last and self._repeated()
            piece = self._text.push(token_id)
            # Stop strings only past the first min_tokens tokens, as vLLM's detokenizer counts.
            emission.text += self._stops.feed(piece, can_stop=self.completion_tokens > self.min_tokens)
            if self._stops.matched is not None:  # a stop string in the same token wins, as in vLLM's output processor
                return self._finish(emission, "stop", self._stops.matched)
            if repeated:
                return self._finish(emission, "repetition", REPETITION_STOP_REASON, flush=True)
        if delta.finish_reason is None:
            if self.remaining <= 0:
                # The engine was asked for exactly the remaining budget; its end is implied.
                return self._finish(emission, "length", None, flush=True)
            self._release(emission)
            return Step(Action.CONTINUE, emission)
        if delta.stop_reason == RECOMPUTED:
            self.recomputes += 1
            step = self._retry_or_fail(emission, "recomputed by the decode engine")
            step.recomputed = True
            return step
        if delta.stop_reason == MOVED:
            self.moves += 1
            step = self._retry_or_fail(emission, "the decode engine was stopped")
            step.moved = True
            return step
        if delta.finish_reason in RETRYABLE_FINISH_REASONS:
            return self._retry_or_fail(emission, f"engine finished the attempt with '{delta.finish_reason}'")
        return self._finish(emission, delta.finish_reason, delta.stop_reason, flush=True)

    def on_attempt_failed(
        self, reason: str, retryable: bool = True, engine: str | None = None, status: int = 500, moved: bool = False
    ) -> Step:
        """The attempt broke outside the token stream (dead replica, prefill error, deadline), or
        its decode engine is being stopped (``moved``): the request resumes elsewhere with the
        tokens it has, as after a recompute."""
        if self.phase is Phase.FINISHED:
            return Step(Action.FINISH, Emission())
        if moved:
            self.moves += 1
        if engine is not None:
            self._last_engine = engine
        if not retryable:
            return self._fail(Emission(), reason, status)
        step = self._retry_or_fail(Emission(), reason, status)
        step.moved = moved
        return step

    def fail(self, reason: str, status: int = 500) -> Step:
        """End the response with an error whatever the phase (e.g. the request deadline)."""
        if self.phase is Phase.FINISHED:
            return Step(Action.FINISH, Emission())
        return self._fail(Emission(), reason, status)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _ends_response(delta: TokenDelta) -> bool:
        """Whether the engine ended the client's response with this delta (not an attempt's end)."""
        return (
            delta.finish_reason is not None
            and delta.stop_reason not in (RECOMPUTED, MOVED)
            and delta.finish_reason not in RETRYABLE_FINISH_REASONS
        )

    def _repeated(self) -> bool:
        """vLLM's repetition check on the output's newest token, as one uninterrupted request's
        engine makes it: past min_tokens, and not on the token that reaches max_tokens (the
        length comes first). Once the attempt has a window's worth of its own output its engine
        sees every repetition there is, and the router checks no more."""
        n = len(self.output_token_ids)
        assert self._repeats is not None
        if n < self.min_tokens or n >= self.max_tokens or self._attempt_tokens >= self._repeats.window:
            return False
        return self._repeats(self.output_token_ids)

    def _retry_or_fail(self, emission: Emission, reason: str, status: int = 500) -> Step:
        wasted = self._attempt_waste()
        self.wasted_tokens += wasted
        if self.remaining <= 0:
            step = self._finish(emission, "length", None, flush=True)
            step.wasted_tokens = wasted
            return step
        if self.counted_attempts >= self.max_attempts:
            step = self._fail(emission, f"gave up after {self.attempts} attempts (last: {reason})", status)
            step.wasted_tokens = wasted
            return step
        self.phase = Phase.DISPATCH
        self.current = None
        self._release(emission)
        return Step(Action.RETRY, emission, wasted_tokens=wasted)

    def _attempt_waste(self) -> int:
        if self.current is None:
            return 0
        return len(self.current.prompt_token_ids) + self._attempt_tokens

    def _release(self, emission: Emission) -> None:
        self.text += emission.text

    def _finish(self, emission: Emission, reason: str | None, stop_reason: int | str | None, flush: bool = False) -> Step:
        if flush:
            emission.text += self._stops.flush()
        emission.finish_reason = reason
        emission.stop_reason = stop_reason
        self._release(emission)
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.phase = Phase.FINISHED
        return Step(Action.FINISH, emission)

    def _fail(self, emission: Emission, reason: str, status: int = 500) -> Step:
        emission.error = reason
        emission.error_status = status
        self._release(emission)
        self.error = reason
        self.phase = Phase.FINISHED
        return Step(Action.FINISH, emission)

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"{self.request_id}: expected phase {phase.value}, in {self.phase.value}")
