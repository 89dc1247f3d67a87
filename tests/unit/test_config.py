from __future__ import annotations

import re

import pytest
import yaml

from serve_app.config.settings import ConfigError, load_config
from tests.support.cluster import SERVE_YAML


def test_serve_yaml_is_valid_and_explicit_about_cpus():
    file = yaml.safe_load(SERVE_YAML.read_text())
    (app,) = file["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    config = load_config(app["args"])
    assert config.backend == "cpu"
    for role in ("prefill", "decode", "router"):
        assert "num_cpus" in app["args"][role], f"{role} must set num_cpus explicitly"
    assert config.prefill.initial_replicas == 1 and config.decode.initial_replicas == 1


@pytest.mark.parametrize(
    "args,field",
    [
        ({"backend": "tpu"}, "backend"),
        ({"prefill": {"num_replicas": -1}}, "prefill.num_replicas"),
        ({"decode": {"engine_kwags": {}}}, "decode.engine_kwags"),
        ({"router": {"max_attempts": 0}}, "router.max_attempts"),
        ({"router": {"timeouts": {"kv_ready_s": 0}}}, "router.timeouts.kv_ready_s"),
        ({"max_model_len": "long"}, "max_model_len"),
        ({"surprise": 1}, "surprise"),
        ({"router": {"http": {"max_body_bytes": 10}}}, "router.http.max_body_bytes"),
        ({"router": {"http": {"max_header_bytes": 10}}}, "router.http.max_header_bytes"),
        ({"router": {"operator_token": "short"}}, "router.operator_token"),
        ({"router": {"max_surge_percent": 101}}, "router.max_surge_percent"),
        ({"router": {"max_surge_percent": -1}}, "router.max_surge_percent"),
        ({"decode": {"max_surge_percent": 101}}, "decode.max_surge_percent"),
        # Core lists vLLM would refuse only when the engine starts.
        ({"decode": {"cpu_bind": ["all"]}}, "decode.cpu_bind"),
        ({"prefill": {"cpu_bind": ["0,"]}}, "prefill.cpu_bind"),
        # What pd-serve sets itself, in any engine_kwargs.
        ({"decode": {"engine_kwargs": {"kv_transfer_config": {"kv_connector": "X"}}}}, "decode.engine_kwargs.kv_transfer_config"),
        ({"engine_kwargs": {"model": "other"}}, "engine_kwargs.model"),
        # The KV side channel's bounds: positive numbers (a 0 refused every connection).
        ({"kv_connector_extra_config": {"max_connections": 0}}, "kv_connector_extra_config.max_connections"),
        ({"kv_connector_extra_config": {"early_ttl_s": "soon"}}, "kv_connector_extra_config.early_ttl_s"),
        ({"kv_connector_extra_config": {"max_early_bytes": 1.5}}, "kv_connector_extra_config.max_early_bytes"),
    ],
)
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ConfigError) as err:
        load_config(args)
    assert field in str(err.value)


