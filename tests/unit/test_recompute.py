"""The recompute-retry state machine, driven by hand (no Ray, no engine)."""

from __future__ import annotations

import json

import pytest

from serve_app.router.errors import OpenAIError
from serve_app.router.framing import ResponseFramer
from serve_app.router.parsing import ModelContext, parse_request
from serve_app.router.recompute import MAX_FREE_MOVES, Action, Phase, RecomputeStateMachine
from serve_app.router.text import StopMatcher
from serve_app.wire.protocol import MOVED, RECOMPUTED, TokenDelta, TokenLogprob


class LetterStream:
    """Token t decodes to the letter chr(ord('a') + t): easy to read, one char per token."""

    def push(self, token_id: int) -> str:
        return chr(ord("a") + token_id)


def machine(max_tokens=10, max_attempts=4, stops=(), prompt=(100, 101, 102), **kw) -> RecomputeStateMachine:
    return RecomputeStateMachine(
        request_id="cmpl-x",
        prompt_token_ids=list(prompt),
        max_tokens=max_tokens,
        max_attempts=max_attempts,
        text=LetterStream(),
        stops=StopMatcher(list(stops)),
        **kw,
    )


def delta(*ids, finish=None, stop=None):
    return TokenDelta(token_ids=list(ids), finish_reason=finish, stop_reason=stop)


def recomputed(*ids):
    return delta(*ids, finish="stop", stop=RECOMPUTED)


def test_single_attempt_phases():
    m = machine()
    plan = m.start_attempt(disaggregated=True)
    assert (plan.number, plan.prompt_token_ids, plan.max_tokens) == (1, [100, 101, 102], 10)
    assert m.phase is Phase.ATTEMPTING
    step = m.on_delta(delta(0, 1, 2, finish="stop"))
    # The engine stopped on token 2 (EOS or a stop token id): its id is output, its text is not.
    assert step.action is Action.FINISH and step.emission.text == "ab" and step.emission.token_ids == [0, 1, 2]
    assert m.phase is Phase.FINISHED and m.finish_reason == "stop"


def test_one_recompute_resumes_with_history_and_shrunk_budget():
    m = machine(max_tokens=10)
    first = m.start_attempt(disaggregated=False)
    m.on_delta(delta(0, 1), engine="decode-0")
    m.on_delta(delta(2), engine="decode-0")
    step = m.on_delta(recomputed(), engine="decode-0")
    assert step.action is Action.RETRY and step.recomputed
    assert step.wasted_tokens == 3 + 3  # the attempt's prompt + its output
    assert m.phase is Phase.DISPATCH
    second = m.start_attempt(disaggregated=False)
    assert second.prompt_token_ids == [100, 101, 102, 0, 1, 2]
    assert second.max_tokens == 7
    assert second.attempt_id != first.attempt_id
    assert second.avoid == frozenset({"decode-0"})
    m.on_delta(delta(3, 4, 5, 6, 7, 8, 9, finish="length"), engine="decode-1")
    assert m.finished and m.output_token_ids == list(range(10)) and m.text == "abcdefghij"
    assert (m.prompt_tokens, m.completion_tokens, m.attempts, m.recomputes) == (3, 10, 2, 1)


def test_budget_shrinks_by_tokens_not_by_chunks():
    """Deltas carry several tokens each (coalesced engine steps): the budget counts tokens."""
    m = machine(max_tokens=20)
    m.start_attempt(False)
    m.on_delta(delta(1, 2, 3, 4, 5))  # one chunk, five tokens
    m.on_delta(recomputed())
    assert m.start_attempt(False).max_tokens == 15
    m.on_delta(delta(6, 7, 8))
    m.on_delta(delta(9))
    m.on_delta(recomputed())
    third = m.start_attempt(False)
    assert third.max_tokens == 11 and third.prompt_token_ids[3:] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_several_recomputes_then_finish():
    m = machine(max_tokens=6, max_attempts=6)
    for token in range(5):
        m.start_attempt(False)
        m.on_delta(delta(token))
        assert m.on_delta(recomputed()).action is Action.RETRY
    m.start_attempt(False)
    assert m.current.max_tokens == 1
    step = m.on_delta(delta(5, finish="length"))
    assert step.action is Action.FINISH and m.output_token_ids == [0, 1, 2, 3, 4, 5] and m.attempts == 6


