"""Sampling penalties over the whole response when a request resumes after a recompute.

A resumed attempt's prompt is the client's prompt followed by the output the earlier attempts
produced (``RecomputeStateMachine.start_attempt``). vLLM counts those tokens as prompt, so three
things that look at the output alone would forget them: ``presence_penalty`` and
``frequency_penalty`` (the output's token counts) and multi-token ``bad_words`` (a word whose
first tokens ended the earlier attempt). ``repetition_penalty`` looks at prompt and output alike
and needs nothing.

The router marks a resumed attempt with how many of its prompt's tokens are earlier output
(``wire.sampling.RESUMED_OUTPUT_TOKENS`` in ``extra_args``); this logits processor, which decode
engines load (``Backend.resume_logits_processor``), adds what vLLM's own penalties leave out, so
the logits after vLLM's penalties are the ones one uninterrupted run would have had. It is a
vLLM ``AdapterLogitsProcessor``: vLLM keeps the per-request state in step with its persistent
batch and hands each request's row over. It runs after vLLM's bad-words ban and before its
penalties (``Sampler.apply_logits_processors``), so it writes the logit that vLLM's repetition
penalty then maps to the wanted one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from serve_app.wire.sampling import earlier_output, resumed_output_tokens


class EarlierOutput:
    """One resumed request's corrections, called with its prompt, its live output list and its
    logits row at every step."""

    def __init__(self, earlier_tokens: int, presence: float, frequency: float, repetition: float, bad_words: list[list[int]]):
        self.earlier_tokens = earlier_tokens
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition
        self.bad_words = bad_words  # those of two or more tokens (one-token words need no history)
        self._ready = False
        self._earlier: list[int] = []
        self._tokens = torch.empty(0, dtype=torch.long)  # distinct earlier tokens
        self._subtract = torch.empty(0)  # what one run's penalties take off each, beyond vLLM's
        # Earlier tokens not (yet) in this attempt's output -> their index in _tokens.
        self._absent: dict[int, int] = {}
        self._seen = 0  # output tokens already looked at

    def _start(self, prompt_ids: Sequence[int]) -> None:
        self._ready = True
        self._earlier = earlier_output(prompt_ids, self.earlier_tokens)
        if not (self.presence or self.frequency):
            return
        counts = Counter(self._earlier)
        tokens = list(counts)
        self._tokens = torch.tensor(tokens, dtype=torch.long)
        # Until a token shows up in this attempt's output, vLLM's presence penalty skips it.
        self._subtract = torch.tensor([self.frequency * counts[t] + self.presence for t in tokens], dtype=torch.float32)
        self._absent = {t: i for i, t in enumerate(tokens)}

    def _note_output(self, output_ids: Sequence[int]) -> None:
        """This attempt's new output tokens: once an earlier token appears again, vLLM's own
        presence penalty covers it. Stops at a placeholder (-1, async scheduling's unsampled
        token) and reads it again next step."""
        end = len(output_ids)
        while self._seen < end:
            token = output_ids[self._seen]
            if token < 0:
                break
            i = self._absent.pop(token, None)
            if i is not None:
                self._subtract[i] -= self.presence
            self._seen += 1

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self._ready:
            self._start(prompt_ids)
        if len(self._tokens):
            self._note_output(output_ids)
            self._penalize(logits)
        if self.bad_words:
            self._ban_words_across_attempts(output_ids, logits)
        return logits

    def _penalize(self, logits: torch.Tensor) -> None:
        if self._tokens.device != logits.device:
            self._tokens = self._tokens.to(logits.device)  # once: the set of earlier tokens is fixed
        tokens = self._tokens
        subtract = self._subtract.to(device=logits.device, dtype=logits.dtype)
        values = logits[tokens]
        r = self.repetition
        if r == 1.0:
            logits[tokens] = values - subtract
            return
        # Every earlier token is in this attempt's prompt, so vLLM's repetition penalty maps it
        # with x/r (x > 0) or x*r: write its inverse of what one run would reach before the
        # additive penalties.
        wanted = torch.where(values > 0, values / r, values * r) - subtract
        logits[tokens] = torch.where(wanted > 0, wanted * r, wanted / r)

    def _ban_words_across_attempts(self, output_ids: Sequence[int], logits: torch.Tensor) -> None:
        """A bad word whose first tokens end the earlier output (vLLM checks the new output
        alone, and only once it is as long as the word's prefix)."""
        produced = _valid_length(output_ids)  # short: this runs only while a prefix is unseen
        waiting = False
        for word in self.bad_words:
            prefix = len(word) - 1
            if produced >= prefix:
                continue  # vLLM's own check sees the whole prefix in this attempt's output
            waiting = True
            history = self._earlier[max(0, len(self._earlier) - (prefix - produced)) :] + list(output_ids[:produced])
            if history == word[:-1]:
                logits[word[-1]] = float("-inf")
        if not waiting:
            self.bad_words = []


def _valid_length(output_ids: Sequence[int]) -> int:
    for i, token in enumerate(output_ids):
        if token < 0:
            return i
    return len(output_ids)


class ResumedOutputLogitsProcessor(AdapterLogitsProcessor):
    """Loaded by decode engines (``logits_processors``); idle for every request the router did
    not mark as resumed, and for resumed ones that use none of the penalties above."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        resumed_output_tokens(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # penalties and bans change the greedy choice

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        earlier = resumed_output_tokens(params)
        if not earlier:
            return None
        bad_words = [list(w) for w in (params.bad_words_token_ids or []) if len(w) > 1]
        if not (params.presence_penalty or params.frequency_penalty or bad_words):
            return None
        return EarlierOutput(
            earlier,
            float(params.presence_penalty),
            float(params.frequency_penalty),
            float(params.repetition_penalty),
            bad_words,
        )
