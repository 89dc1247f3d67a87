from __future__ import annotations

import pytest

from serve_app.router.text import DecodeTextStream, StopMatcher, token_piece


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    if matcher.matched is None:
        out += matcher.flush()
    return out


def test_no_stops_passes_text_through_at_once():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.matched is None


def test_stop_inside_one_piece_truncates():
    m = StopMatcher(["STOP"])
    assert feed_all(m, ["hello STOP world"]) == "hello "
    assert m.matched == "STOP"


def test_stop_split_across_pieces_is_found_and_never_released():
    m = StopMatcher(["STOP"])
    released = [m.feed(p) for p in ["hel", "lo S", "T", "OP and more"]]
    assert "".join(released) == "hello "
    assert all("S" not in r for r in released)
    assert m.matched == "STOP"


def test_holdback_is_released_at_the_end():
    m = StopMatcher(["STOP"])
    assert m.feed("abcdef") == "abc"  # 'def' might still begin 'STOP'... or not: held 3 chars
    assert m.flush() == "def"


def test_include_stop_str_and_earliest_match():
    m = StopMatcher(["world", "lo w"], include_stop_str_in_output=True, first_completed=True)
    assert feed_all(m, ["hello world"]) == "hello w"
    assert m.matched == "lo w"


def test_of_two_stop_strings_in_one_piece_the_first_to_complete_wins_as_on_vllm_032():
    """vLLM 0.32's detokenizer picks the stop string that completes first (one token's text can
    complete several), not the one that starts first."""
    m = StopMatcher(["abcd", "bc"], first_completed=True)
    assert m.feed("a") + m.feed("bcd") == "a"
    assert m.matched == "bc"
    m = StopMatcher(["cd", "bc"], first_completed=True)
    assert m.feed("ab") + m.feed("cd") == "a" and m.matched == "bc"


def test_of_two_stop_strings_in_one_piece_the_first_listed_wins_as_on_vllm_023():
    m = StopMatcher(["cd", "bc"], first_completed=False)
    assert m.feed("ab") + m.feed("cd") == "ab" and m.matched == "cd"


def test_the_stop_string_order_is_the_installed_vllms():
    from vllm.v1.engine.detokenizer import check_stop_strings

    from serve_app.runtime.compat import FIRST_COMPLETED_STOP_WINS

    assert check_stop_strings("xabcd", 2, ["cd", "bc"], False)[0] == ("bc" if FIRST_COMPLETED_STOP_WINS else "cd")
    assert StopMatcher(["cd", "bc"]).feed("xabcd") == ("xa" if FIRST_COMPLETED_STOP_WINS else "xab")


def test_min_tokens_defers_matching():
    m = StopMatcher(["a"])
    assert m.feed("xa", can_stop=False) == "xa"  # nothing held for a 1-char stop; no match yet
    assert m.matched is None


def test_decode_stream_matches_batch_decode(tiny_tokenizer):
    prompt = tiny_tokenizer.encode("The river")
    ids = tiny_tokenizer.encode(" ran past the old mill; café, naïve — ok", add_special_tokens=False)
    stream = DecodeTextStream(tiny_tokenizer, prompt)
    text = "".join(stream.push(t) for t in ids)
    assert text == tiny_tokenizer.decode(ids)


def test_multibyte_characters_wait_for_their_last_token(tiny_tokenizer):
    """Byte-level tokens of one character give no text until the character is complete, so a
    character whose tokens come from two attempts still decodes whole: one stream serves all."""
    prompt = tiny_tokenizer.encode("x")
    ids = tiny_tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) > 2  # the tiny vocabulary has no CJK merges: one token per byte
    stream = DecodeTextStream(tiny_tokenizer, prompt)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == "日本"
    assert "" in pieces