def test_topology_checks():
    with pytest.raises(ConfigError, match="decode needs at least 1 replica"):
        load_config({"decode": {"num_replicas": 0}})
    with pytest.raises(ConfigError, match="decode needs at least 1 replica"):
        load_config({"decode": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 2}}})
    with pytest.raises(ConfigError, match="disaggregated"):
        load_config({"prefill": {"num_replicas": 0}, "router": {"mode": "disaggregated"}})
    assert load_config({"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}).prefill.num_replicas == 0
    # Colocated with prefill engines: allowed (they are the user's), but said to be idle.
    assert load_config({"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}).idle_prefill() is None
    assert load_config({"router": {"mode": "disaggregated"}}).idle_prefill() is None
    assert "prefill.num_replicas: 0" in load_config({"router": {"mode": "colocated"}}).idle_prefill()
    # The router serves HTTP: never scaled to zero, where nothing would listen to scale it up.
    with pytest.raises(ConfigError, match="router needs at least 1 replica"):
        load_config({"router": {"autoscaling_config": {"min_replicas": 0, "max_replicas": 3}}})
    assert load_config({"decode": {"cpu_bind": ["0-3,8|9-12", "auto", "nobind"], "num_replicas": 3}}).decode.cpu_bind[0] == "0-3,8|9-12"


POLICY = "serve_app.config.autoscaling:"
DOTTED = "serve_app.config.autoscaling."


@pytest.mark.parametrize(
    ("role", "policy", "message"),
    [
        ("decode", {"policy_function": POLICY + "DecodeLoadPolicy", "policy_kwargs": {"target_request": 8}}, "target_request"),
        ("decode", {"policy_function": POLICY + "SLOPolicy", "policy_kwargs": {"ttft_p90_s": 0.5}}, "decode replicas do not report"),
        ("router", {"policy_function": POLICY + "DecodeLoadPolicy"}, "router replicas do not report"),
        ("prefill", {"policy_function": POLICY + "PrefillLoadPolicy", "policy_kwargs": {"target_prompt_tokens": 0}}, "above 0"),
        # JSON allows NaN: every decision would then fail in Serve's controller.
        ("decode", {"policy_function": POLICY + "DecodeLoadPolicy", "policy_kwargs": {"target_requests": float("nan")}}, "finite"),
        ("decode", {"policy_function": POLICY + "SLOPolicy", "policy_kwargs": {"itl_p90_s": float("inf")}}, "finite"),
        # Kwargs without a policy are the role's default policy's (Serve would drop them).
        ("decode", {"policy_kwargs": {"target_request": 8}}, "target_request"),
        ("decode", {"policy_function": POLICY + "NoSuchPolicy"}, "cannot import the policy"),
        # Only prefill replicas hold prompts: on decode this policy would read 0 forever.
        ("decode", {"policy_function": POLICY + "PrefillLoadPolicy"}, "decode replicas do not report"),
        # Serve's dotted spelling of the same policy is checked as well.
        (
            "decode",
            {"policy_function": POLICY.rstrip(":") + ".SLOPolicy", "policy_kwargs": {"ttft_p90_s": 0.5}},
            "decode replicas do not report",
        ),
    ],
)
def test_pd_serves_own_policies_are_built_and_matched_to_their_role_at_load(role, policy, message):
    """Serve builds a policy only in its controller, where a misspelt argument fails out of sight;
    and a policy reading a metric its pool does not report holds its pool's size forever."""
    with pytest.raises(ConfigError, match=message):
        load_config({role: {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "policy": policy}}})


def test_both_roles_must_lay_out_kv_blocks_alike():
    """Prefill writes its blocks into decode's as they are: a block size, dtype or KV dtype set
    for one role only broke every push (each request spent its attempts, then a 502)."""
    for key, value in (("block_size", 64), ("dtype", "bfloat16"), ("kv_cache_dtype", "fp8")):
        with pytest.raises(ConfigError, match=f"prefill's and decode's {key} differ"):
            load_config({"prefill": {"engine_kwargs": {key: value}}})
        assert load_config({"engine_kwargs": {key: value}}).engine_kwargs[key] == value  # for both: fine
        both = {"prefill": {"engine_kwargs": {key: value}}, "decode": {"engine_kwargs": {key: value}}}
        assert load_config(both).prefill.engine_kwargs[key] == value
    # A colocated app has no prefill engine to match.
    colocated = {"prefill": {"num_replicas": 0, "engine_kwargs": {"block_size": 64}}, "router": {"mode": "colocated"}}
    assert load_config(colocated).prefill.engine_kwargs["block_size"] == 64


@pytest.mark.parametrize(
    "key,value",
    [
        ("revision", "other-sha"),
        ("load_format", "dummy"),
        ("quantization", "fp8"),
        ("tokenizer", "/models/tok"),
        ("trust_remote_code", True),
    ],
)
def test_both_roles_must_run_one_model(key, value):
    """Decode continues from the KV prefill computed: other weights (a revision, random weights,
    a quantization) on one role passed the KV layout check and decoded from wrong KV, silently."""
    with pytest.raises(ConfigError, match=f"prefill's and decode's {key} differ .*both must run one model"):
        load_config({"prefill": {"engine_kwargs": {key: value}}})
    assert load_config({"engine_kwargs": {key: value}}).engine_kwargs[key] == value
    # Unset on one role and vLLM's default on the other is one model.
    for key, default in (("trust_remote_code", False), ("load_format", "auto"), ("tokenizer_mode", "auto")):
        assert load_config({"decode": {"engine_kwargs": {key: default}}}).decode.engine_kwargs[key] == default


def test_the_router_loads_the_engines_tokenizer():
    """The router tokenizes every prompt and detokenizes every token: it loaded the model's own
    tokenizer at its head revision whatever the engines were told (tokenizer, revision,
    trust_remote_code), and so sent the engines other token ids than theirs."""
    config = load_config({"engine_kwargs": {"tokenizer": "/models/tok", "revision": "abc", "trust_remote_code": True}})
    assert config.tokenizer_source == ("/models/tok", {"trust_remote_code": True, "revision": "abc"})
    assert config.model_config_source == (config.model, {"trust_remote_code": True, "revision": "abc"})
    config = load_config({"engine_kwargs": {"revision": "abc", "tokenizer_revision": "def"}})
    assert config.tokenizer_source == (config.model, {"trust_remote_code": False, "revision": "def"})
    assert load_config({}).tokenizer_source == (load_config({}).model, {"trust_remote_code": False})


def test_a_slow_tokenizer_is_refused_at_load_not_on_every_request():
    """vLLM 0.23 (Ascend) takes tokenizer_mode slow; the router's stream detokenizer needs a fast
    tokenizer (a slow one made every generation a 500): refused where it is set."""
    slow = {"engine_kwargs": {"tokenizer_mode": "slow"}}
    for args, where in ((slow, "engine_kwargs"), ({"decode": slow}, "decode"), ({"prefill": slow}, "prefill")):
        with pytest.raises(ConfigError, match=rf"{where}.*tokenizer_mode 'slow' is not supported: the router detokenizes"):
            load_config(args)
    assert load_config({"engine_kwargs": {"tokenizer_mode": "auto"}}).engine_kwargs["tokenizer_mode"] == "auto"


def test_build_service_loads_the_tokenizer_and_config_as_the_engines_do(monkeypatch):
    import transformers

    from serve_app.router import deployment

    seen = []

    class Stop(Exception):
        pass

    class Tokenizer:
        def __len__(self) -> int:  # the vocabulary's fallback, once the config failed: far enough
            raise Stop

    def tokenizer(name, **options):
        seen.append(("tokenizer", name, options))
        return Tokenizer()

    def model_config(name, **options):
        seen.append(("config", name, options))
        raise OSError("not here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", model_config)
    with pytest.raises(Stop):
        deployment.build_service({"engine_kwargs": {"tokenizer": "/models/tok", "revision": "r1", "hf_config_path": "/cfg"}}, {})
    options = {"trust_remote_code": False, "revision": "r1"}
    assert seen == [("tokenizer", "/models/tok", options), ("config", "/cfg", options)]


def test_settings_that_would_replace_the_recompute_scheduler_are_refused():
    """decode.recompute runs decode on the recompute scheduler: a scheduler_cls (cpu) was
    overwritten silently, and vllm-ascend's dynamic-batch or profiling-chunk scheduler would have
    replaced its RecomputeScheduler (decode then preempted locally, recompute on in name only)."""
    with pytest.raises(ConfigError, match="decode.engine_kwargs.scheduler_cls: decode.recompute"):
        load_config({"decode": {"engine_kwargs": {"scheduler_cls": "my.Scheduler"}}})
    with pytest.raises(ConfigError, match="engine_kwargs.scheduler_cls"):
        load_config({"engine_kwargs": {"scheduler_cls": "my.Scheduler"}})
    assert load_config({"decode": {"recompute": False, "engine_kwargs": {"scheduler_cls": "my.Scheduler"}}}).decode.recompute is False
    ascend = {"backend": "ascend", "model": "/models/m"}
    for extra, key in (
        ({"SLO_limits_for_dynamic_batch": 50}, "SLO_limits"),
        ({"profiling_chunk_config": {"enabled": True}}, "profiling_chunk"),
    ):
        with pytest.raises(ConfigError, match=f"additional_config.{key}.*RecomputeScheduler"):
            load_config({**ascend, "decode": {"engine_kwargs": {"additional_config": extra}}})
        assert load_config({**ascend, "decode": {"recompute": False, "engine_kwargs": {"additional_config": extra}}})
    assert load_config({**ascend, "decode": {"engine_kwargs": {"additional_config": {"SLO_limits_for_dynamic_batch": -1}}}})
    # A colocated Ascend app's decode engines run without the recompute scheduler anyway.
    colocated = {**ascend, "prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}
    assert load_config({**colocated, "decode": {"engine_kwargs": {"additional_config": {"SLO_limits_for_dynamic_batch": 50}}}})


def test_engine_queue_bounds_are_refused_at_load():
    """vLLM 0.32 refuses a request past max_num_queued_reqs / max_num_queued_tokens with an error
    the router cannot tell from an engine failure: every such request would be retried on other
    engines and end in a 502."""
    for key in ("max_num_queued_reqs", "max_num_queued_tokens"):
        for where in ("engine_kwargs", "prefill", "decode"):
            args = {key: 8} if where == "engine_kwargs" else None
            config = {"engine_kwargs": args} if args else {where: {"engine_kwargs": {key: 8}}}
            with pytest.raises(ConfigError, match=f"{key} is not supported: an engine whose queue is full"):
                load_config(config)


def test_parallelism_a_replica_cannot_hold_is_refused_at_load():
    """One replica is one engine: data parallelism inside it would start several engines behind
    one KV endpoint; Ascend replicas hold tensor_parallel_size NPUs and a 16-port KV block."""
    with pytest.raises(ConfigError, match="data_parallel_size 2: each replica is one engine"):
        load_config({"decode": {"engine_kwargs": {"data_parallel_size": 2}}})
    ascend = {"backend": "ascend", "model": "/models/m"}
    for key in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        with pytest.raises(ConfigError, match=f"{key} 2: the ascend backend runs tensor parallelism only"):
            load_config({**ascend, "prefill": {"engine_kwargs": {key: 2}}})
    with pytest.raises(ConfigError, match="tensor_parallel_size 32: an engine's KV port block has 16 ports"):
        load_config({**ascend, "decode": {"engine_kwargs": {"tensor_parallel_size": 32}}})
    assert load_config({**ascend, "engine_kwargs": {"tensor_parallel_size": 16}})


def test_ascend_settings_its_engines_could_not_start_with_are_refused_at_load():
    """Found by a review, each accepted before and failing later in a replica: a group's own
    resources without its NPUs (Ray then hides no NPU from the replica's engine: every engine on
    the node sees every NPU), the user's recompute switch on colocated decode engines (vllm-ascend
    refuses it without a KV connector), KV port blocks past 65535 (Mooncake has no fallback port),
    and a rank count that is no whole number (an int() traceback naming nothing)."""
    ascend = {"backend": "ascend", "model": "/models/m", "engine_kwargs": {"tensor_parallel_size": 4}}
    for resources in ({"pd_prefill": 0.01}, {"NPU": 1}):
        with pytest.raises(ConfigError, match=r"prefill.resources replaces the replica's \{NPU: 4\}"):
            load_config({**ascend, "prefill": {"resources": resources}})
    assert load_config({**ascend, "prefill": {"resources": {"NPU": 4, "pd_prefill": 0.01}}})
    assert load_config({**ascend, "prefill": {"resources": {"NPU": 8}}})  # more than its ranks: Ray's to place
    for resources in ({"NPU": -1}, {"NPU": 4.5}):
        with pytest.raises(ConfigError, match="prefill.resources replaces"):
            load_config({**ascend, "prefill": {"resources": resources}})
    one_rank = {"backend": "ascend", "model": "/models/m"}
    assert load_config({**one_rank, "decode": {"resources": {"NPU": 0.5}}})  # one rank sharing an NPU: the user's choice
    colocated = {**ascend, "prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}
    with pytest.raises(ConfigError, match="recompute_scheduler_enable: vllm-ascend runs its RecomputeScheduler only with a KV"):
        load_config({**colocated, "engine_kwargs": {"additional_config": {"recompute_scheduler_enable": True}}})
    with pytest.raises(ConfigError, match="kv_port_base 65000: the KV port blocks of up to 100 prefill and 1 decode"):
        load_config({**ascend, "kv_port_base": 65000, "prefill": {"num_replicas": "auto"}})
    pools = {"prefill": {"num_replicas": 8}, "decode": {"num_replicas": 9}}  # 34 blocks, a rolling update's included
    assert load_config({**ascend, **pools, "kv_port_base": 65536 - 16 * 34})  # the last one ending at 65535
    with pytest.raises(ConfigError, match="end at 65536, past 65535"):
        load_config({**ascend, **pools, "kv_port_base": 65536 - 16 * 34 + 1})
    # The last block (decode's rank 17, a rolling update's) is its own, not moved onto kv_port_base.
    from serve_app.config.backends import replica_spec

    assert replica_spec(load_config({**ascend, **pools, "kv_port_base": 65536 - 16 * 34}), "decode", 17).kv_port == 65520
    assert load_config({**colocated, "kv_port_base": 65000, "decode": {"num_replicas": "auto"}})  # no KV connector, no KV port
    assert load_config({**ascend, "engine_kwargs": {"tensor_parallel_size": 4.0}})
    with pytest.raises(ConfigError, match="an engine's KV port block has 16 ports"):  # a ConfigError, not an OverflowError
        load_config({**ascend, "engine_kwargs": {"tensor_parallel_size": 10**400}})
    for bad in ([2], "2", 2.5, True, 0, -1):
        with pytest.raises(ConfigError, match=re.escape(f"tensor_parallel_size {bad!r}: a whole number")):
            load_config({**ascend, "engine_kwargs": {"tensor_parallel_size": bad}})
        with pytest.raises(ConfigError, match=re.escape(f"tensor_parallel_size {bad!r}: a whole number")):
            load_config({"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}, "engine_kwargs": {"tensor_parallel_size": bad}})


def test_kv_connector_extra_config_keys_pd_serve_sets_or_nothing_reads_are_refused():
    """Merged over what pd-serve computes, they replaced it silently (Mooncake's rank layout on
    Ascend: transfers between wrongly mapped ranks; decode's receive deadline on the CPU), and on
    the CPU a misspelt limit was ignored."""
    ascend = {"backend": "ascend", "model": "/models/m"}
    with pytest.raises(ConfigError, match="kv_connector_extra_config.prefill is set by pd-serve itself"):
        load_config({**ascend, "kv_connector_extra_config": {"prefill": {"dp_size": 2, "tp_size": 8}}})
    assert load_config({**ascend, "kv_connector_extra_config": {"mooncake_protocol": "ascend"}})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.recv_timeout_s is set by pd-serve itself"):
        load_config({"kv_connector_extra_config": {"recv_timeout_s": 5}})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.max_conections: pd-serve's connector reads only"):
        load_config({"kv_connector_extra_config": {"max_conections": 64}})
    assert load_config({"kv_connector_extra_config": {"max_connections": 64}})


def test_a_group_env_that_changes_what_the_backend_depends_on_is_refused_at_build():
    """A group's env may tune its engines, not undo what pd-serve relies on: the V1 model
    runner (decode would not start), seeded sampling that resumes (no longer token-exact), the
    engine processes' watchdog (orphans)."""
    from serve_app.app import Plugins, build_app_with

    for name, value in (("VLLM_USE_V2_MODEL_RUNNER", "1"), ("PD_SERVE_SEEDED_SAMPLING", "0"), ("PD_SERVE_PARENT_WATCHDOG", "0")):
        with pytest.raises(ConfigError, match=f"decode.env: {name} '{value}': pd-serve sets it to"):
            build_app_with({"decode": {"env": {name: value}}}, Plugins())
    assert build_app_with({"decode": {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_NUM_THREADS": "1"}}}, Plugins())


def test_an_engine_drain_shorter_than_its_last_steps_is_refused():
    """A stopping engine needs Serve's wait loop, the margin before Serve's kill and the drain's
    last second (which aborts what is held, so its streams end as moved): under 3.5 s its streams
    would end as failures, each an attempt counted against max_attempts."""
    with pytest.raises(ConfigError, match="decode.graceful_shutdown_timeout_s"):
        load_config({"decode": {"graceful_shutdown_timeout_s": 1}})
    assert load_config({"decode": {"graceful_shutdown_timeout_s": 4}})


def test_pools_take_serves_own_scaling_options():
    """num_replicas (an int or auto) and autoscaling_config, checked by Ray Serve's own model;
    the old key fails with a message naming the new one; a pool's default policy is pd-serve's."""
    with pytest.raises(ConfigError, match="'replicas' is now 'num_replicas'"):
        load_config({"decode": {"replicas": 2}})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['max_replica'\]"):
        load_config({"decode": {"autoscaling_config": {"max_replica": 3}}})
    with pytest.raises(ConfigError, match="max_replicas"):
        load_config({"decode": {"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}}})
    with pytest.raises(ConfigError, match="not both"):
        load_config({"decode": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}})
    with pytest.raises(ConfigError, match="cannot import the policy"):
        load_config({"decode": {"autoscaling_config": {"policy": {"policy_function": "nowhere:Policy"}}}})
    with pytest.raises(ConfigError, match="prefill cannot autoscale"):
        load_config({"prefill": {"num_replicas": "auto"}, "router": {"mode": "colocated"}})
    config = load_config(
        {"decode": {"num_replicas": "auto"}, "prefill": {"autoscaling_config": {"initial_replicas": 2, "max_replicas": 4}}}
    )
    assert config.decode.serve_options("serve_app.config.autoscaling:DecodeLoadPolicy") == {
        "num_replicas": "auto",
        "autoscaling_config": {"policy": {"policy_function": "serve_app.config.autoscaling:DecodeLoadPolicy"}},
    }
    assert config.prefill.initial_replicas == 2 and config.decode.initial_replicas == 1
    own = {"policy_function": "serve_app.config.autoscaling:SLOPolicy", "policy_kwargs": {"ttft_p90_s": 0.5}}
    kept = load_config({"prefill": {"autoscaling_config": {"max_replicas": 4, "policy": own}}}).prefill.serve_options("x:Y")
    assert kept["autoscaling_config"]["policy"] == own and "num_replicas" not in kept
    # Beside num_replicas: auto, Serve lays the config over its defaults (max_replicas 100).
    auto = load_config({"decode": {"num_replicas": "auto", "autoscaling_config": {"min_replicas": 2}}})
    assert (auto.decode.min_replicas, auto.decode.max_replicas) == (2, 100)
    # target_ongoing_requests is Serve's default policy's: pd-serve's would ignore it.
    with pytest.raises(ConfigError, match="target_ongoing_requests is read by Serve's default policy only"):
        load_config({"decode": {"autoscaling_config": {"max_replicas": 2, "target_ongoing_requests": 4}}})
    # A config dumped (as the app hands it to its replicas) loads again unchanged.
    assert load_config(config.model_dump(mode="json")) == config


def test_the_body_limit_must_hold_a_full_length_prompt():
    """Else every long prompt would be a 413: refused when the config is loaded, naming the key;
    left unset, the limit grows with max_model_len instead."""
    assert load_config({"max_model_len": 1_000_000}).router.http.max_body_bytes == 8_000_000
    assert load_config({}).router.http.max_body_bytes == 4 * 1024 * 1024
    with pytest.raises(ConfigError, match="router.http.max_body_bytes"):
        load_config({"max_model_len": 4096, "router": {"http": {"max_body_bytes": 16 * 1024}}})
    assert load_config({"max_model_len": 1_000_000, "router": {"http": {"max_body_bytes": 8_000_000}}}).max_model_len == 1_000_000


def test_build_app_fails_at_start_on_bad_args():
    from serve_app.app import build_app

    with pytest.raises(ConfigError, match="router.mode"):
        build_app({"router": {"mode": "sideways"}})


def test_a_redeploy_starts_the_new_router_replicas_before_it_stops_the_old():
    """Serve versions every deployment of an app by the app's args, so a change to any of them
    (a decode engine argument) restarts the router replicas too. By default Serve's rolling update
    stops a replica before starting its replacement, and a lone router's port would refuse
    connections meanwhile: the router surges (router.max_surge_percent, 100 by default) and its
    old replicas stop once the new ones listen. The engine pools keep Serve's default unless set."""
    from serve_app.app import build_app

    def surges(args):
        router = build_app(args)._bound_deployment
        engines = {role: e._bound_deployment for role, e in router.init_args[1].items()}
        return router._deployment_config.max_surge_percent, {r: e._deployment_config.max_surge_percent for r, e in engines.items()}

    assert load_config({}).router.max_surge_percent == 100
    assert surges({}) == (100, {"prefill": 0, "decode": 0})
    assert surges({"router": {"max_surge_percent": 0}, "prefill": {"max_surge_percent": 100}}) == (0, {"prefill": 100, "decode": 0})


def test_a_cluster_too_small_for_the_pools_at_their_most_is_named_at_start(caplog, monkeypatch):
    """max_replicas beyond what the cluster's CPUs can place: a warning at start naming the keys
    (replicas past it stay PENDING until nodes join), not an error: clusters grow."""
    import ray

    from serve_app.app import build_app

    args = {"decode": {"num_cpus": 0.5, "autoscaling_config": {"min_replicas": 1, "max_replicas": 8}}}
    config = load_config(args)
    short = config.cpus_short_of(2.0)
    assert short is not None and "decode.autoscaling_config.max_replicas 8 x num_cpus 0.5" in short and "prefill.num_replicas 1" in short
    assert "need 4.6 CPUs" in short  # 0.5 prefill + 8 x 0.5 decode + 0.1 router
    assert config.cpus_short_of(4.6) is None and load_config({}).cpus_short_of(2.0) is None
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with caplog.at_level("WARNING", logger="pd_serve.app"):
        build_app(args)
    assert any("decode.autoscaling_config.max_replicas 8" in r.getMessage() for r in caplog.records)


def test_tensor_parallel_on_the_cpu_backend_is_checked_at_load():
    """vLLM's CPU engine binds each tensor-parallel rank to its own cores: 'auto' (one core per
    engine) made the engine fail at start, and the CPU connector moves one rank's KV."""
    colocated = {"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}
    with pytest.raises(ConfigError, match="one set of cores per rank"):
        load_config({**colocated, "engine_kwargs": {"tensor_parallel_size": 2}})
    bound = load_config({**colocated, "decode": {"engine_kwargs": {"tensor_parallel_size": 2}, "cpu_bind": ["0|1"]}})
    assert bound.decode.cpu_bind == ["0|1"]
    with pytest.raises(ConfigError, match="KV connector moves one rank"):
        load_config({"decode": {"engine_kwargs": {"tensor_parallel_size": 2}, "cpu_bind": ["0|1"]}})
    # Pipeline ranks are workers too, each with its own cores; a list entry must give each rank its set.
    with pytest.raises(ConfigError, match="pipeline_parallel_size 2 needs one set of cores per rank"):
        load_config({**colocated, "engine_kwargs": {"pipeline_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"cpu_bind entry '0-3': tensor_parallel_size 2 needs 2 sets"):
        load_config({**colocated, "decode": {"engine_kwargs": {"tensor_parallel_size": 2}, "cpu_bind": ["0-3"]}})
    with pytest.raises(ConfigError, match="KV connector moves one rank"):
        load_config({"engine_kwargs": {"pipeline_parallel_size": 2}, "decode": {"cpu_bind": ["0|1"]}, "prefill": {"cpu_bind": ["0|1"]}})
    # Other backends bind their own devices.
    assert load_config({"backend": "mock", "engine_kwargs": {"tensor_parallel_size": 2}}).backend == "mock"


def test_a_tool_call_parser_is_checked_when_the_app_is_built():
    """A misspelt parser fails `serve run` at once, naming the parsers vLLM has, rather than each
    router replica's start after the engines have loaded; a plugin needs the parser's name."""
    from serve_app.app import build_app

    with pytest.raises(ConfigError, match=r"router.tool_call_parser: vLLM has no tool parser named 'hermse' \(it has: .*hermes"):
        build_app({"router": {"tool_call_parser": "hermse"}})
    with pytest.raises(ConfigError, match="name it in router.tool_call_parser"):
        load_config({"router": {"tool_parser_plugin": "/opt/parsers/mine.py"}})
    assert load_config({"router": {"tool_call_parser": "hermes"}}).router.tool_call_parser == "hermes"


def test_a_prefill_pool_past_the_kv_side_channels_connection_bounds_is_named():
    """Each prefill worker keeps a connection to every decode engine: a 17th prefill engine on one
    host (a rolling update of 9 doubles them) was refused by every decode engine, for good."""
    assert load_config({}).side_channel_short() is None
    big = {"prefill": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 9}}}
    assert "up to 18 prefill engines" in load_config(big).side_channel_short()
    raised = {**big, "kv_connector_extra_config": {"max_connections": 64, "max_connections_per_peer": 32}}
    assert load_config(raised).side_channel_short() is None
    assert load_config({**big, "backend": "ascend", "model": "/m"}).side_channel_short() is None  # Mooncake's own channel