def test_budget_reaching_zero_finishes_with_length_not_another_attempt():
    m = machine(max_tokens=3)
    m.start_attempt(False)
    m.on_delta(delta(0, 1, 2))
    step = m.on_delta(recomputed())
    assert step.action is Action.FINISH
    assert m.finish_reason == "length" and m.attempts == 1 and m.error is None


def test_tokens_beyond_the_budget_are_never_counted():
    m = machine(max_tokens=2)
    m.start_attempt(False)
    step = m.on_delta(delta(0, 1, 2, 3))
    assert m.output_token_ids == [0, 1] and step.action is Action.FINISH and m.finish_reason == "length"


def test_max_attempts_ends_with_an_error_not_a_loop():
    m = machine(max_tokens=100, max_attempts=2)
    m.start_attempt(False)
    m.on_delta(delta(0))
    assert m.on_delta(recomputed()).action is Action.RETRY
    m.start_attempt(False)
    m.on_delta(delta(1))
    step = m.on_delta(recomputed())
    assert step.action is Action.FINISH and step.emission.error is not None
    assert "2 attempts" in step.emission.error and m.finished
    with pytest.raises(RuntimeError):
        m.start_attempt(False)


def test_moves_off_a_stopping_engine_resume_like_a_recompute_but_cost_no_attempt():
    """A decode engine Serve stops ends its streams with stop_reason 'moved' (or the router ends
    them, an AttemptFailed with moved=True): the request resumes with its tokens so far, elsewhere;
    the first MAX_FREE_MOVES moves do not count against max_attempts, so a pool shrinking twice
    cannot fail a request that had one attempt left."""
    m = machine(max_tokens=100, max_attempts=1)
    m.start_attempt(False)
    m.on_delta(delta(0, 1), engine="decode-0")
    step = m.on_delta(delta(2, finish="stop", stop=MOVED), engine="decode-0")
    assert step.action is Action.RETRY and step.moved and not step.recomputed
    plan = m.start_attempt(False)
    assert plan.prompt_token_ids == [100, 101, 102, 0, 1, 2] and plan.avoid == frozenset({"decode-0"})
    assert m.on_attempt_failed("the decode engine was stopped", True, "decode-1", 503, moved=True).action is Action.RETRY
    assert (m.moves, m.recomputes, m.counted_attempts) == (2, 0, 0)
    for _ in range(MAX_FREE_MOVES - 2):
        m.start_attempt(False)
        assert m.on_attempt_failed("moved", True, "decode-1", 503, moved=True).action is Action.RETRY
    m.start_attempt(False)  # the attempt max_attempts allows
    step = m.on_attempt_failed("moved", True, "decode-1", 503, moved=True)  # past the free moves: counted
    assert step.action is Action.FINISH and step.emission.error is not None


def test_engine_failure_retries_and_prefers_another_engine():
    m = machine()
    m.start_attempt(True)
    step = m.on_attempt_failed("prefill engine prefill-0 failed", retryable=True, engine="prefill-0")
    assert step.action is Action.RETRY and not step.recomputed
    plan = m.start_attempt(True)
    assert plan.avoid == frozenset({"prefill-0"}) and plan.prompt_token_ids == [100, 101, 102]


def test_a_dead_decode_mid_stream_resumes_token_exact():
    m = machine(max_tokens=8)
    m.start_attempt(False)
    m.on_delta(delta(0, 1, 2), engine="decode-0")
    assert m.on_attempt_failed("decode engine decode-0 failed", engine="decode-0").action is Action.RETRY
    plan = m.start_attempt(False)
    assert plan.prompt_token_ids == [100, 101, 102, 0, 1, 2] and plan.max_tokens == 5
    assert plan.avoid == frozenset({"decode-0"})


def test_engine_abort_or_error_finish_is_a_failed_attempt():
    m = machine()
    m.start_attempt(False)
    assert m.on_delta(delta(0, finish="error")).action is Action.RETRY
    m.start_attempt(False)
    assert m.on_delta(delta(finish="abort")).action is Action.RETRY


