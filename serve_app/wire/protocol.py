"""Plain values that travel between the router and the engines: msgpack frames over an engine's
own HTTP endpoint (wire/frames.py), or Serve handle calls.

Only token ids travel: the router tokenizes once and the engines never see text prompts. A
decode stream's ``TokenDelta`` carries every token since the previous one (several engine steps
coalesced, engines/pacing.py), since each streamed item costs both ends a fixed amount of CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode"]

# The stop_reason a decode engine's recompute scheduler sets when it gives a request back instead
# of preempting it locally (vllm-ascend's RecomputeScheduler uses the same string).
RECOMPUTED = "recomputed"
# The stop_reason a decode engine that Serve is stopping ends its streams with: the router resumes
# each on another decode engine, as after a recompute (engines/server.py, "drain").
MOVED = "moved"


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives at its position, as
    ``(token_id, logprob)`` pairs best first. Ids only: the router turns them into strings.
    ``rank``: the token's own rank in the vocabulary (1: the most likely), where the engine gave
    it (a prompt token's: vLLM's ``prompt_logprobs`` field shows it)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class EngineRequest:
    """One attempt's work for one engine.

    ``sampling_params`` is a ``vllm.SamplingParams``, msgpack-encoded (``serve_app.wire.sampling``); ``request_id``
    is the attempt id, unique per attempt and never reused: an abort names requests by it (vLLM
    0.32 aborts every request of an id, 0.23 refuses a duplicate), so a late abort must not hit a
    later attempt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: bytes
    kv_transfer_params: dict[str, Any] | None = None
    # The client's prefix-cache salt (vLLM's ``cache_salt``): the engine keys the prompt's cached
    # blocks with it, so only requests with the same salt share them.
    cache_salt: str | None = None
    # vLLM's request priority (lower is served earlier), where the engines schedule by priority.
    priority: int = 0
    # A reasoning model's chat request, as vLLM's server hands it to the engine: whether the
    # thinking is over before the first output token (True: a grammar holds from it), and the
    # template's variables for the engine's reasoning parser (``{"chat_template_kwargs": {...}}``).
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class RequestTags:
    """What every engine request of one client request carries besides its prompt and sampling
    parameters: a decode engine's request all of it; a prefill engine's (which samples nothing a
    client sees) the cache salt and the priority."""

    cache_salt: str | None = None
    priority: int = 0
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None

    def decode(self) -> dict[str, Any]:
        return {
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "reasoning_ended": self.reasoning_ended,
            "reasoning_parser_kwargs": self.reasoning_parser_kwargs,
        }

    def prefill(self) -> dict[str, Any]:
        return {"cache_salt": self.cache_salt, "priority": self.priority}


NO_TAGS = RequestTags()


@dataclass(frozen=True)
class KVReady:
    """First event of a disaggregated decode stream: the decode engine allocated KV blocks and its
    connector posted its KV parameters (``params``) to the metaserver relay."""

    params: dict[str, Any]


@dataclass
class TokenDelta:
    """New output of one engine request since the previous delta.

    No text: engines run with ``detokenize=False`` and the router detokenizes the whole response
    with one decode stream across attempts, so a recompute can never change the text.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Prompt tokens the engine did not compute itself (prefix cache or KV received from prefill);
    # set on the first delta only.
    num_cached_tokens: int | None = None
    # Each prompt token's logprob (None for the first, which nothing predicts), where the request
    # asked for them (``prompt_logprobs``: a client's, or an echo's); first delta only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class PrefillResult:
    """What a prefill engine reports when its part of a disaggregated attempt is done."""

    request_id: str
    num_prompt_tokens: int
    finish_reason: str | None
    # The KV connector's record of the push (layers, bytes, times), where the backend's connector
    # reports one (the CPU backend's does; vllm-ascend's does not).
    push: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineRejected:
    """The engine refused the request as invalid (vLLM's input checks, e.g. a ``logit_bias``
    token outside the vocabulary): the client's fault, answered with a 400, never retried."""

    message: str


EngineEvent = KVReady | TokenDelta | EngineRejected


@dataclass(frozen=True)
class KVEndpoint:
    """Where an engine's KV side channel is: what a KVReady from it must name."""

    engine_id: str
    host: str
    port: int


@dataclass(frozen=True)
class EngineCallEndpoint:
    """Where an engine replica takes the router's calls over HTTP, and the token it wants
    (engines/call_server.py); reported in its replica metadata and its stats, which only travel
    over Serve."""

    url: str
    token: str = field(repr=False)


@dataclass
class EngineStats:
    """Cheap load report of one engine, polled by the router's balancer."""

    name: str
    role: Role
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int = 0
    inflight: int = 0
    healthy: bool = True
    kv_endpoint: KVEndpoint | None = None
    call_endpoint: EngineCallEndpoint | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # A new value when the engine starts afresh (an empty prefix cache): router/prefix_index.py.
    epoch: str = ""
    # Since the engine started: prompt tokens it was given, those its prefix cache held (decode
    # engines of a disaggregated attempt: held before any KV was pushed), KV bytes it pushed.
    prompt_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    kv_bytes_pushed_total: int = 0
    # A prefill engine's line: prompt tokens of the calls it holds, queued or computing, whichever
    # router sent them (router/balancer.py's prefill score).
    queued_prompt_tokens: int = 0

    @property
    def kv_used_tokens(self) -> int:
        return round(self.kv_usage * self.kv_capacity_tokens)
