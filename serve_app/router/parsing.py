"""OpenAI request parsing: validation and prompt building (the chat template and tokenization,
once).

Requests are parsed with vLLM's own OpenAI protocol models (``CompletionRequest``,
``ChatCompletionRequest``) and turned into vLLM ``SamplingParams`` by their own
``to_sampling_params``, so the accepted fields, defaults and checks are vLLM's. On top of those,
this module rejects what pd-serve does not support (with a 400 naming the field, rather than
silently ignoring it) and checks lengths against the model, so that every bad request is refused
before any engine is touched.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.router.errors import OpenAIError, bad_request
from serve_app.router.output_parsers import ReasoningSplit
from serve_app.router.text import PromptEncoder
from serve_app.router.tools import (
    ForcedCall,
    ParsedCalls,
    RequiredCalls,
    ToolChoice,
    new_call_id,
    template_tool_calls,
    template_tools,
    tool_choice_of,
)
from serve_app.runtime.private_symbols import unchanged
from serve_app.wire.protocol import RequestTags
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS

logger = logging.getLogger("pd_serve.router")

Route = Literal["completions", "chat"]

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# An echo's prompt logprobs, as entries (a token's logprob and each alternative's), per request:
# each is a JSON member the router frames on its event loop (about a microsecond), and a prompt's
# travel in one frame from its engine (wire/frames.py's bound is 64 MiB: 4M entries).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20
# The longest pattern vLLM's repetition_detection may look for (``_check_repetition_bound``).
MAX_REPETITION_PATTERN = 256

# Engine extra arguments pd-serve sets itself: a client may not set them, at the top level of
# the request or through ``vllm_xargs`` (vLLM copies both into the engine's extra_args), since
# they would steer an engine's KV transfer (where to post block ids, where to push KV) or tell a
# decode engine that part of the prompt is earlier output (its penalties would count it).
RESERVED_EXTRA_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params", RESUMED_OUTPUT_TOKENS})

# apply_chat_template's own arguments, and render_jinja_template's it passes its kwargs to
# (transformers 5): passed through chat_template_kwargs they would change what the router renders
# (tokenize=True returns ids, a chat_template replaces the server's), so only template variables
# may come that way.
TEMPLATE_CALL_ARGS = frozenset(
    {
        "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
        "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but router.trust_request_chat_template is not set. "
    "Refused request with untrusted chat template."
)
# How long a client's own chat template (router.trust_request_chat_template) may run: a server's
# template renders a conversation in milliseconds, and a client's runs in a worker thread, where
# nothing else would ever stop one that loops without end.
CLIENT_TEMPLATE_TIMEOUT_S = 2.0
# A client's name for its request (X-Request-Id, request_id): the characters of the KV side
# channel's transfer ids (kv/wire.py), which engine request ids become.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")
MAX_NESTING = 64  # deeper than any OpenAI request; a bound so checks never recurse unboundedly
STRUCTURAL_TAG_WRAPPERS = 16  # the levels vLLM allows a structural tag beyond a schema's
# Numbers the engines' msgpack encoding carries (vLLM's own engine protocol has the same range).
INT_RANGE = (-(2**63), 2**64 - 1)
# vLLM 0.32's header for a request's priority, which a gateway in front sets; it comes before the
# body's ``priority``. A request's priority is a signed 64-bit number in the engines' protocol.
PRIORITY_HEADER = "x-vllm-priority"
PRIORITY_TEXT = re.compile(r"[+-]?[0-9]{1,19}")
PRIORITY_RANGE = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ClientHeaders:
    """What a request's HTTP headers say about it, besides its API key (the handle API has none)."""

    request_id: str | None = None  # X-Request-Id
    priorities: tuple[str, ...] = ()  # every X-Vllm-Priority sent

    @classmethod
    def of(cls, headers: Any) -> ClientHeaders:
        """From Starlette's headers, which keep every value of a repeated header."""
        return cls(headers.get("x-request-id"), tuple(headers.getlist(PRIORITY_HEADER)))


@dataclass
class ModelContext:
    """What validation needs to know about the served model."""

    name: str
    aliases: frozenset[str]
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    trust_request_chat_template: bool = False
    # The engines order their queues by each request's priority (vLLM's scheduling_policy).
    priority_scheduling: bool = False
    client_template_timeout_s: float = CLIENT_TEMPLATE_TIMEOUT_S
    # The model's sampling defaults for what a request leaves out (router/sampling_defaults.py).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None  # a bound on every request's max_tokens (the same module)
    max_choices: int = 128  # router.max_choices: the most choices (n times the prompts) per request
    # A max_tokens past what the prompt leaves of the context is cut down (vLLM 0.32's server), or
    # refused (0.23's): as the installed vLLM's server does.
    clamps_max_tokens: bool = field(default_factory=lambda: _installed_vllm_clamps())
    # vLLM's parsers of the replies (router/output_parsers.py): the tool-call parser "auto" needs,
    # and the reasoning parser of a reasoning model (the decode engines' reasoning_parser).
    tool_parser: Any = None
    reasoning_parser: Any = None
    # The tokenizer they read, cached as vLLM caches its own (parsers read the vocabulary and the
    # special tokens at every construction: one or two per request); None: ``tokenizer``.
    parser_tokenizer: Any = None
    encode: PromptEncoder = field(init=False, repr=False)
    # Longer text cannot fit max_model_len tokens whatever it says (no token spells more
    # characters than the vocabulary's longest): refused before the tokenizer spends time on it.
    max_prompt_chars: int = field(init=False)
    max_body_bytes: int = 4 * 1024 * 1024  # router.http.max_body_bytes
    # A rendered chat prompt to truncate (or to count, /tokenize) may be longer than the context,
    # but not longer than that plus a whole body: a client's template renders no further.
    max_render_chars: int = field(init=False)

    def __post_init__(self) -> None:
        self.encode = PromptEncoder(self.tokenizer)
        self.parser_tokenizer = self.parser_tokenizer or self.tokenizer
        self.max_prompt_chars = self.max_model_len * _longest_token_chars(self.tokenizer)
        self.max_render_chars = self.max_prompt_chars + self.max_body_bytes

    def accepts(self, model: str | None) -> bool:
        return not model or model == self.name or model in self.aliases  # none or "": any (as vLLM's server)