def _with_stripping_decoder(tokenizer):
    """The tiny tokenizer with a decoder that strips the text's first space, as Llama 2's,
    Mistral's and TinyLlama's decoders end (``Strip(" ", 1, 0)``)."""
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer._tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("decoder", ["byte-level", "stripping"])
def test_stream_primed_with_a_prompt_suffix_decodes_as_one_primed_with_the_whole_prompt(tiny_tokenizer, decoder):
    """The stream is primed with a short suffix of the prompt (priming_ids); for any prompt and
    output, even random byte-level ids with characters split across tokens, or a prompt that ends
    in special tokens (which the suffix skips), it yields the same pieces as a stream primed with
    every prompt token, as vLLM's engine primes it."""
    import random

    from tokenizers.decoders import DecodeStream

    from serve_app.router.text import PRIMING_MAX_TOKENS, priming_ids

    tokenizer = tiny_tokenizer if decoder == "byte-level" else _with_stripping_decoder(tiny_tokenizer)
    backend = tokenizer._tokenizer
    vocab = backend.get_vocab_size()
    special = sorted(backend.get_added_tokens_decoder())
    words = tokenizer.encode(" the river ran past the mill", add_special_tokens=False)
    rng = random.Random(0)
    primed_short = 0
    for case in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        output = [rng.randrange(vocab) for _ in range(40)]
        if case % 3 == 0:  # text, then a run of special tokens at the prompt's end; text out
            prompt = [*words, *(rng.choice(special) for _ in range(rng.randrange(1, 30)))]
            output = words
        whole = DecodeStream(ids=list(prompt), skip_special_tokens=True)
        expected = [whole.step(backend, t) or "" for t in output]
        stream = DecodeTextStream(tokenizer, prompt)
        assert [stream.push(t) for t in output] == expected, prompt
        primed_short += len(priming_ids(backend, prompt)) <= PRIMING_MAX_TOKENS < len(prompt)
    assert primed_short > 50  # the suffix path was taken, not only the whole prompt


def test_prompt_encoder_gives_the_tokenizers_own_ids(tiny_tokenizer):
    """The Rust fast path gives exactly what ``tokenizer.encode`` gives, with and without special
    tokens, for text that spells special tokens, odd spacing and multi-byte characters."""
    import random

    from serve_app.router.text import PromptEncoder

    encode = PromptEncoder(tiny_tokenizer)
    assert encode._backend is not None  # the fast path is the one under test
    pieces = ["<s>", "</s>", "<unk>", " ", "  ", "\n", "\t", "river", "Café", "naïve", "日本", "🙂", "a", "ab", ".", "'s", "123"]
    rng = random.Random(2)
    texts = ["", " ", "hello world", "<s>hello</s>"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60))) for _ in range(300)]
    for text in texts:
        for special in (True, False):
            assert encode(text, special) == tiny_tokenizer.encode(text, add_special_tokens=special), (text, special)


def test_prompt_encoder_falls_back_to_encode_without_a_rust_tokenizer():
    from serve_app.router.text import PromptEncoder

    class SlowTokenizer:
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    encode = PromptEncoder(SlowTokenizer())
    assert encode("ab") == [1, 97, 98] and encode("ab", False) == [97, 98]


def test_priming_ids_starts_on_a_character_boundary(tiny_tokenizer):
    from serve_app.router.text import PRIMING_MAX_TOKENS, PRIMING_MIN_TOKENS, priming_ids

    backend = tiny_tokenizer._tokenizer
    # One token per byte for CJK in the tiny vocabulary: a 4-token suffix would start inside 日.
    prompt = tiny_tokenizer.encode("a long enough prompt about the river 日本", add_special_tokens=False)
    suffix = priming_ids(backend, prompt)
    assert PRIMING_MIN_TOKENS < len(suffix) <= PRIMING_MAX_TOKENS and suffix == prompt[-len(suffix) :]
    assert backend.decode(suffix).endswith("日本") and "\ufffd" not in backend.decode(suffix)
    assert "\ufffd" in backend.decode(prompt[-len(suffix) + 1 :])  # one token shorter starts mid-character
    assert priming_ids(backend, prompt[:3]) == prompt[:3]  # shorter than the minimum: all of it