def test_non_retryable_failure_and_request_deadline():
    m = machine()
    m.start_attempt(False)
    step = m.on_attempt_failed("no decode engine is available", retryable=False, status=503)
    assert step.action is Action.FINISH and step.emission.error_status == 503
    m2 = machine()
    m2.start_attempt(False)
    assert m2.fail("request timed out", status=504).emission.error_status == 504


def test_stop_string_spanning_two_attempts():
    """'cde' starts in attempt 1 ('...cd') and ends in attempt 2 ('e...'): no engine saw it."""
    m = machine(max_tokens=20, stops=["cde"])
    m.start_attempt(False)
    released = m.on_delta(delta(0, 1, 2, 3)).emission.text  # 'abcd'
    released += m.on_delta(recomputed()).emission.text
    assert "c" not in released  # 'cd' is held back: it may begin the stop string
    m.start_attempt(False)
    step = m.on_delta(delta(4, 5, 6))  # 'efg'
    released += step.emission.text
    assert step.action is Action.FINISH
    assert released == m.text == "ab"
    assert (m.finish_reason, m.stop_reason) == ("stop", "cde")
    assert m.output_token_ids == [0, 1, 2, 3, 4]  # up to the token that completed the stop


def test_stop_string_not_matched_releases_the_held_text_at_the_end():
    m = machine(max_tokens=4, stops=["zz"])
    m.start_attempt(False)
    text = m.on_delta(delta(0, 1)).emission.text
    text += m.on_delta(delta(2, 3, finish="length")).emission.text
    assert text == "abcd" == m.text


def test_logprobs_follow_the_tokens_across_attempts():
    m = machine(max_tokens=4, logprobs=True)
    m.start_attempt(False)
    lp = [TokenLogprob(token_id=0, logprob=-0.5), TokenLogprob(token_id=1, logprob=-0.25)]
    m.on_delta(TokenDelta(token_ids=[0, 1], logprobs=lp))
    m.on_delta(recomputed())
    m.start_attempt(False)
    m.on_delta(TokenDelta(token_ids=[2, 3], logprobs=[TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)], finish_reason="length"))
    assert [x.token_id for x in m.output_logprobs] == [0, 1, 2, 3]


def test_tokens_need_an_attempt():
    m = machine()
    with pytest.raises(RuntimeError, match="expected phase attempting, in dispatch"):
        m.on_delta(delta(0))
    m.start_attempt(True)
    assert m.on_delta(delta(0)).action is Action.CONTINUE and m.phase is Phase.ATTEMPTING


# ---------------------------------------------------------------- with the real request types
@pytest.fixture
def ctx(tiny_tokenizer):
    return ModelContext(name="tiny-llama", aliases=frozenset(), max_model_len=256, vocab_size=1024, tokenizer=tiny_tokenizer)


def test_max_completion_tokens_wins_over_max_tokens(ctx):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "max_completion_tokens": 7}
    assert parse_request("chat", chat, ctx).max_tokens == 7
    assert parse_request("chat", {"messages": chat["messages"], "max_tokens": 9}, ctx).max_tokens == 9
    parsed = parse_request("chat", {"messages": chat["messages"]}, ctx)
    assert parsed.max_tokens == 256 - len(parsed.prompt_token_ids)  # neither: the room left
    assert parse_request("completions", {"prompt": "Hi", "max_tokens": 5}, ctx).max_tokens == 5


def test_empty_messages_are_rejected_before_any_engine(ctx):
    with pytest.raises(OpenAIError) as err:
        parse_request("chat", {"messages": []}, ctx)
    assert err.value.status == 400 and err.value.param == "messages"


def run_with_framer(ctx, body, attempts):
    """Drive machine + framer through attempts (lists of deltas); returns the stream chunks."""
    parsed = parse_request("chat" if "messages" in body else "completions", body, ctx)
    m = RecomputeStateMachine(
        request_id=parsed.response_id,
        prompt_token_ids=parsed.prompt_token_ids,
        max_tokens=parsed.max_tokens,
        max_attempts=8,
        text=LetterStream(),
        stops=StopMatcher(parsed.stops),
    )
    framer = ResponseFramer(parsed, token_text=lambda t: chr(ord("a") + t))
    chunks = []
    for deltas in attempts:
        m.start_attempt(False)
        for d in deltas:
            chunks += framer.chunks(m.on_delta(d).emission)
    return parsed, m, framer, chunks