@dataclass
class ParsedRequest:
    route: Route
    response_id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    # Template for every attempt's engine request: stop strings removed (the router matches
    # them), DELTA output; max_tokens is set per attempt.
    sampling_params: Any
    max_tokens: int
    stream: bool
    include_usage: bool
    stops: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    min_tokens: int
    logprobs: int | None  # top-k per token; None when not requested
    return_token_ids: bool  # the prompt's ids, and the output's unless hidden
    # ``include_reasoning: false`` hides the output's token ids and logprobs (as vLLM's server
    # does); the prompt's ids still come.
    hide_output_ids: bool = False
    # What every engine request of every attempt carries: vLLM's cache_salt (validated by its
    # protocol: a non-empty string; the router's prefix keys start from it too), its priority
    # (lower is served earlier; 0 unless the engines schedule by priority: ``_priority``), and a
    # reasoning model's state for the decode engine (``_reasoning_tags``).
    tags: RequestTags = field(default_factory=RequestTags)
    # A chat request's tool_choice that makes the output tool calls (router/tools.py).
    tool_choice: ToolChoice | None = None
    # A reasoning model's chat reply: the thinking is split from it (router/output_parsers.py).
    reasoning: ReasoningSplit | None = None
    # Several choices in one response (``n``, several prompts): this one's index (the prompt's
    # position times n, plus the sample's), n, and the response's other choices, each parsed as
    # this one (its own prompt, max_tokens and seed).
    index: int = 0
    n: int = 1
    count: int = 1  # the response's choices
    others: tuple[ParsedRequest, ...] = ()
    # ``echo``: the text the reply starts with, as on vLLM's server: a completion's prompt ("" with
    # return_token_ids, which carry it), a chat request's last message where its role is the
    # reply's; None without echo. A completion's echo with logprobs asks the engine for the
    # prompt's logprobs too (``sampling_params.prompt_logprobs``).
    echo: str | None = None
    echo_only: bool = False  # a completion's echo with max_tokens 0: the prompt alone (as vLLM's server)
    # A chat request's ``return_prompt_text``: the conversation as the template rendered it, which
    # the reply carries (each choice's first chunk of a stream); None where not asked for.
    prompt_text: str | None = None
    # A chat reply's role: the last message's where the prompt ends without the generation prompt
    # (add_generation_prompt: false, the model continuing that message), as vLLM's server.
    reply_role: str = "assistant"
    # vLLM's ``prompt_logprobs`` field of the reply (each prompt token's logprob, rank and text,
    # with the top k): k, or None where the reply has no such field.
    prompt_logprobs: int | None = None
    # The prompt logprob entries this choice sends (tokens times k + 1, for an echo's logprobs and
    # for the field): what its framing costs beyond the output's (router/session.py frames a large
    # one off the event loop).
    prompt_logprob_entries: int = 0
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage in every chunk
    # What the engine requests are named from: the response id, and where the client named the
    # request (``X-Request-Id``, ``request_id``) a random suffix too, since clients' ids need not
    # be unique and two engine requests of one name would be one.
    engine_id_base: str = ""

    def __post_init__(self) -> None:
        self.engine_id_base = self.engine_id_base or self.response_id

    @property
    def returns_output_ids(self) -> bool:
        """Whether the reply carries the output's token ids."""
        return self.return_token_ids and not self.hide_output_ids

    @property
    def choices(self) -> tuple[ParsedRequest, ...]:
        """Every choice of the response, in index order (this one is the first)."""
        return (self, *self.others)

    @property
    def engine_request_id(self) -> str:
        """The id this choice's attempts are named by on the engines (unique per choice)."""
        return self.engine_id_base if self.count == 1 else f"{self.engine_id_base}-{self.index}"


