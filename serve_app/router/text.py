"""Detokenization and stop strings for one client response, across all its attempts.

The router owns the response text: engines stream token ids only. One decode stream, primed with
the original prompt, turns every output token into text whichever attempt produced it, so a
recompute cannot change a byte of the text (a UTF-8 character split across two attempts decodes
exactly as it would in one). Stop strings are matched here for the same reason: a stop string
can begin in one attempt and end in the next, and no engine sees both halves.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Any, Protocol

from serve_app.runtime.compat import FIRST_COMPLETED_STOP_WINS
from serve_app.runtime.private_symbols import unchanged

logger = logging.getLogger("pd_serve.router")

_INVALID_PREFIX = "Invalid prefix encountered"
# The decode stream is primed with the prompt's last tokens only, not all of them: its first step
# decodes the priming ids twice, so a whole prompt would cost the router, on every request, CPU
# that grows with the prompt's length. A suffix that starts on a character boundary decodes the
# output exactly as the whole prompt would; vLLM's incremental detokenizer primes the same way.
PRIMING_MIN_TOKENS = 4
PRIMING_MAX_TOKENS = 24


def token_piece(tokenizer: Any, token_id: int) -> str:
    """One token's text as vLLM's engine writes it in logprobs (its ``decoded_token``): the
    installed vLLM's own conversion, which since 0.32 restores the leading space a SentencePiece
    tokenizer's decode drops ("▁river" reads " river", not "river")."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    return convert_ids_list_to_tokens(tokenizer, [token_id])[0]


CORRECT_DECODED_TOKEN = "vllm.v1.engine.logprobs.LogprobsProcessor._correct_decoded_token"


@functools.cache
def _vllms_correction() -> Any:
    if not unchanged([CORRECT_DECODED_TOKEN], logger, "multi-byte characters read across their tokens in logprobs"):
        return None
    from vllm.v1.engine.logprobs import LogprobsProcessor

    return LogprobsProcessor._correct_decoded_token


def piece_in_context(tokenizer: Any, token_id: int, context: list[int]) -> str | None:
    """A token whose own text is a piece of a multi-byte character, read with the tokens before
    it at its place, by vLLM's engine's own correction of its logprobs' text (the character where
    this token completes it, "" where it does not); None where that code is not as pd-serve
    expects. Cached: several decodes each (about 7 µs), and CJK text repeats its characters."""
    return _corrected(tokenizer, token_id, tuple(context))


@functools.lru_cache(maxsize=1 << 16)
def _corrected(tokenizer: Any, token_id: int, context: tuple[int, ...]) -> str | None:
    correct = _vllms_correction()
    return None if correct is None else correct(SimpleNamespace(tokenizer=tokenizer), token_id, list(context))


class TextStream(Protocol):
    def push(self, token_id: int) -> str: ...


class DecodeTextStream:
    """Incremental detokenizer over a Hugging Face fast tokenizer (tokenizers' DecodeStream).

    ``spaces_between_special_tokens=False`` (with special tokens shown) writes an added token
    that follows another as its bare content, without the space the tokenizer's decoder puts
    between them, as vLLM's engine's fast detokenizer does (``FastIncrementalDetokenizer``): the
    first added token of a run, the prompt's last token notwithstanding, keeps what the decoder
    gives it."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Added tokens by id (their bare text), where their runs are written without spaces.
        self._added: dict[int, str] = {} if skip_special_tokens or spaces_between_special_tokens else added_tokens(self._backend)
        self._last_added = False
        self._new_stream = lambda ids=None: (
            DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
            if ids is not None
            else DecodeStream(skip_special_tokens=skip_special_tokens)
        )
        self._stream = self._new_stream(priming_ids(self._backend, prompt_token_ids, skip_special_tokens))

    def push(self, token_id: int) -> str:
        text = self._step(token_id)
        if self._added:
            added = self._added.get(token_id)
            if added is not None and self._last_added:
                text = added
            self._last_added = added is not None
        return text

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:  # tokenizers' rare non-monotonic UTF-8 state; restart as vLLM does
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            logger.warning("decode stream reset after an invalid prefix")
            self._stream = self._new_stream()
            return self._stream.step(self._backend, token_id) or ""


@functools.cache
def added_tokens(backend: Any) -> dict[int, str]:
    """A tokenizers backend's added tokens (special or not), id to content: what vLLM's fast
    detokenizer writes without spaces between them. Cached per tokenizer: it is read once per
    request that asks."""
    return {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}


class PromptEncoder:
    """Text to token ids, as ``tokenizer.encode`` gives them.

    A Hugging Face fast tokenizer is called through its Rust tokenizer's ``encode_batch_fast``,
    which leaves out the character offsets that transformers' ``encode`` computes and then drops:
    about a third less of the router's CPU for tokenizing, on every request. transformers sets the
    Rust tokenizer's truncation, padding and special-token splitting on every call, the same way
    each time for a plain ``encode``; one such call here sets them once, and nothing in the router
    changes them after.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if hasattr(backend, "encode_batch_fast") else None
        if self._backend is not None:
            tokenizer.encode("")

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is None:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