def test_one_response_across_attempts_role_once_stable_id_no_recomputed_chunk(ctx):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    parsed, m, framer, chunks = run_with_framer(
        ctx, body, [[delta(0, 1), recomputed()], [delta(2), recomputed()], [delta(3, 4, 5, finish="length")]]
    )
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    assert {c["id"] for c in chunks} == {parsed.response_id} and len({c["created"] for c in chunks}) == 1
    assert all(c["choices"][0].get("stop_reason") != RECOMPUTED for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abcdef"
    usage = framer.usage_chunk(m.prompt_tokens, m.completion_tokens)["usage"]
    assert usage == {
        "prompt_tokens": len(parsed.prompt_token_ids),
        "completion_tokens": 6,
        "total_tokens": len(parsed.prompt_token_ids) + 6,
    }


def test_non_stream_response_without_engine_usage_is_stitched_from_counted_tokens(ctx):
    """Engines report no usage at all (deltas have none): the budget and the final usage come
    from the tokens the router counted, so a missing usage.completion_tokens cannot break them."""
    body = {"prompt": "Hi", "max_tokens": 5}
    parsed, m, framer, _ = run_with_framer(ctx, body, [[delta(0, 1, 2), recomputed()], [delta(3, 4, finish="length")]])
    final = framer.final(
        text=m.text,
        token_ids=m.output_token_ids,
        logprobs=None,
        finish_reason=m.finish_reason,
        stop_reason=m.stop_reason,
        prompt_tokens=m.prompt_tokens,
    )
    assert final["choices"][0]["text"] == "abcde" and final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 5
    assert final["usage"]["prompt_tokens"] == len(parsed.prompt_token_ids)
    assert final["id"] == parsed.response_id


def test_min_tokens_left_shrinks_across_attempts():
    m = machine(max_tokens=20, min_tokens=5)
    assert m.start_attempt(False).min_tokens == 5
    m.on_delta(delta(0, 1, 2))
    m.on_delta(recomputed())
    assert m.start_attempt(False).min_tokens == 2
    m.on_delta(delta(3, 4, 5))
    m.on_delta(recomputed())
    assert m.start_attempt(False).min_tokens == 0


def test_a_later_attempt_says_how_much_of_its_prompt_is_earlier_output():
    m = machine(max_tokens=20)
    assert m.start_attempt(False).resumed_output_tokens == 0
    m.on_delta(delta(0, 1, 2))
    m.on_delta(recomputed())
    plan = m.start_attempt(True)
    assert plan.resumed_output_tokens == 3 and plan.prompt_token_ids[-3:] == [0, 1, 2]


def test_a_stop_tokens_text_is_left_out_unless_asked_for_as_vllm_does():
    for stop_reason in (None, 7):  # EOS; one of stop_token_ids
        m = machine()
        m.start_attempt(disaggregated=False)
        m.on_delta(delta(0, 1))
        step = m.on_delta(delta(2, 7, finish="stop", stop=stop_reason))
        assert (step.emission.text, step.emission.token_ids, m.text) == ("c", [2, 7], "abc")
        assert m.output_token_ids == [0, 1, 2, 7] and m.stop_reason == stop_reason
    m = RecomputeStateMachine(
        request_id="cmpl-x", prompt_token_ids=[100], max_tokens=10, max_attempts=1, text=LetterStream(), stops=StopMatcher([], True)
    )
    m.start_attempt(disaggregated=False)
    assert m.on_delta(delta(0, 7, finish="stop", stop=7)).emission.text == "ah"  # include_stop_str_in_output
    # A recomputed or moved attempt's last tokens are output like any other.
    m = machine()
    m.start_attempt(disaggregated=False)
    m.on_delta(recomputed(0, 1))
    assert m.text == "ab"


@pytest.mark.parametrize(
    ("stops", "min_tokens", "tokens", "text", "stop"),
    [
        # A stop string is not matched within the first min_tokens tokens, counting as vLLM does:
        # with min_tokens=1 the first token cannot stop.
        (["a"], 1, [0, 1, 2], "abc", None),
        (["b"], 1, [0, 1, 2], "a", "b"),
        # Text fed while stopping was not allowed never completes a stop string later.
        (["x", "xyzzy"], 2, [23, 1, 2], "xbc", None),
    ],
)
def test_stop_strings_match_as_vllms_detokenizer_does(stops, min_tokens, tokens, text, stop):
    m = machine(stops=stops, min_tokens=min_tokens)
    m.start_attempt(disaggregated=False)
    for token in tokens:
        m.on_delta(delta(token))
    if not m.finished:
        m.on_delta(delta(finish="length"))
    assert (m.text, m.stop_reason) == (text, stop)


def test_logprobs_are_framed_as_vllms_server_frames_them(ctx):
    """Top logprobs hold the sampled token first (completions: up to logprobs + 1 entries; chat:
    the first top_logprobs, as vLLM's server lists them), and -inf (a token masked out) is sent as -9999.0, never as JSON's
    invalid -Infinity."""
    inf = float("-inf")
    lps = [TokenLogprob(0, -0.5, ((1, -0.1), (0, -0.5))), TokenLogprob(2, inf, ((1, -0.2),)), TokenLogprob(3, -1.0, ())]
    for route, body in (
        ("completions", {"prompt": "Hi", "logprobs": 1}),
        ("chat", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1}),
    ):
        parsed = parse_request(route, {**body, "max_tokens": 3}, ctx)
        final = ResponseFramer(parsed, token_text=lambda t: chr(ord("a") + t)).final(
            text="acd", token_ids=[0, 2, 3], logprobs=lps, finish_reason="length", stop_reason=None, prompt_tokens=2
        )
        json.loads(json.dumps(final, allow_nan=False))  # raises on -Infinity
        logprobs = final["choices"][0]["logprobs"]
        if route == "completions":
            assert logprobs["token_logprobs"] == [-0.5, -9999.0, -1.0]
            assert logprobs["top_logprobs"] == [{"a": -0.5, "b": -0.1}, {"c": -9999.0, "b": -0.2}, {"d": -1.0}]
        else:
            assert [c["logprob"] for c in logprobs["content"]] == [-0.5, -9999.0, -1.0]
            # vLLM's server: the first top_logprobs of the engine's entries, the sampled token first.
            assert [[t["token"] for t in c["top_logprobs"]] for c in logprobs["content"]] == [["a"], ["c"], ["d"]]


