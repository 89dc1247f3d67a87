"""Hypothesis strategies for OpenAI request bodies, shared by the fuzz tests on real engines
(tests/integration/serve_yaml/test_fuzz.py) and on the in-process app (tests/unit/test_fuzz_fast.py).

Each field is drawn from sensible, borderline and hostile values: wrong types, numbers out of
range and past what any encoding carries, lone surrogates, nested junk, token ids outside the
vocabulary, client chat templates, fields pd-serve refuses; plus raw bodies that are not JSON,
JSON nested past any parser's recursion limit, and bodies just over the router's size limit.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Strings with lone surrogates: JSON carries them as \\ud800-style escapes, Python decodes them,
# and no tokenizer, log line or response encoder takes them.
surrogate_text = st.tuples(st.text(max_size=4), st.sampled_from(["\ud800", "\udfff", "\udc00\ud800"]), st.text(max_size=4)).map("".join)
# Integers past what msgpack (the engines' encoding) and int64 carry, and far past.
huge_ints = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.integers(min_value=-(2**64) - 2, max_value=-(2**63) + 2),
    st.integers(),  # unbounded
    st.integers(min_value=2**100, max_value=2**200),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    surrogate_text,
)
# Keys too may be lone surrogates (a logit_bias, vllm_xargs or chat_template_kwargs key).
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.one_of(st.text(max_size=6), surrogate_text), inner, max_size=4),
    max_leaves=6,
)


def keyed(keys: list[str], values: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of one or two of these keys, each with a drawn value (``fixed_dictionaries`` takes
    fixed keys: a strategy given as a key ends up as the key itself, which no JSON encoder takes)."""
    return st.dictionaries(st.sampled_from(keys), values, min_size=1, max_size=2)


token_ids = st.lists(st.one_of(st.integers(min_value=-3, max_value=1100), huge_ints), max_size=16)
small_float = st.floats(min_value=-2, max_value=3, allow_nan=False)
penalty = st.floats(min_value=-3, max_value=3, allow_nan=False)

# Each field with values of the right type, in range and just out of it (a token id outside the
# vocabulary, a negative temperature): what a real, careless client sends.
PLAUSIBLE: dict[str, Any] = {
    "model": st.sampled_from(["tiny-llama", "gpt-4", ""]),
    "temperature": small_float,
    "top_p": st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
    "top_k": st.one_of(st.integers(min_value=-3, max_value=2000), huge_ints),
    "min_p": small_float,
    "seed": st.integers(min_value=-(2**64), max_value=2**64),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": token_ids,
    "n": st.integers(min_value=-1, max_value=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": penalty,
    "frequency_penalty": penalty,
    "repetition_penalty": st.floats(min_value=-1, max_value=3, allow_nan=False),
    "min_tokens": st.integers(min_value=-2, max_value=30),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 1100), huge_ints).map(str), st.floats(-200, 200, allow_nan=False), max_size=3),
    "allowed_token_ids": token_ids,
    "bad_words": st.lists(st.text(max_size=6), max_size=3),
    "truncate_prompt_tokens": st.one_of(st.integers(min_value=1, max_value=40), st.integers(min_value=-2, max_value=3000)),
    "return_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "user": st.text(max_size=8),
    "vllm_xargs": st.one_of(
        st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.integers(), st.text(max_size=4)), max_size=2),
        st.dictionaries(st.text(max_size=6), st.one_of(huge_ints, surrogate_text, junk), max_size=2),
    ),
    # vLLM's nested parameters: small, valid shapes (so the engines run them) and each of their
    # keys with junk.
    "structured_outputs": st.one_of(
        st.sampled_from(
            [
                {"choice": ["yes", "no"]},
                {"regex": "[ab]{1,3}"},
                {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                {"json_object": True},
                {"grammar": 'root ::= "a" | "b"'},
            ]
        ),
        keyed(["json", "regex", "choice", "grammar", "json_object", "structural_tag", "whitespace_pattern", "_backend"], junk),
    ),
    "response_format": st.one_of(
        st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
                {"type": "structural_tag", "format": {"type": "any_text"}},
            ]
        ),
        st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "structural_tag", "x"]), "json_schema": junk}),
    ),
    "priority": st.one_of(st.integers(min_value=-3, max_value=3), huge_ints),
    "cache_salt": st.one_of(st.text(max_size=8), surrogate_text),
    "request_id": st.one_of(st.text(max_size=8), surrogate_text, st.just("cmpl-x\nWARNING forged")),
    "add_special_tokens": st.booleans(),
    "truncation_side": st.sampled_from(["left", "right", "middle"]),
    "logprob_token_ids": token_ids,
    "return_tokens_as_token_ids": st.booleans(),
    "thinking_token_budget": st.one_of(st.integers(min_value=-2, max_value=8), huge_ints),
    "use_beam_search": st.booleans(),
    "length_penalty": penalty,
    "stream_interval": st.integers(min_value=-1, max_value=4),
    "repetition_detection": st.dictionaries(st.text(max_size=8), junk, min_size=1, max_size=2),
}
COMPLETIONS_ONLY: dict[str, Any] = {
    "logprobs": st.integers(min_value=-2, max_value=30),
    "echo": st.booleans(),
    "suffix": st.text(max_size=5),
    "best_of": st.integers(min_value=-1, max_value=3),
    "prompt_logprobs": st.integers(min_value=-1, max_value=3),
    "max_tokens": st.integers(min_value=-2, max_value=24),
}
CHAT_ONLY: dict[str, Any] = {
    "max_completion_tokens": st.integers(min_value=-2, max_value=24),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=-2, max_value=30),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.one_of(
        st.dictionaries(st.text(max_size=5), scalars, max_size=2),
        # A client's own template, and apply_chat_template's own arguments: always refused here.
        st.fixed_dictionaries({"chat_template": st.sampled_from(["{{ 'x' * 100000000 }}", "{% for i in range(10**9) %}{% endfor %}"])}),
        keyed(["tokenize", "return_dict", "tokenizer_kwargs"], junk),
        st.fixed_dictionaries({"nested": junk}),
    ),
    "chat_template": st.sampled_from(["{{ messages }}", "{% for i in range(10**9) %}{% endfor %}"]),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
    "reasoning_effort": st.sampled_from(["low", "medium", "high", "x"]),
    "include_reasoning": st.booleans(),
    "documents": st.lists(st.dictionaries(st.sampled_from(["title", "text"]), st.text(max_size=8), max_size=2), max_size=2),
    "mm_processor_kwargs": st.dictionaries(st.text(max_size=6), junk, max_size=2),
    "media_io_kwargs": st.dictionaries(st.text(max_size=6), junk, max_size=2),
}
# Fields a client may not set at all: always refused.
REFUSED: dict[str, Any] = {
    "kv_transfer_params": st.just({"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/x"}),
    "ec_transfer_params": st.just({"x": 1}),
    "vllm_xargs": st.sampled_from([{"kv_transfer_params": "x"}, {"ec_transfer_params": "x"}]),
}