class StopMatcher:
    """Finds the first stop string to complete in generated text, holding back just enough to be
    sure, as vLLM's detokenizer does.

    Where the stop string is left out of the output (the default), text is released only when no
    stop string can still begin in it: the last ``longest - 1`` characters stay pending until more
    text (or the end) arrives. Where it is kept (``include_stop_str_in_output``), a stop string
    ends the output wherever it ends, which is always in the text just fed, so text is released
    at once and those characters are kept only to be searched. Either way a stop string split
    across deltas or attempts is found. As in vLLM's detokenizer, a stop string counts only if it
    ends in the text just fed (text is fed one token at a time), so text fed while stopping was
    not allowed (``min_tokens``) never completes one later. Of two stop strings that the same
    text completes, the one the installed vLLM picks wins: the one that completes first (vLLM
    0.32), or the first of the request's list (vLLM 0.23, ``first_completed=False``).
    """

    def __init__(
        self, stops: list[str], include_stop_str_in_output: bool = False, first_completed: bool = FIRST_COMPLETED_STOP_WINS
    ) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self._first_completed_wins = first_completed
        self._holdback = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""  # the text a stop string may still end in: its last characters
        self._unreleased = 0  # of which the last this many are not released yet
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.stops)

    def feed(self, text: str, can_stop: bool = True) -> str:
        """Add generated text; return what may be released now. After a match, ``matched`` is set
        and the released text ends at the stop string (or includes it, if asked)."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self._pending += text
        self._unreleased += len(text)
        released_up_to = len(self._pending) - self._unreleased
        if can_stop:
            found = self._first_completed(len(text))
            if found is not None:
                index, stop = found
                self.matched = stop
                end = index + len(stop) if self.include else index
                released = self._pending[released_up_to:end]
                self._pending, self._unreleased = "", 0
                return released
        if self.include:
            released, self._unreleased = self._pending[released_up_to:], 0
        else:
            released_up_to = max(released_up_to, len(self._pending) - self._holdback)
            released = self._pending[len(self._pending) - self._unreleased : released_up_to]
            self._unreleased = len(self._pending) - released_up_to
        self._pending = self._pending[max(0, len(self._pending) - self._holdback) :]
        return released

    def flush(self) -> str:
        """The generation ended without a match: release what was held back."""
        released = self._pending[len(self._pending) - self._unreleased :]
        self._pending, self._unreleased = "", 0
        return released

    def _first_completed(self, new_chars: int) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that ends first within the last ``new_chars``
        characters of the pending text, ties to the earlier in the request's list; or, as vLLM
        0.23, of the first in the list that ends there."""
        if not new_chars:
            return None
        best: tuple[int, str] | None = None
        best_end = 0
        for stop in self.stops:
            index = self._pending.find(stop, max(0, len(self._pending) - new_chars - len(stop) + 1))
            if index >= 0 and (best is None or index + len(stop) < best_end):
                best, best_end = (index, stop), index + len(stop)
                if not self._first_completed_wins:
                    break
        return best


def priming_ids(backend: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """The shortest suffix of the prompt, of at least ``PRIMING_MIN_TOKENS`` tokens, that decodes
    to whole characters (no U+FFFD: it does not begin inside a multi-byte character) and to some
    text (a suffix of skipped special tokens decodes to none, and a decoder that strips the
    text's start, as Llama 2's does, would then strip the first output token's leading space,
    which the whole prompt keeps); the whole prompt if none up to ``PRIMING_MAX_TOKENS`` does.
    (Not quite the whole prompt's decoding where a token-id prompt holds an invalid byte run
    before the suffix: vLLM's stream then spills that text into the first output, this does not:
    docs/design.md.)"""
    ids = list(prompt_token_ids)
    for n in range(PRIMING_MIN_TOKENS, min(len(ids), PRIMING_MAX_TOKENS) + 1):
        suffix = ids[-n:]
        text = backend.decode(suffix, skip_special_tokens=skip_special_tokens)
        if text and "\ufffd" not in text:
            return suffix
    return ids