def test_return_token_ids_returns_the_prompts_too_as_vllms_server_does(ctx):
    """The prompt's token ids: in the first stream chunk only (completions: in its choice; chat:
    in the chunk), and in the final response."""
    for route, body in (("completions", {"prompt": "Hi there"}), ("chat", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {**body, "max_tokens": 4, "stream": True, "return_token_ids": True}
        parsed, m, framer, chunks = run_with_framer(ctx, body, [[delta(0, 1), recomputed()], [delta(2, 3, finish="length")]])
        where = [c["choices"][0] if route == "completions" else c for c in chunks]
        assert where[0]["prompt_token_ids"] == parsed.prompt_token_ids and len(chunks) >= 2
        assert all("prompt_token_ids" not in w for w in where[1:])
        final = framer.final(text="abcd", token_ids=[0, 1, 2, 3], logprobs=None, finish_reason="length", stop_reason=None, prompt_tokens=2)
        holder = final["choices"][0] if route == "completions" else final
        assert holder["prompt_token_ids"] == parsed.prompt_token_ids
        parsed = parse_request(route, {**body, "return_token_ids": False}, ctx)
        assert "prompt_token_ids" not in str(
            ResponseFramer(parsed, token_text=chr).final(
                text="", token_ids=[], logprobs=None, finish_reason="length", stop_reason=None, prompt_tokens=2
            )
        )


# ---------------------------------------------------------------- repetition_detection across attempts


class VllmStop:
    """What vLLM's engine core decides after each token of one engine request: its own
    ``check_stop`` (vllm.v1.core.sched.utils) over the request's own output."""

    def __init__(self, params, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.sampling_params = params
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.status = None
        self.stop_reason = None
        self.pooling_params = None
        self._prompt = prompt_tokens
        self._max_model_len = max_model_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self._prompt + len(self.output_token_ids)

    def feed(self, token: int) -> tuple[str | None, int | str | None]:
        from vllm.v1.core.sched.utils import check_stop
        from vllm.v1.request import RequestStatus

        self.output_token_ids.append(token)
        if not check_stop(self, max_model_len=self._max_model_len):
            return None, None
        return str(RequestStatus.get_finished_reason(self.status)), self.stop_reason


def repetition_params(min_tokens: int, detection: dict, stop_token_ids: tuple[int, ...] = ()):
    from vllm.sampling_params import RepetitionDetectionParams, SamplingParams

    return SamplingParams(
        max_tokens=1000,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        repetition_detection=RepetitionDetectionParams(**detection),
    )


def serve_with_recomputes(
    tokens: list[int],
    params,
    max_tokens: int,
    recompute_at: set[int],
    repeats=True,
    chunk: int = 1,
    stops: tuple[str, ...] = (),
    include: bool = False,
    max_model_len: int = 1 << 20,
):
    """The router's machine over engines that each decide their own stop with vLLM's check_stop
    (stop tokens, the length, min_tokens, repetition_detection over their own output), send their
    tokens ``chunk`` at a time, and give the request back (recompute) after the global token
    counts in ``recompute_at``: (output, text, finish reason, stop reason, attempts)."""
    from serve_app.router.recompute import repetition_check

    prompt = [100, 101, 102]
    m = RecomputeStateMachine(
        request_id="cmpl-x",
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        max_attempts=len(recompute_at) + 1,
        text=LetterStream(),
        stops=StopMatcher(list(stops), include_stop_str_in_output=include),
        min_tokens=params.min_tokens,
        repeats=repetition_check(params) if repeats else None,
    )
    while not m.finished:
        plan = m.start_attempt(False)
        own = repetition_params(plan.min_tokens, vars(params.repetition_detection), tuple(params.stop_token_ids))
        engine = VllmStop(own, len(plan.prompt_token_ids), plan.max_tokens, max_model_len)
        pending: list[int] = []
        position = len(m.output_token_ids)
        while not m.finished:
            position += 1
            pending.append(tokens[position - 1])
            finish, stop = engine.feed(tokens[position - 1])
            if finish is not None:
                m.on_delta(delta(*pending, finish=finish, stop=stop))
                break
            if position in recompute_at:
                if position % 2:  # the last tokens with the recompute, or before it
                    m.on_delta(delta(*pending, finish="stop", stop=RECOMPUTED))
                elif m.on_delta(delta(*pending)).action is not Action.FINISH:
                    m.on_delta(recomputed())
                break
            if len(pending) == chunk:
                m.on_delta(delta(*pending))
                pending = []
    return m.output_token_ids, m.text, m.finish_reason, m.stop_reason, m.attempts


def test_a_repetition_that_spans_a_recompute_ends_the_response_where_one_uninterrupted_request_would():
    """vLLM's engine checks repetition_detection over the output of the request it serves; a
    resumed attempt's engine sees only its own, so the router checks the whole output (with
    vLLM's own function) on a resumed attempt's tokens."""
    params = repetition_params(0, {"max_pattern_size": 2, "min_count": 3})
    tokens = [5, 6, 0, 1, 0, 1, 0, 1, 7, 8, 9, 10, 11, 12]  # "0 1" three times ends at the 8th token
    want = (tokens[:8], "fgababab", "repetition", "repetition_detected")
    assert serve_with_recomputes(tokens, params, 12, set()) == (*want, 1)
    # The request recomputed after the 6th token: the second engine has seen only "0 1".
    assert serve_with_recomputes(tokens, params, 12, {6}) == (*want, 2)
    assert serve_with_recomputes(tokens, params, 12, {6}, chunk=3) == (*want, 2)
    assert serve_with_recomputes(tokens, params, 12, {6}, repeats=False)[2:] == ("length", None, 2)
    # The widest window vLLM looks at (pattern size 2, twice: 4 tokens) ends on the resumed
    # attempt's third token: its engine has not seen it whole, the router has.
    params = repetition_params(0, {"max_pattern_size": 2, "min_pattern_size": 2, "min_count": 2})
    tokens = [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert serve_with_recomputes(tokens, params, 10, {1}) == (tokens[:4], "abab", "repetition", "repetition_detected", 2)


@pytest.mark.parametrize("seed", range(4))
def test_repetition_detection_with_recomputes_matches_one_uninterrupted_request(seed):
    """Random outputs over a small vocabulary (repeats come often), random parameters, min_tokens,
    stop tokens and stop strings (kept or not), a context that may end first, tokens coming one
    to four at a time, recomputes at random places: the output, its text, finish and stop
    reasons are those of one uninterrupted request, whose engine decides with vLLM's check_stop."""
    import random

    rng = random.Random(seed)
    for _ in range(150):
        tokens = [rng.randrange(5) for _ in range(60)]
        low = rng.randint(0, 3)
        detection = {"max_pattern_size": rng.randint(max(low, 1), 6), "min_pattern_size": low, "min_count": rng.randint(2, 4)}
        params = repetition_params(rng.randint(0, 12), detection, stop_token_ids=rng.choice([(), (4,)]))
        stops = rng.choice([(), ("dd",), ("abc", "cb")])
        max_tokens, max_model_len = rng.randint(1, 40), rng.choice([1 << 20, rng.randint(4, 40)])
        options = {"stops": stops, "include": rng.random() < 0.5, "max_model_len": max_model_len}
        want = serve_with_recomputes(tokens, params, max_tokens, set(), **options)
        cuts = set(rng.sample(range(1, max_tokens + 1), k=min(max_tokens, rng.randint(1, 3))))
        got = serve_with_recomputes(tokens, params, max_tokens, cuts, chunk=rng.randint(1, 4), **options)
        assert got[:4] == want[:4], (tokens, detection, params.min_tokens, max_tokens, options, sorted(cuts))


def test_a_stop_string_in_the_token_that_repeats_wins_as_in_vllms_output_processor():
    params = repetition_params(0, {"max_pattern_size": 1, "min_count": 3})
    from serve_app.router.recompute import repetition_check

    m = machine(max_tokens=10, stops=("ccc",), repeats=repetition_check(params))
    m.start_attempt(False)
    m.on_delta(delta(2, 2))
    m.on_delta(recomputed())
    m.start_attempt(False)
    step = m.on_delta(delta(2, 3))  # "c" a third time: a repetition, and the stop string "ccc"
    assert (m.finish_reason, m.stop_reason, m.output_token_ids, step.emission.text, m.text) == ("stop", "ccc", [2, 2, 2], "", "")


def test_the_engines_own_end_and_the_length_come_before_a_repetition_as_in_vllms_check_stop():
    from serve_app.router.recompute import repetition_check

    params = repetition_params(0, {"max_pattern_size": 1, "min_count": 4})
    for include in (False, True):  # a stop token's text kept or not: the token is checked either way
        m = RecomputeStateMachine(
            request_id="cmpl-x",
            prompt_token_ids=[100],
            max_tokens=10,
            max_attempts=2,
            text=LetterStream(),
            stops=StopMatcher([], include_stop_str_in_output=include),
            repeats=repetition_check(params),
        )
        m.start_attempt(False)
        m.on_delta(delta(0, 0, 0))
        m.on_delta(recomputed())
        m.start_attempt(False)
        m.on_delta(delta(0, finish="stop", stop=0))  # 0 a fourth time, and a stop token id
        assert (m.finish_reason, m.stop_reason) == ("stop", 0), include
    # The token that reaches max_tokens (the engine's end implied by its budget): the length.
    m = machine(max_tokens=4, repeats=repetition_check(params))
    m.start_attempt(False)
    m.on_delta(delta(0, 0))
    m.on_delta(recomputed())
    m.start_attempt(False)
    m.on_delta(delta(0, 0))
    assert (m.finish_reason, m.stop_reason, m.output_token_ids) == ("length", None, [0, 0, 0, 0])