def test_a_tokens_logprob_text_is_the_installed_vllms():
    """A SentencePiece (Metaspace) vocabulary: HF's decode of "▁river" alone drops its space;
    logprobs name tokens as the installed vLLM's engine does (vLLM 0.32 puts the space back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm.tokenizers import detokenizer_utils

    vocab = {"<unk>": 0, "▁the": 1, "▁river": 2, "s": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tokenizer.decode([2]) == "river"
    want = " river" if hasattr(detokenizer_utils, "get_leading_space_marker") else "river"
    assert [token_piece(tokenizer, i) for i in (2, 3)] == [want, "s"]


def _vllms_fast_detokenizer(tokenizer, prompt: list[int], skip: bool, spaces: bool):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces, detokenize=True)
    request = EngineCoreRequest("r", list(prompt), None, params, None, 0.0, None, None, None)
    return FastIncrementalDetokenizer(tokenizer, request)


def _with_wordpiece_decoder(tokenizer):
    """The tiny tokenizer with a decoder that spaces tokens apart (BERT's WordPiece): its own
    ByteLevel decoder writes added tokens without spaces, so the option would change nothing."""
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer._tokenizer.to_str())
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("decoder", ["byte-level", "wordpiece", "stripping"])
def test_text_is_vllms_engines_with_special_tokens_skipped_or_shown_spaced_or_not(tiny_tokenizer, decoder):
    """Each piece is what vLLM's engine's own fast detokenizer gives for the same prompt and
    output, with special tokens skipped or shown, and with ``spaces_between_special_tokens: false``:
    added tokens that follow one another written bare, without the space a decoder like
    WordPiece's puts between them."""
    import random

    make = {"byte-level": lambda t: t, "wordpiece": _with_wordpiece_decoder, "stripping": _with_stripping_decoder}[decoder]
    tokenizer = make(tiny_tokenizer)
    added = sorted(tokenizer._tokenizer.get_added_tokens_decoder())
    assert len(added) > 2
    text_ids = tokenizer.encode(" the river ran past the mill", add_special_tokens=False)
    rng = random.Random(1)
    differs = 0
    for _ in range(100):
        prompt = [rng.choice(added + text_ids) for _ in range(rng.randrange(1, 12))]
        output = [rng.choice(added) if rng.random() < 0.6 else rng.choice(text_ids) for _ in range(30)]
        pieces = {}
        for skip in (False, True):
            for spaces in (False, True):
                reference = _vllms_fast_detokenizer(tokenizer, prompt, skip=skip, spaces=spaces)
                expected = [reference.decode_next(t) for t in output]
                stream = DecodeTextStream(tokenizer, prompt, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                assert [stream.push(t) for t in output] == expected, (prompt, output, skip, spaces)
                pieces[skip, spaces] = "".join(expected)
        differs += pieces[False, False] != pieces[False, True]
    # Where the decoder spaces tokens, the option changes the text (so the comparison above tells
    # the two apart); where it does not, it changes nothing, as on vLLM's engine.
    assert differs > 50 if decoder == "wordpiece" else differs == 0


@pytest.mark.parametrize("stream", [False, True])
def test_spaces_between_special_tokens_over_http(tiny_tokenizer, stream):
    """A request's ``spaces_between_special_tokens`` reaches its text: with the mock engine
    made to write added tokens only, and a tokenizer whose decoder spaces tokens apart, the reply
    is the tokens' bare contents run together where the client turns the spaces off, and vLLM's
    engine's text for the same tokens either way."""
    import json
    from unittest import mock

    from serve_app.engines import mock_runner
    from tests.support.inprocess import run_http

    tokenizer = _with_wordpiece_decoder(tiny_tokenizer)
    added = sorted(tokenizer._tokenizer.get_added_tokens_decoder())[3:]  # not <unk>, <s>, </s>: no stop
    prompt = [11, 12, 13]

    async def body(app, client) -> None:
        for spaces in (True, False):
            request = {"prompt": prompt, "max_tokens": 6, "stream": stream, "return_token_ids": True}
            response = await client.post(
                "/v1/completions", json={**request, "skip_special_tokens": False, "spaces_between_special_tokens": spaces}
            )
            assert response.status_code == 200, response.text
            if stream:
                chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or ()]
            else:
                choice = response.json()["choices"][0]
                text, ids = choice["text"], choice["token_ids"]
            assert len(ids) == 6 and set(ids) <= set(added)
            reference = _vllms_fast_detokenizer(tokenizer, prompt, skip=False, spaces=spaces)
            assert text == "".join(reference.decode_next(t) for t in ids)
            # Bare contents after the first token (which keeps the decoder's space after the prompt), or spaced.
            contents = tokenizer.convert_ids_to_tokens(ids)
            assert text == (" " + "".join(contents) if not spaces else "".join(" " + c for c in contents))

    with mock.patch.object(mock_runner, "_next", lambda last, before, length: added[length % len(added)]):
        run_http(body, tokenizer)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_release_text_as_vllms_detokenizer_does(tiny_tokenizer, include):
    """Token by token, the text released and the stop string found are vLLM's detokenizer's, for
    stop strings cut from the output itself (so they span tokens, begin inside one, or are
    prefixes of one another): where the stop string is left out of the output, text that a stop
    string may still begin in waits; where it is kept, every token's text goes out at once."""
    import random

    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from serve_app.router.text import StopMatcher
    words = tiny_tokenizer.encode(" the river ran past the old mill; café, naïve — 日本 ok", add_special_tokens=False)
    rng = random.Random(2)
    matched = held = 0
    for _ in range(300):
        prompt = [rng.choice(words) for _ in range(5)]
        output = [rng.choice(words) for _ in range(rng.randrange(1, 30))]
        text = tiny_tokenizer.decode(output)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 8)] if rng.random() < 0.8 else "zzz")
        min_tokens = rng.randrange(0, 3)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, detokenize=True)
        reference = FastIncrementalDetokenizer(tiny_tokenizer, EngineCoreRequest("r", prompt, None, params, None, 0.0, None, None, None))
        stream, matcher = DecodeTextStream(tiny_tokenizer, prompt), StopMatcher(stops, include)
        expected, got, decoded = [], [], ""
        was_held = False
        for n, token in enumerate(output, 1):
            stop = reference.update([token], False)
            expected.append(reference.get_next_output_text(finished=stop is not None, delta=True))
            piece = stream.push(token)
            decoded += piece
            got.append(matcher.feed(piece, can_stop=n > min_tokens))
            assert matcher.matched == stop, (stops, output)
            if stop is not None:
                matched += 1
                break
            was_held |= len("".join(got)) < len(decoded)
        else:
            expected.append(reference.get_next_output_text(finished=True, delta=True))
            got.append(matcher.flush())
        assert got == expected, (stops, include, output)
        held += was_held
    assert matched > 100  # the stops were found, not only run past
    # Text waited only where the stop string is left out of the output.
    assert held > 30 if not include else held == 0