valid_ids = st.lists(st.integers(min_value=0, max_value=1023), min_size=1, max_size=40)
prompts = st.one_of(
    st.text(min_size=1, max_size=60),
    st.text(min_size=1, max_size=60),
    surrogate_text,
    valid_ids,
    valid_ids,
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=1),
    st.text(max_size=60),
    token_ids,
    st.lists(st.text(max_size=10), max_size=3),
    st.lists(token_ids, max_size=2),
)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": st.text(max_size=40)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": surrogate_text}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2
            ),
        }
    ),
)
messages = st.lists(message, max_size=3)


def some_of(fields: dict[str, Any], most: int) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with up to ``most`` of these fields."""
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks}))


def every_field(route: str) -> set[str]:
    """Every field vLLM's request model of ``route`` knows: a fuzzed request may carry any."""
    if route == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model  # type: ignore[assignment]
    return set(Model.model_fields)


def bodies(main: str, main_values: Any, route_fields: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible requests (the main field, a small max_tokens, a few other fields), then a
    plausible request with one field of junk (any field vLLM's model knows, not only the plausible
    ones) or one refused field, then junk altogether."""
    route = "chat" if main == "messages" else "completions"
    fields = {**PLAUSIBLE, **route_fields}
    fields.update({name: junk for name in every_field(route) - fields.keys() - {main}})
    base = st.fixed_dictionaries({main: main_values, "max_tokens": st.integers(min_value=1, max_value=16)})
    plausible = st.tuples(base, some_of(fields, 4)).map(lambda t: {**t[0], **t[1]})
    one_junk = st.tuples(plausible, st.sampled_from(sorted({*fields, main})), junk).map(lambda t: {**t[0], t[1]: t[2]})
    refused = st.tuples(plausible, some_of(REFUSED, 1)).map(lambda t: {**t[0], **t[1]})
    kinds = {"plausible": plausible, "one_junk": one_junk, "refused": refused, "junk": junk}
    return st.sampled_from(["plausible"] * 6 + ["one_junk", "one_junk", "refused", "junk"]).flatmap(kinds.__getitem__)


# Raw bodies: what a JSON encoder would never produce.
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"[" * 100_000,
            b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
            b'{"prompt": "unterminated',
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b"\xff\xfe\x00",
            b"null",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b"}",
        ]
    ),
)


# What the router may answer a request it will not serve: a bad request (400), an unknown model
# (404), a body over its limit (413). Anything else (a 5xx above all, but also a 422 or a 408
# for a body that was sent whole) means a request reached code that did not expect it.
CLIENT_ERRORS = frozenset({400, 404, 413})


def oversized(limit: int) -> bytes:
    """A valid request just over ``limit`` bytes (JSON whitespace pads it)."""
    body = json.dumps({"prompt": "The river", "max_tokens": 2})
    return (body[:-1] + " " * (limit + 1 - len(body)) + "}").encode()
