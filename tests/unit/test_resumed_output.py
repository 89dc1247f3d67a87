"""The resumed-output logits processor against vLLM's own sampler ops: for a request resumed
after ``k`` output tokens (its prompt now ends with them), vLLM's bad-words ban, this processor
and vLLM's penalties must leave the logits one uninterrupted run would have had, at every step."""

from __future__ import annotations

import random

import pytest
import torch
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.ops.bad_words import apply_bad_words

from serve_app.vllm_plugins.resumed_output import EarlierOutput, ResumedOutputLogitsProcessor
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS

VOCAB = 40


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [VOCAB] * (width - len(r)) for r in rows], dtype=torch.long)


def sampler_logits(raw: torch.Tensor, prompt: list[int], output: list[int], words: list[list[int]], pfr, processor=None):
    """What vLLM's sampler makes of one row before temperature: the bad-words ban, the custom
    processor (if any), then repetition, frequency and presence penalties."""
    presence, frequency, repetition = pfr
    logits = raw.clone()[None]
    if words:
        apply_bad_words(logits, {0: words}, [output])
    if processor is not None:
        logits[0] = processor(prompt, output, logits[0])
    return apply_penalties(
        logits,
        padded([prompt]),
        padded([output]),
        torch.tensor([presence]),
        torch.tensor([frequency]),
        torch.tensor([repetition]),
    )[0]


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


PENALTIES = [(0.7, 0.0, 1.0), (0.0, 0.45, 1.0), (0.6, 0.3, 1.0), (0.5, 0.25, 1.3), (-0.4, -0.2, 0.8), (0.0, 0.0, 1.0)]


@pytest.mark.parametrize("pfr", PENALTIES)
def test_every_step_of_a_resumed_attempt_matches_one_uninterrupted_run(pfr):
    rng = random.Random(PENALTIES.index(pfr))
    for _ in range(30):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB // 3) for _ in range(rng.randrange(1, 30))]  # repeats, often
        k = rng.randrange(1, len(output) + 1)
        earlier, later = output[:k], output[k:]
        # Bad words whose prefixes end at various points of the output, across the boundary too.
        words = [[rng.randrange(VOCAB)] + [rng.randrange(VOCAB)]]
        for end in range(max(1, k - 2), len(output) + 1):
            for length in (2, 3, 4):
                if end - (length - 1) >= 0:
                    words.append(output[end - (length - 1) : end] + [rng.randrange(VOCAB)])
        presence, frequency, repetition = pfr
        processor = EarlierOutput(k, presence, frequency, repetition, [w for w in words if len(w) > 1])
        resumed_prompt = prompt + earlier
        live: list[int] = []
        for step in range(len(later) + 1):
            raw = torch.randn(VOCAB) * 3
            want = sampler_logits(raw, prompt, earlier + live, words, pfr)
            got = sampler_logits(raw, resumed_prompt, live, words, pfr, processor)
            assert_same(got, want)
            if step < len(later):
                live.append(later[step])


def test_without_it_the_penalties_forget_the_earlier_output():
    """The premise: vLLM alone, on the resumed prompt, gives other logits."""
    prompt, earlier = [1, 2], [5, 5, 7]
    raw = torch.randn(VOCAB)
    pfr = (0.5, 0.5, 1.0)
    want = sampler_logits(raw, prompt, earlier, [[7, 9]], pfr)
    alone = sampler_logits(raw, prompt + earlier, [], [[7, 9]], pfr)
    assert not torch.equal(torch.isinf(alone), torch.isinf(want))  # 9 after 7 is not banned
    assert (alone[5] - want[5]).item() == pytest.approx(0.5 * 2 + 0.5)


def test_a_placeholder_is_read_again_next_step():
    """Async scheduling leaves -1 where the last token is not on the host yet."""
    processor = EarlierOutput(2, 1.0, 0.0, 1.0, [])
    live = [3, -1]
    first = processor([0, 3, 4], live, torch.zeros(VOCAB))
    assert first[3].item() == 0.0  # 3 is in this attempt's output: vLLM's presence penalty covers it
    assert first[4].item() == -1.0
    live[1] = 4
    second = processor([0, 3, 4], live, torch.zeros(VOCAB))
    assert second[4].item() == 0.0


def params(**kwargs) -> SamplingParams:
    bad = kwargs.pop("bad", None)
    p = SamplingParams(**kwargs)
    if bad is not None:
        p._bad_words_token_ids = bad
    return p


def test_the_processor_takes_only_resumed_requests_that_need_it():
    proc = ResumedOutputLogitsProcessor(None, torch.device("cpu"), False)
    marked = {RESUMED_OUTPUT_TOKENS: 4}
    assert proc.new_req_logits_processor(params(presence_penalty=1.0)) is None  # a first attempt
    assert proc.new_req_logits_processor(params(extra_args=marked)) is None  # nothing to correct
    assert proc.new_req_logits_processor(params(extra_args=marked, repetition_penalty=1.2)) is None
    assert proc.new_req_logits_processor(params(extra_args=marked, bad=[[5]])) is None  # one-token words
    assert isinstance(proc.new_req_logits_processor(params(extra_args=marked, bad=[[5, 6]])), EarlierOutput)
    assert isinstance(proc.new_req_logits_processor(params(extra_args=marked, frequency_penalty=0.1)), EarlierOutput)


@pytest.mark.parametrize("value", [-1, "3", 2.5, True, [1]])
def test_a_malformed_mark_is_refused(value):
    with pytest.raises(ValueError, match=RESUMED_OUTPUT_TOKENS):
        ResumedOutputLogitsProcessor.validate_params(params(extra_args={RESUMED_OUTPUT_TOKENS: value}))


def test_in_a_batch_only_the_resumed_row_changes():
    proc = ResumedOutputLogitsProcessor(None, torch.device("cpu"), False)
    resumed = params(extra_args={RESUMED_OUTPUT_TOKENS: 2}, frequency_penalty=1.0)
    plain = params(frequency_penalty=1.0)
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[(0, plain, [1, 2, 3], []), (1, resumed, [1, 2, 3], [])], moved=[]))
    logits = proc.apply(torch.zeros(2, VOCAB))
    assert torch.count_nonzero(logits[0]) == 0
    assert logits[1][2].item() == -1.0 and logits[1][3].item() == -1.0 and torch.count_nonzero(logits[1]) == 2
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert torch.count_nonzero(proc.apply(torch.zeros(1, VOCAB))) == 0