def test_a_chat_streams_last_chunk_after_a_stop_token_says_no_content_as_vllms(tiny_tokenizer):
    """A chat stream that ends on a stop token (whose text is left out) ends with a chunk whose
    delta is ``{"content": ""}``, as vLLM's server writes it (its DeltaMessage of the step's empty
    text), with the finish and stop reasons."""
    import json
    from unittest import mock

    from serve_app.engines import mock_runner
    from serve_app.runtime.compat import DeltaMessage
    from tests.support.inprocess import run_http

    words = tiny_tokenizer.encode(" the river ran past", add_special_tokens=False)
    stop_id = words[2]

    async def body(app, client) -> None:
        request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, "stop_token_ids": [stop_id]}
        response = await client.post("/v1/chat/completions", json=request)
        assert response.status_code == 200, response.text
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        last = chunks[-1]["choices"][0]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop_id
        # vLLM's DeltaMessage of the step's empty text ({"content": ""}; on vLLM 0.23 with an empty tool_calls beside it).
        assert last["delta"]["content"] == "" and not last["delta"].get("tool_calls")
        assert DeltaMessage(content="").model_dump(mode="json", exclude_unset=True)["content"] == ""
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)  # the text before the stop token

    with mock.patch.object(mock_runner, "_next", lambda last, before, length: words[length % len(words)]):
        run_http(body, tiny_tokenizer)