def _longest_token_chars(tokenizer: Any) -> int:
    try:
        return max(8, max(len(token) for token in tokenizer.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary listing: a generous bound
        return 64


def decode_json(raw: bytes) -> Any:
    """The body of an HTTP request: UTF-8 JSON (RFC 8259), decoded strictly first. ``json.loads``
    of bytes would let lone surrogates through as raw bytes (it decodes with ``surrogatepass``)
    and take UTF-16 and UTF-32 bodies too; decoded here, lone surrogates can only come from
    ``\\uD8xx``-style escapes, so only bodies with such an escape are walked."""
    try:
        text = raw.decode("utf-8-sig")  # strict: refuses encoded surrogates; a BOM is dropped
    except UnicodeDecodeError as exc:
        raise bad_request(f"Request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text)
        if _SURROGATE_ESCAPE.search(text):
            check_strings(body)
        return body
    except RecursionError:
        raise bad_request("Request body is nested too deeply") from None
    except ValueError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_strings(body: Any) -> int | None:
    """Every string must be valid Unicode (JSON's ``\\ud800`` decodes to a lone surrogate, which
    no tokenizer, log line or response encoder takes) and nesting bounded; a 400 naming where.
    For bodies that did not come through ``decode_json`` (the handle API): msgspec's encoder
    checks the whole body in C (microseconds for a long prompt's token ids); only a body it
    refuses is walked in Python, to name the field or to find it fine after all.

    Returns the body's size as JSON (what it would weigh over HTTP, so the handle API can parse
    a large one off the event loop as the HTTP API does), or None where msgspec could not say."""
    import msgspec

    try:
        return len(msgspec.json.encode(body))
    except (UnicodeEncodeError, RecursionError, TypeError, OverflowError, msgspec.EncodeError):
        pass
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_NESTING:
            raise bad_request(f"Request body is nested more deeply than {MAX_NESTING} levels", param=where or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("A string is not valid Unicode (a lone surrogate)", param=where or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, where, depth + 1))
                stack.append((item, f"{where}.{key}" if where else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{i}" if where else str(i), depth + 1) for i, item in enumerate(value))
    return None


def route_of(body: Any) -> Route:
    """For the handle API, which has no URL: a request with ``messages`` is a chat request."""
    return "chat" if isinstance(body, dict) and "messages" in body else "completions"


def parse_request(route: Route, body: Any, ctx: ModelContext, headers: ClientHeaders | None = None) -> ParsedRequest:
    """``headers``: the HTTP request's ``X-Request-Id``, which names the response, and
    ``X-Vllm-Priority`` (each, as on vLLM's server, before the body's field)."""
    headers = headers or ClientHeaders()
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _refuse_reserved(body)
    if route == "chat":
        if "messages" not in body:
            raise bad_request("'messages' is a required property", param="messages")
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    elif "prompt" not in body:
        raise bad_request("'prompt' is a required property", param="prompt")

    model = checked_model(body, ctx)
    request = _validate(route, body)
    _reject_unsupported(route, request, ctx)
    priority = _priority(headers.priorities, request, ctx)
    parser_kwargs = template_kwargs(request) if route == "chat" else {}
    tool_choice = tool_choice_of(request, ctx.tool_parser, ctx.parser_tokenizer, parser_kwargs) if route == "chat" else None
    if tool_choice is not None and (not isinstance(tool_choice, ParsedCalls) or tool_choice.forced):
        # ("text" constrains nothing: vLLM's server takes it, which some clients always send.)
        formats = request.response_format is not None and getattr(request.response_format, "type", None) != "text"
        if request.structured_outputs is not None or formats:
            param = "response_format" if formats else "structured_outputs"
            raise bad_request(f"This tool_choice constrains the reply to tool calls; {param} cannot be added", param=param)
    reasoning = None
    if route == "chat" and ctx.reasoning_parser is not None:
        include = bool(getattr(request, "include_reasoning", True))
        reasoning = ReasoningSplit(ctx.reasoning_parser, request, ctx.parser_tokenizer, parser_kwargs, include=include)
    parser = None  # the reply parser the request was adjusted for (vLLM's server reads the prompt with it too)
    if isinstance(tool_choice, ParsedCalls):
        parser = _adjust_for_parser(tool_choice.new_parser, request)
    elif reasoning is not None:
        parser = _adjust_for_parser(reasoning.new_parser, request)
    # Hidden reasoning: no token ids or logprobs either, which would spell it out (as vLLM's server).
    hide_tokens = reasoning is not None and not reasoning.include

    n = 1 if request.n is None else request.n
    if route == "chat":
        _check_choices(1, n, ctx)  # before the template runs
        rendered, prompt_ids = _chat_prompt(request, ctx)
        prompts = [prompt_ids]
        # vLLM's return_prompt_text: the rendered conversation, whole, however it is truncated.
        prompt_text = rendered if declared(request, "return_prompt_text") else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        prompts = _completion_prompts(request, ctx)
        prompt_text = None
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    echoes = _echoes(route, request, prompts, ctx)  # (the prompt as sent, however it is cut: as vLLM's server)
    if request.truncate_prompt_tokens is not None:
        cut = functools.partial(_truncated, keep=request.truncate_prompt_tokens, side=request.truncation_side, max_tokens=max_tokens)
        prompts = [cut(ids, param=max_tokens_param, ctx=ctx) for ids in prompts]
    prompt_logprobs, shown, param = _prompt_logprobs_of(route, request, logprobs, ctx)

    def logprob_entries(ids: list[int]) -> int:  # a choice's prompt logprobs, framed (ParsedRequest)
        echoed = len(ids) * (logprobs + 1) if route == "completions" and request.echo and logprobs is not None else 0
        return echoed + (0 if shown is None else len(ids) * (shown + 1))

    if prompt_logprobs is not None:
        entries = sum(map(logprob_entries, prompts)) * n
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise bad_request(
                f"{param} asks for {entries} logprobs of the prompts (their tokens times n times each top k + 1); "
                f"this server sends at most {MAX_PROMPT_LOGPROB_ENTRIES} per request",
                param=param,
            )
    # vLLM's echo of the prompt alone: the engine makes one token, which the response leaves out.
    echo_only = route == "completions" and bool(request.echo) and max_tokens == 0
    prompt_param = "messages" if route == "chat" else "prompt"
    samples = []  # each prompt's (token ids, sampling parameters)
    for prompt_token_ids in prompts:
        budget = 1 if echo_only else max_tokens
        if ctx.clamps_max_tokens and budget is not None:
            budget = _clamped(prompt_token_ids, budget, max_tokens_param, ctx)
        _check_lengths(prompt_token_ids, budget, max_tokens_param, prompt_param, ctx)
        params, stops = _sampling_params(request, prompt_token_ids, budget, logprobs, prompt_logprobs, tool_choice, hide_tokens, ctx)
        samples.append((prompt_token_ids, params))
    first_params = samples[0][1]
    prefix = "chatcmpl" if route == "chat" else "cmpl"
    client_id = _client_request_id(headers.request_id, request)
    response_id = f"{prefix}-{client_id or uuid.uuid4().hex}"
    stream_options = request.stream_options
    first = ParsedRequest(
        route=route,
        response_id=response_id,
        engine_id_base=f"{response_id}-{uuid.uuid4().hex[:12]}" if client_id else response_id,
        created=int(time.time()),
        model=model or ctx.name,
        prompt_token_ids=samples[0][0],
        sampling_params=first_params,
        max_tokens=first_params.max_tokens,
        stream=bool(request.stream),
        include_usage=bool(stream_options and stream_options.include_usage),
        stops=stops,
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=bool(request.skip_special_tokens),
        spaces_between_special_tokens=bool(request.spaces_between_special_tokens),
        min_tokens=int(request.min_tokens or 0),
        logprobs=None if hide_tokens else logprobs,
        return_token_ids=bool(request.return_token_ids),
        hide_output_ids=hide_tokens,
        tags=RequestTags(request.cache_salt, priority, **_reasoning_tags(reasoning, parser, parser_kwargs, samples[0][0])),
        tool_choice=tool_choice,
        reasoning=reasoning,
        n=n,
        count=len(samples) * n,
        echo=echoes[0],
        echo_only=echo_only,
        prompt_text=prompt_text,
        reply_role=_reply_role(request) if route == "chat" else "assistant",
        prompt_logprobs=shown,
        prompt_logprob_entries=logprob_entries(samples[0][0]),
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        continuous_usage=bool(stream_options and stream_options.include_usage and getattr(stream_options, "continuous_usage_stats", False)),
    )
    if n == 1 and len(samples) == 1:
        return first
    choices = [
        replace(
            first,
            index=p * n + i,
            prompt_token_ids=prompt_token_ids,
            sampling_params=_nth_sample(params, i),
            max_tokens=params.max_tokens,
            tool_choice=replace(tool_choice, call_id=new_call_id()) if isinstance(tool_choice, ForcedCall) else tool_choice,
            echo=echoes[p],
            prompt_logprob_entries=logprob_entries(prompt_token_ids),
        )
        for p, (prompt_token_ids, params) in enumerate(samples)
        for i in range(n)
    ]
    return replace(choices[0], others=tuple(choices[1:]))


def _sampling_params(
    request: Any,
    prompt_token_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    tool_choice: ToolChoice | None,
    hide_tokens: bool,
    ctx: ModelContext,
) -> tuple[Any, list[str]]:
    """One prompt's engine sampling parameters (max_tokens, where the request leaves it out, is
    what that prompt leaves room for), and apart the stop strings, which the router matches."""
    if max_tokens is None:  # the model's default, within the room the context leaves (as vLLM)
        room = ctx.max_model_len - len(prompt_token_ids)
        max_tokens = min(room, int(ctx.sampling_defaults.get("max_tokens") or room))
    if ctx.max_tokens_cap is not None:
        max_tokens = min(max_tokens, ctx.max_tokens_cap)
    try:
        params = request.to_sampling_params(max_tokens, dict(ctx.sampling_defaults))
    except _client_errors() as exc:
        raise bad_request(str(exc), param=_param_of(exc, type(request))) from None

    if isinstance(tool_choice, ForcedCall | RequiredCalls):
        from vllm.sampling_params import StructuredOutputsParams

        params.structured_outputs = StructuredOutputsParams(json=tool_choice.schema)
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    from vllm.sampling_params import RequestOutputKind

    params.stop = []
    if params.extra_args:  # already refused above; never let one through regardless
        params.extra_args = {k: v for k, v in params.extra_args.items() if k not in RESERVED_EXTRA_ARGS} or None
    params.output_kind = RequestOutputKind.DELTA
    params.detokenize = False
    params.logprobs = None if hide_tokens else logprobs
    params.prompt_logprobs = prompt_logprobs
    # vLLM skips the prefix cache for a request that wants its prompt's logprobs (set when the
    # parameters are built, from vLLM's chat echo's too): only where they are asked for.
    params.skip_reading_prefix_cache = prompt_logprobs is not None
    params.n = 1  # the router asks for each choice on its own
    _check_encodable(params)
    _check_vocabulary(params, ctx)
    _check_grammar_nesting(params)
    _check_repetition_bound(params)
    return params, stops


def _client_request_id(header_id: str | None, request: Any) -> str | None:
    """The id the client gave its request, if any: ``X-Request-Id``, else the body's
    ``request_id`` (vLLM's field; it makes one up where the client sends none). It names the
    response (``cmpl-<id>``) and its engine requests, so logs can be searched for it: at most
    128 characters of those the KV side channel carries in transfer ids (every UUID, base64
    and usual trace id is one), else a 400."""
    if header_id is not None:
        where, client_id = "X-Request-Id", header_id
    elif "request_id" in request.model_fields_set:
        where, client_id = "request_id", request.request_id
    else:
        return None
    if not isinstance(client_id, str) or not CLIENT_REQUEST_ID.fullmatch(client_id):
        raise bad_request(f"{where} must be 1 to 128 characters of A-Z, a-z, 0-9 and ._:@+=/-", param="request_id")
    return client_id


def _reasoning_tags(reasoning: ReasoningSplit | None, parser: Any, parser_kwargs: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """What vLLM's server tells a reasoning model's engine of a chat request (where the decode
    engines have a reasoning parser): the template's variables, which its parser reads (whether
    thinking is on, e.g.), and whether the thinking is over before the first output token: where
    the client hides it (``include_reasoning: false``), or the prompt ends it (thinking off in the
    template). Then a grammar holds from the first token, and a resumed attempt's goes on from the
    earlier output (vllm_plugins/resumed_grammar.py). Else None, where vLLM's server says False:
    the engine reads the prompt itself, which on a resumed attempt holds the earlier output, and
    with it the end of thinking the engine would otherwise never see."""
    if reasoning is None:  # (a chat request's, where the decode engines have a reasoning parser)
        return {}
    if _nesting_exceeds(parser_kwargs, MAX_NESTING):  # (where a number would not be looked for)
        raise bad_request(f"chat_template_kwargs nests deeper than {MAX_NESTING} levels", param="chat_template_kwargs")
    if _out_of_range(parser_kwargs):  # they travel to the engine in msgpack, as its numbers do
        raise bad_request(f"chat_template_kwargs holds a number outside {INT_RANGE[0]}..{INT_RANGE[1]}", param="chat_template_kwargs")
    over = not reasoning.include or bool(parser.is_reasoning_end(prompt))
    return {"reasoning_ended": True if over else None, "reasoning_parser_kwargs": {"chat_template_kwargs": dict(parser_kwargs)}}


def _priority(sent: tuple[str, ...], request: Any, ctx: ModelContext) -> int:
    """The request's priority: ``X-Vllm-Priority`` (a gateway's), else the body's ``priority``.

    With priority scheduling the header must be one integer: one the router cannot read, or a
    second beside a gateway's, must not leave a client's own value in charge (a 400). Where the
    engines serve first come, first served, a header that is not an integer is ignored, as vLLM's
    server ignores it (a gateway may send one to every backend), and a priority other than 0 is
    refused: vLLM's server would ignore it, and a client relying on it must hear that it is not
    there."""
    texts = [text.strip(" \t") for text in sent]
    numbers = [int(text) for text in texts if PRIORITY_TEXT.fullmatch(text)]
    if ctx.priority_scheduling and len(sent) > 1:
        raise bad_request("X-Vllm-Priority is given more than once", param="priority")
    if ctx.priority_scheduling and sent and not numbers:
        raise bad_request(f"X-Vllm-Priority must be an integer, got {sent[0][:32]!r}", param="priority")
    where, priority = "priority", request.priority
    if numbers:
        where, priority = "X-Vllm-Priority", next((n for n in numbers if n != 0), 0)
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise bad_request(f"{where} must be a signed 64-bit integer", param="priority")
    if priority != 0 and not ctx.priority_scheduling:
        raise bad_request(
            f"{where} {priority} is not supported by this server: its engines serve requests first come, first served",
            param="priority",
        )
    return priority


def _nth_sample(params: Any, i: int) -> Any:
    """The i-th of a prompt's n samples, as vLLM's engine makes them (its ParentRequest): the same
    parameters, with seed + i where the request is seeded, so that each is reproducible apart.
    Only the first asks for the prompt's logprobs (router/choices.py gives the others its own)."""
    if i == 0 or (params.seed is None and params.prompt_logprobs is None):
        return params
    sample = copy.copy(params)
    if params.seed is not None:
        sample.seed = params.seed + i
    if params.prompt_logprobs is not None:
        sample.prompt_logprobs, sample.skip_reading_prefix_cache = None, False
    return sample


def _adjust_for_parser(new_parser: Callable[[], Any], request: Any) -> Any:
    """What the model's reply parsers change in the request before its sampling parameters are
    built, as on vLLM's server: e.g. hermes keeps special tokens in the text (its call markers may
    be special tokens), and vLLM 0.32's tool parsers for formats xgrammar knows hold a call's
    arguments to the tool's schema once the model opens one (a structural tag, which the
    router's grammar bounds then check like a client's)."""
    try:
        parser = new_parser()
    except (*_client_errors(), ValueError) as exc:
        # Built with the client's template variables, which a parser may refuse (a reasoning
        # effort it does not know): the client's 400, as vLLM's server answers its ValueError.
        # Anything else a parser raises is the server's error.
        param = "reasoning_effort" if declared(request, "reasoning_effort") is not None else "chat_template_kwargs"
        raise bad_request(f"Invalid request for this model's reply parser: {exc}", param=param) from None
    try:
        parser.adjust_request(request)
    except (*_client_errors(), ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"Invalid request for this model's reply format: {exc}", param="tools" if request.tools else None) from None
    return parser


def _refuse_reserved(body: dict[str, Any]) -> None:
    for key in RESERVED_EXTRA_ARGS:
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is set by this server and may not be sent by clients", param=key)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for key in RESERVED_EXTRA_ARGS & xargs.keys():
            raise bad_request(f"vllm_xargs.{key} is set by this server and may not be sent by clients", param=f"vllm_xargs.{key}")


def checked_model(body: dict[str, Any], ctx: ModelContext) -> str | None:
    """The request's ``model``, which must name the served model or one of its aliases (a 404)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if not ctx.accepts(model):
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves '{ctx.name}'", param="model")
    return model


def _validate(route: Route, body: dict[str, Any]) -> Any:
    if route == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model  # type: ignore[assignment]
    return validated(Model, body)


def validated(model: Any, body: dict[str, Any]) -> Any:
    """``body`` as vLLM's protocol ``model``, whose errors become a 400 naming the parameter."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as exc:  # (a subclass of ValueError: caught first)
        errors = exc.errors()
        first = errors[0] if errors else {}
        # A model validator's error has no field location; vLLM's own validation error names
        # the parameter (on vLLM 0.23 it is a ValueError, so pydantic wraps it and keeps it here).
        cause = (first.get("ctx") or {}).get("error")
        param = _field_path(first.get("loc", ())) or (_param_of(cause, model) if cause is not None else None)
        message = "; ".join(_describe(err) for err in errors[:5]) or str(exc)
        raise bad_request(message, param=param) from None
    except _client_errors() as exc:
        raise bad_request(str(exc), param=_param_of(exc, model)) from None
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        # vLLM's "before" validators read the raw body assuming the right shapes (a list where
        # they expect a dict fails on .get): a body of the wrong shape, so the client's 400.
        misshapen = _misshapen_field(model, body)
        if misshapen is not None:
            raise bad_request(f"{misshapen[0]}: {misshapen[1]}", param=misshapen[0]) from None
        raise bad_request(f"Invalid request: {type(exc).__name__}: {exc}") from None


def _misshapen_field(model: Any, body: dict[str, Any]) -> tuple[str, str] | None:
    """(name, pydantic's complaint) of the first field in ``body`` its declared type refuses:
    vLLM's "before" validators read fields before pydantic checks their types, so a field of the
    wrong shape fails there, in a message naming no field."""
    from pydantic import ValidationError

    fields = getattr(model, "model_fields", {})
    for name, value in body.items():
        # (Only the model's own fields: a client's other keys must not evict the cached validators.)
        adapter = _field_adapter(model, name) if name in fields else None
        if adapter is None:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            errors = exc.errors()
            return name, (errors[0].get("msg", "invalid value") if errors else "invalid value")
        except Exception:  # a validator of the field's own that needs the whole body: not this one
            continue
    return None


@functools.lru_cache(maxsize=256)
def _field_adapter(model: Any, name: str) -> Any:
    """A validator for one of ``model``'s fields alone (built once: a bad body costs no rebuild)."""
    from pydantic import TypeAdapter

    field = getattr(model, "model_fields", {}).get(name)
    if field is None:
        return None
    try:
        return TypeAdapter(field.annotation)
    except Exception:  # an annotation pydantic cannot build alone (a forward reference)
        return None


def _installed_vllm_clamps() -> bool:
    from serve_app.runtime.compat import CLAMPS_MAX_TOKENS

    return CLAMPS_MAX_TOKENS


def _param_of(exc: BaseException, model: Any) -> str | None:
    """The request field a vLLM validation error is about: the one it names, else the field its
    message begins with ("min_tokens must be ...": vLLM names few), where ``model`` (the
    request's pydantic model) has such a field."""
    named = getattr(exc, "parameter", None)
    if named:
        return _REQUEST_FIELD.get(str(named), str(named))
    match = _LEADING_NAME.match(str(exc))
    return match.group(1) if match and match.group(1) in getattr(model, "model_fields", {}) else None


_LEADING_NAME = re.compile(r"\s*([a-z_][a-z0-9_]*)\b")
# SamplingParams' names for what the client sent under another: the engine's extra_args come
# from the request's vllm_xargs (and fields vLLM copies in).
_REQUEST_FIELD = {"extra_args": "vllm_xargs"}


def _client_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a bad request: its validators raise VLLMValidationError (not a
    ValueError on vLLM 0.32) straight through pydantic, and plain ValueErrors as pydantic errors."""
    from serve_app.runtime.compat import CLIENT_ERRORS

    return CLIENT_ERRORS


def _field_path(loc: Any) -> str:
    """A pydantic error's location as the client's field path: without the steps pydantic names
    after its own validators ("function-wrap[...]", "list[...]"), which are no field of the body."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _VALIDATOR_STEP.match(p)))


_VALIDATOR_STEP = re.compile(r"[a-z][a-z-]*\[.*\]\Z", re.S)


def _describe(err: dict[str, Any]) -> str:
    where = _field_path(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    return f"{where}: {msg}" if where else msg


def _check_encodable(params: Any) -> None:
    """Numbers vLLM's models accept without a bound (top_k, token ids, logit_bias keys) must fit
    the engines' msgpack encoding; a 400 naming the field, not a failure at the engine call."""
    from serve_app.wire.sampling import encode_sampling

    try:
        encode_sampling(params)
    except OverflowError:
        low, high = INT_RANGE
        bad = next((name for name in params.__struct_fields__ if _out_of_range(getattr(params, name, None))), None)
        param = _REQUEST_FIELD.get(bad, bad) if bad is not None else None
        raise bad_request(f"A number is outside the range this server accepts ({low} to {high})", param=param) from None


# vLLM's own checks of token ids a request names (columns of the logits tensor): run by vLLM's
# input processor, in its API server, before a request reaches an engine; here for the same reason.
VOCABULARY_CHECKS = ("_validate_logit_bias", "_validate_stop_token_ids", "_validate_allowed_token_ids")


@functools.cache
def _vocabulary_checks() -> tuple[str, ...]:
    """The checks this vLLM has in the shape they are called here (runtime/private_symbols.py):
    vLLM 0.23's ``_validate_allowed_token_ids`` takes a tokenizer, not the model config, and
    called so it refused every request that named allowed_token_ids. One that changed is skipped,
    logged once: the engine still refuses what it would have."""
    checks = []
    for name in VOCABULARY_CHECKS:
        symbol = f"vllm.sampling_params.SamplingParams.{name}"
        if unchanged([symbol], logger, f"the router's own check of the token ids {name} reads (the engine still checks them)"):
            checks.append(name)
    return tuple(checks)


@dataclass(frozen=True)
class _VocabularyOnly:
    """The part of vLLM's ``ModelConfig`` its token-id checks read."""

    vocab_size: int

    def get_vocab_size(self) -> int:
        return self.vocab_size


def _check_vocabulary(params: Any, ctx: ModelContext) -> None:
    """Token ids outside the vocabulary (``logit_bias`` keys, ``stop_token_ids``,
    ``allowed_token_ids``) are a 400 here, with vLLM's message, rather than a refusal by the
    engine after the router has leased it (vLLM versions without one of the checks skip it: the
    engine still refuses)."""
    model = _VocabularyOnly(ctx.vocab_size)
    for name in _vocabulary_checks():
        check = getattr(params, name, None)
        if check is None:
            continue
        try:
            check(model)
        except _client_errors() as exc:
            raise bad_request(str(exc), param=getattr(exc, "parameter", None)) from None


def _check_repetition_bound(params: Any) -> None:
    """vLLM's ``repetition_detection`` is checked by the decode engine's core after every
    token of the request, for each pattern length up to ``max_pattern_size`` that the output
    holds ``min_count`` times: up to about a millisecond a token for a long output and an
    unbounded size (measured on the development machine, 4,000 tokens), spent in the step every
    request of the batch waits on. vLLM's server takes any size; the router bounds it, so that a
    client cannot slow other clients' tokens with it (docs/security.md)."""
    detection = getattr(params, "repetition_detection", None)
    if detection is not None and detection.max_pattern_size > MAX_REPETITION_PATTERN:
        raise bad_request(
            f"repetition_detection.max_pattern_size of {detection.max_pattern_size} is more than this server's "
            f"{MAX_REPETITION_PATTERN}",
            param="repetition_detection.max_pattern_size",
        )


def _check_grammar_nesting(params: Any) -> None:
    """Converting a JSON schema or structural tag to a grammar costs steeply more with depth
    (xgrammar: 45 s of an engine replica's event loop for 1,000 levels, in a 30 KB body), and a
    request body is bounded only by Python's own nesting limit (a schema sent as a string, by
    nothing). vLLM 0.32 bounds it when the engine admits the request, vLLM 0.23 (Ascend) does
    not: the router bounds it as vLLM 0.32 does, whatever sent it (``response_format``,
    ``structured_outputs``, a named or required tool choice's schema, wrappers included), as an
    object or a string: a schema at 64 levels, a structural tag 16 deeper (its tag wrappers)."""
    spec = params.structured_outputs
    for name, limit in (("json", MAX_NESTING), ("structural_tag", MAX_NESTING + STRUCTURAL_TAG_WRAPPERS)):
        value = getattr(spec, name, None) if spec is not None else None
        param = f"structured_outputs.{name}"
        if isinstance(value, dict | list):
            parsed = value
        elif isinstance(value, str):
            try:
                parsed = json.loads(value)
            except RecursionError:
                raise bad_request(f"{param} is nested more deeply than {limit} levels", param=param) from None
            except ValueError:
                continue  # not JSON: vLLM refuses it, at no cost
        else:
            continue
        if _nesting_exceeds(parsed, limit):
            raise bad_request(f"{param} is nested more deeply than {limit} levels", param=param)


def _nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than ``limit`` levels (iteratively: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _out_of_range(value: Any, depth: int = 0) -> bool:
    """Whether an integer outside what the engines' msgpack encoding carries is in ``value``,
    looked into ``MAX_NESTING`` levels deep (callers bound the nesting first)."""
    low, high = INT_RANGE
    if isinstance(value, bool) or depth > MAX_NESTING:
        return False
    if isinstance(value, int):
        return not low <= value <= high
    if isinstance(value, dict):
        return any(_out_of_range(k, depth + 1) or _out_of_range(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_out_of_range(v, depth + 1) for v in value)
    return False


def _reject_unsupported(route: Route, request: Any, ctx: ModelContext) -> None:
    def refuse(param: str, what: str) -> None:
        raise bad_request(f"{what} is not supported by this server", param=param)

    if request.n is not None and request.n < 1:
        raise bad_request(f"n must be at least 1, got {request.n}", param="n")
    if request.use_beam_search:
        refuse("use_beam_search", "Beam search")
    # vLLM's own fields the router would otherwise accept and drop: a client relying on one must
    # hear that it is not there.
    # vLLM 0.32's sampler gives every other request of the step that asks for top logprobs a
    # lone -inf entry instead (docs/security.md); vLLM 0.23 (Ascend) has no such field.
    if getattr(request, "logprob_token_ids", None) is not None:
        refuse("logprob_token_ids", "logprob_token_ids")
    if getattr(request, "return_token_offsets", None):  # vLLM's /render endpoints' field (which the router does not serve)
        refuse("return_token_offsets", "return_token_offsets")
    if route == "completions":
        if request.suffix is not None:
            refuse("suffix", "suffix")
        if request.prompt_embeds is not None:
            refuse("prompt_embeds", "prompt_embeds")
    else:
        check_template_kwargs(request, ctx)


def check_template_kwargs(request: Any, ctx: ModelContext) -> None:
    """A client's template is code the router runs (its sandbox allows unbounded loops and
    strings): refused unless the operator trusts clients, as vLLM does; other arguments of
    apply_chat_template are never the client's."""
    kwargs = request.chat_template_kwargs or {}
    sent = request.chat_template is not None or kwargs.get("chat_template") is not None
    if sent and not ctx.trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, param="chat_template" if request.chat_template is not None else "chat_template_kwargs")
    for key in kwargs.keys() & (TEMPLATE_CALL_ARGS - {"chat_template"}):
        raise bad_request(f"chat_template_kwargs.{key} is not a template variable", param=f"chat_template_kwargs.{key}")


def _raw_prompts(request: Any) -> list[Any]:
    prompt = request.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _prompt_logprobs_of(route: Route, request: Any, logprobs: int | None, ctx: ModelContext) -> tuple[int | None, int | None, str]:
    """(the k the engine is asked for, the k of the reply's ``prompt_logprobs`` field, the field
    that set it), as on vLLM's server: a client's prompt_logprobs (-1: the whole vocabulary),
    else an echo's (a completion's logprobs, a chat request's top_logprobs). A reply that is not
    streamed shows the field wherever the engine is asked; a stream never carries it (vLLM's
    protocol refuses k above 0 there), so there the engine is asked only for a completion echo's
    logprobs, which it reads from the same k."""
    k, param = request.prompt_logprobs, "prompt_logprobs"
    if k is None and request.echo:
        k, param = (logprobs, "logprobs") if route == "completions" else (request.top_logprobs, "echo")
    if k is None:
        return None, None, param
    asked = f"{k} (the whole vocabulary: {ctx.vocab_size} tokens)" if k == -1 else str(k)
    if k == -1:
        k = ctx.vocab_size
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs of {asked} is more than this server's most logprobs per token ({MAX_LOGPROBS}), as vLLM's max_logprobs",
            param="prompt_logprobs",
        )
    if not request.stream:
        return k, k, param
    echo_reads = route == "completions" and request.echo and logprobs is not None
    return (k if echo_reads else None), None, param


def _echoes(route: Route, request: Any, prompts: list[list[int]], ctx: ModelContext) -> list[str | None]:
    """Each prompt's ``echo`` text (ParsedRequest.echo), as vLLM's server writes it."""
    if not request.echo:
        return [None] * len(prompts)
    if route == "chat":
        last = request.messages[-1]
        field_of = last.get if isinstance(last, dict) else lambda name: getattr(last, name, None)
        return [_text_content(field_of("content"), len(request.messages) - 1) if field_of("role") == _reply_role(request) else ""]
    if request.return_token_ids:  # the prompt's token ids carry it
        return [""] * len(prompts)
    return [raw if isinstance(raw, str) else ctx.tokenizer.decode(ids) for raw, ids in zip(_raw_prompts(request), prompts, strict=True)]


def _reply_role(request: Any) -> str:
    """The role of a chat reply (vLLM's server's ``get_chat_request_role``)."""
    if request.add_generation_prompt or not request.messages:
        return "assistant"
    last = request.messages[-1]
    role = last.get("role") if isinstance(last, dict) else getattr(last, "role", None)
    return str(role) if role else "assistant"


def _truncated(ids: list[int], *, keep: int, side: str | None, max_tokens: int | None, param: str, ctx: ModelContext) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: at most ``keep`` of the prompt's tokens (-1: as many as
    fit), the first ones or, with ``truncation_side: left`` (or a tokenizer that truncates on the
    left), the last ones. What fits is what the installed vLLM's server allows: where it cuts
    max_tokens down (0.32), the context less one token for output, a larger ``keep`` than the
    context refused; where it refuses a prompt with no room for max_tokens (0.23), the context
    less max_tokens, a larger ``keep`` refused."""
    if ctx.clamps_max_tokens:
        bound, room, of = ctx.max_model_len, ctx.max_model_len - 1, "max_model_len"
    else:
        bound = room = ctx.max_model_len - max(1, max_tokens or 0)
        of = f"max_model_len - {param}"
    if keep > bound:
        raise bad_request(
            f"truncate_prompt_tokens={keep} cannot be greater than {of} = {bound}. Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if keep == 0:
        raise bad_request("truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens")
    if keep < 0:
        keep = room  # (a keep of the whole context, on 0.32, leaves no room: refused after, as vLLM does)
    if keep >= len(ids):
        return ids
    if (side or getattr(ctx.tokenizer, "truncation_side", "right")) == "left":
        return ids[len(ids) - keep :]
    return ids[:keep]


def _completion_prompts(request: Any, ctx: ModelContext) -> list[list[int]]:
    """The prompts' token ids: one prompt (text or token ids) or a list of them, each a choice (n
    of them) of the response, as on vLLM's server. The number of choices is checked before any
    prompt is tokenized."""
    prompts = _raw_prompts(request)
    _check_choices(len(prompts), 1 if request.n is None else request.n, ctx)
    where = (lambda i: f"prompt[{i}]") if len(prompts) > 1 else (lambda i: "prompt")
    whole = request.truncate_prompt_tokens is None  # (a prompt to truncate may be longer than the context)
    return [_completion_prompt_ids(one, request.add_special_tokens, where(i), ctx, whole) for i, one in enumerate(prompts)]


def _check_choices(prompts: int, n: int, ctx: ModelContext) -> None:
    if prompts * n > ctx.max_choices:
        what = f"n={n}" if prompts == 1 else f"{prompts} prompts" if n == 1 else f"{prompts} prompts times n={n}"
        raise bad_request(
            f"{what} asks for {prompts * n} choices; this server allows at most {ctx.max_choices} per request",
            param="n" if prompts == 1 else "prompt",
        )


def _completion_prompt_ids(prompt: Any, add_special_tokens: bool, where: str, ctx: ModelContext, whole: bool = True) -> list[int]:
    if isinstance(prompt, str):
        if whole:
            _check_text_length(prompt, "prompt", ctx)
        ids = ctx.encode(prompt, add_special_tokens)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            of = f" in {where}" if where != "prompt" else ""
            raise bad_request(f"Token id {bad[0]}{of} is out of range [0, {ctx.vocab_size})", param="prompt")
    if not ids:
        raise bad_request(f"The {where} is empty", param="prompt")
    return ids


def template_kwargs(request: Any) -> dict[str, Any]:
    """The variables the chat template gets besides the conversation, which the model's reply
    parsers get too (e.g. qwen3's reads ``enable_thinking``), as on vLLM's server."""
    kwargs = dict(request.chat_template_kwargs or {})
    effort = declared(request, "reasoning_effort")
    if effort is not None:  # as vLLM's server: the template reads it (the field wins over the
        kwargs["reasoning_effort"] = effort  # client's kwargs), and it opts in to thinking
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def declared(request: Any, name: str) -> Any:
    """A field of the request where vLLM's model for its route has one (``reasoning_effort`` of
    a chat completion, not of a /tokenize request); else None: vLLM's models keep a client's
    unknown keys as attributes, which mean nothing to vLLM's server."""
    return getattr(request, name) if name in type(request).model_fields else None


def _chat_prompt(request: Any, ctx: ModelContext) -> tuple[str, list[int]]:
    """The conversation rendered by the chat template, and its token ids."""
    # (a prompt to truncate may be longer than the context)
    text = chat_prompt_text(request, ctx, bounded=request.truncate_prompt_tokens is None)
    # The template writes the special tokens (BOS) itself.
    ids = ctx.encode(text, request.add_special_tokens)
    if not ids:
        raise bad_request("The rendered prompt is empty", param="messages")
    return text, ids


def chat_prompt_text(request: Any, ctx: ModelContext, *, bounded: bool) -> str:
    """The conversation rendered by the chat template, as an engine's prompt; ``bounded``: text
    longer than the context could hold is refused before it is tokenized (else text longer than
    ``max_render_chars``)."""
    conversation = []
    for i, message in enumerate(request.messages):
        field_of = message.get if isinstance(message, dict) else lambda name, m=message: getattr(m, name, None)
        role, content = field_of("role"), field_of("content")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role must be a string", param=f"messages.{i}.role")
        turn = {"role": role, "content": _text_content(content, i)}
        calls = field_of("tool_calls")
        if isinstance(calls, Iterator):  # vLLM's /tokenize model leaves it a lazy pydantic iterator
            calls = list(calls)
        if calls and role == "assistant":
            turn["tool_calls"] = template_tool_calls(calls, i)
        elif calls:
            raise bad_request(f"messages[{i}].tool_calls: only an assistant turn makes tool calls", param=f"messages.{i}.tool_calls")
        call_id = field_of("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"messages[{i}].tool_call_id must be a string", param=f"messages.{i}.tool_call_id")
        if call_id is not None:
            turn["tool_call_id"] = call_id
        # What templates read besides role and content, as vLLM's server passes it on: the
        # speaker's name, and an assistant turn's reasoning (under both names templates use).
        speaker = field_of("name")
        if isinstance(speaker, str):
            turn["name"] = speaker
        reasoning = field_of("reasoning")
        reasoning = field_of("reasoning_content") if reasoning is None else reasoning
        if role == "assistant" and isinstance(reasoning, str):
            turn["reasoning"] = turn["reasoning_content"] = reasoning
        conversation.append(turn)
    kwargs = template_kwargs(request)
    if request.chat_template is not None:  # trusted by the operator (checked above)
        kwargs["chat_template"] = request.chat_template
    client_template = kwargs.get("chat_template") is not None
    if any(turn["role"] == "developer" for turn in conversation):
        conversation = _developer_as_system(conversation, kwargs.get("chat_template") or ctx.tokenizer.chat_template)
    try:
        with _time_bound(ctx.client_template_timeout_s if client_template else None):
            text = ctx.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=template_tools(request),
                documents=declared(request, "documents"),  # retrieval documents, for templates that read them (RAG)
                **kwargs,
            )
    except TemplateTimeout:
        param = "chat_template" if request.chat_template is not None else "chat_template_kwargs.chat_template"
        raise bad_request(f"The request's chat template did not finish within {ctx.client_template_timeout_s:g} s", param=param) from None
    except Exception as exc:  # a template error is the request's fault (bad roles, kwargs)
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None
    if not isinstance(text, str):
        raise bad_request("The chat template did not render text", param="messages")
    if bounded:
        _check_text_length(text, "messages", ctx)
    elif len(text) > ctx.max_render_chars:
        # Before the tokenizer spends seconds on it: one string operation of a client's template
        # (a repeat) is not interrupted by its time limit.
        raise bad_request(
            f"The chat template rendered {len(text)} characters; this server tokenizes at most {ctx.max_render_chars} for one prompt",
            param="messages",
        )
    return text


DEVELOPER_ROLE = [
    f"vllm.renderers.hf.{name}"
    for name in ("_detect_developer_role_support", "_convert_developer_to_system", "_consolidate_system_messages")
]


def _developer_as_system(conversation: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role (what newer clients send instead of ``system``) as vLLM's
    renderer passes it: unchanged to a template that names the role, else as ``system``, the
    system turns merged into one at the start (templates that take one system turn first). With
    vLLM's own helpers, so the prompt is the one vLLM's server renders."""
    if not isinstance(template, str) or not unchanged(DEVELOPER_ROLE, logger, "developer turns rendered as system turns"):
        return conversation
    from vllm.renderers import hf

    if hf._detect_developer_role_support(template):
        return conversation
    return hf._consolidate_system_messages(hf._convert_developer_to_system(conversation))


class TemplateTimeout(Exception):
    """A client's chat template ran past ``ModelContext.client_template_timeout_s``."""


@contextmanager
def _time_bound(seconds: float | None) -> Iterator[None]:
    """Stop the Python code this thread runs inside the block after ``seconds`` (None: no bound).

    A thread cannot be cancelled from outside, and a worker thread that renders a template
    without end would hold its CPU and its executor slot for good. So a trace function on this
    thread only checks the clock at every line and raises ``TemplateTimeout`` past the deadline,
    which unwinds the template's frames: Jinja compiles a template to Python code, so its loops,
    however nested, run line by line. One long C-level operation (a huge string repeat) is not
    interrupted; the rendered text's length is checked after it. Tracing slows the code it
    traces, so only a client's template is rendered under it."""
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return trace

    previous = sys.gettrace()  # a debugger's or coverage's, restored after
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def _check_text_length(text: str, param: str, ctx: ModelContext) -> None:
    if len(text) > ctx.max_prompt_chars:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens; the prompt's {len(text)} characters cannot fit in it",
            param=param,
        )


# The content parts vLLM's server reads as text (an OpenAI assistant turn sent back may hold a
# refusal part), and the key that holds each one's text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def _text_content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterator):  # vLLM's message model leaves an empty list a lazy pydantic iterator
        try:
            content = list(content)
        except ValueError as exc:  # pydantic's ValidationError: a part it could not read
            raise bad_request(f"messages[{i}].content has a part that is not a content part", param=f"messages.{i}.content") from exc
    if isinstance(content, list):
        texts = []
        for part in content:
            part_type = part.get("type") if isinstance(part, dict) else None
            key = _TEXT_PARTS.get(part_type) if isinstance(part_type, str) else None
            if key is None:
                raise bad_request(
                    f"messages[{i}]: content parts of type '{part_type}' are not supported (text only)",
                    param=f"messages.{i}.content",
                )
            if part.get(key) is not None:  # (vLLM's server skips a part without its text)
                texts.append(str(part[key]))
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages.{i}.content")


def _clamped(prompt_token_ids: list[int], max_tokens: int, param: str, ctx: ModelContext) -> int:
    """vLLM 0.32's server: a max_tokens over the context is refused; one over what the prompt
    leaves of it is cut down to that (a prompt that leaves nothing is refused after)."""
    if max_tokens > ctx.max_model_len:
        raise bad_request(
            f"{param}={max_tokens} cannot be greater than max_model_len={ctx.max_model_len}. Please request fewer output tokens.",
            param=param,
        )
    return min(max_tokens, max(ctx.max_model_len - len(prompt_token_ids), 1))


def _check_lengths(prompt_token_ids: list[int], max_tokens: int | None, param: str, prompt_param: str, ctx: ModelContext) -> None:
    n = len(prompt_token_ids)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param=param)
    if n >= ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt is "
            f"{n} tokens, which leaves no room for output.",
            param=prompt_param,
        )
    if max_tokens is not None and n + max_tokens > ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce "
            f"the prompt or {param}.",
            param=param,
        )
