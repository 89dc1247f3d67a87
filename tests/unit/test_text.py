from __future__ import annotations

from serve_app.router.text import DecodeTextStream, StopMatcher


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
    m = StopMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert feed_all(m, ["hello world"]) == "hello w"
    assert m.matched == "lo w"


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
