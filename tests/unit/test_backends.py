"""The engine arguments and replica settings each backend produces. The Ascend ones cannot run
here (no NPU): these checks, and tests/unit/test_ascend_reference.py's against vllm-ascend's own
source, are what stands for them."""

from __future__ import annotations

import logging

import pytest

from serve_app.config.backends import ASCEND as ASCEND_BACKEND
from serve_app.config.backends import KV_PORT_STRIDE, RECV_DEADLINE_MARGIN_S, engine_specs, prepare_engine_environment, replica_spec
from serve_app.config.settings import ConfigError, load_config
from serve_app.vllm_plugins.processes import ENGINE_CHILD_ENV


def specs_by_name(args):
    return {spec.name: spec for spec in engine_specs(load_config(args))}


ASCEND = {
    "backend": "ascend",
    "model": "/models/Qwen3-8B",
    "prefill": {"num_replicas": 2, "engine_kwargs": {"tensor_parallel_size": 4}},
    "decode": {"num_replicas": 1, "engine_kwargs": {"tensor_parallel_size": 2}},
}


def test_ascend_prefill_is_a_mooncake_layerwise_producer():
    specs = specs_by_name(ASCEND)
    kwargs = specs["prefill-0"].engine_kwargs
    ktc = kwargs["kv_transfer_config"]
    assert ktc["kv_connector"] == "MooncakeLayerwiseConnector"
    assert "kv_connector_module_path" not in ktc  # vllm-ascend registers it by name
    assert ktc["kv_role"] == "kv_producer"
    assert ktc["kv_connector_extra_config"]["prefill"] == {"dp_size": 1, "tp_size": 4}
    assert ktc["kv_connector_extra_config"]["decode"] == {"dp_size": 1, "tp_size": 2}
    assert "additional_config" not in kwargs  # vllm-ascend rejects the recompute scheduler on producers
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["model"] == "/models/Qwen3-8B"


def test_ascend_decode_is_a_consumer_with_the_recompute_scheduler():
    kwargs = specs_by_name(ASCEND)["decode-0"].engine_kwargs
    assert kwargs["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert kwargs["additional_config"] == {"recompute_scheduler_enable": True}
    assert "scheduler_cls" not in kwargs  # vllm-ascend swaps its own scheduler in


def test_ascend_decode_without_recompute():
    args = {**ASCEND, "decode": {**ASCEND["decode"], "recompute": False}}
    assert "additional_config" not in specs_by_name(args)["decode-0"].engine_kwargs


COLOCATED_ASCEND = {**ASCEND, "prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}}


def test_colocated_ascend_decode_runs_without_recompute_and_says_why(caplog):
    """vllm-ascend accepts recompute_scheduler_enable only on an engine with a KV transfer config;
    a colocated app has none, so its decode engines run without it, and their replicas say so."""
    specs = specs_by_name(COLOCATED_ASCEND)
    assert list(specs) == ["decode-0"]
    decode = specs["decode-0"]
    assert "kv_transfer_config" not in decode.engine_kwargs and "additional_config" not in decode.engine_kwargs
    (note,) = decode.notes
    assert "recompute_scheduler_enable" in note and "prefill.num_replicas: 0" in note and "decode.recompute: false" in note
    with caplog.at_level(logging.WARNING, logger="pd_serve.engine"):
        prepare_engine_environment(ASCEND_BACKEND, {}, decode.notes)
    # The note and nothing else (a test that ran before may have routed pd-serve's logs into
    # Serve's logger too, whose handlers hand caplog the same record a second time).
    assert {r.getMessage() for r in caplog.records} == {note}
    # Nothing to say where recompute is on, or where the config did not ask for it.
    assert all(not s.notes for s in specs_by_name(ASCEND).values())
    off = {**COLOCATED_ASCEND, "decode": {**ASCEND["decode"], "recompute": False}}
    assert not specs_by_name(off)["decode-0"].notes
    # The CPU backend's own scheduler needs no KV transfer config: it recomputes colocated too.
    cpu = specs_by_name({"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}})["decode-0"]
    assert cpu.engine_kwargs["scheduler_cls"].endswith("RecomputeScheduler") and not cpu.notes


def test_every_engine_gets_its_own_kv_port_block_rolling_update_replacements_too():
    specs = list(specs_by_name(ASCEND).values())
    ports = [s.engine_kwargs["kv_transfer_config"]["kv_port"] for s in specs]
    assert len(set(ports)) == len(ports) == 3
    # Decode's blocks start after twice the prefill pool (2 engines): a rolling update's
    # replacement (Serve ranks it past the running ones, prefill-2 here) has a block of its own.
    assert sorted(ports) == [36000, 36016, 36064]
    config = load_config(ASCEND)
    replacement = replica_spec(config, "prefill", config.prefill.max_replicas)
    assert replacement.engine_kwargs["kv_transfer_config"]["kv_port"] not in ports


def test_ascend_leaves_cpu_settings_out():
    for spec in specs_by_name(ASCEND).values():
        assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env
        assert "VLLM_HOST_IP" not in spec.env  # Mooncake and HCCL must see the node's own address
        assert not any(k.startswith(("PD_SERVE_ENGINE_SPIN", "PD_SERVE_ENGINE_CORE_SPIN", "PD_SERVE_ENGINE_CORE_BIND")) for k in spec.env)
        assert "kv_cache_memory_bytes" not in spec.engine_kwargs and "enforce_eager" not in spec.engine_kwargs
        assert "kv_host" not in spec.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]


def test_ascend_replicas_ask_ray_for_one_npu_per_tensor_parallel_rank():
    specs = specs_by_name(ASCEND)
    assert specs["prefill-0"].resources == {"NPU": 4.0} and specs["prefill-1"].resources == {"NPU": 4.0}
    assert specs["decode-0"].resources == {"NPU": 2.0}
    # CPU and mock engines ask for CPUs only.
    assert all(not s.resources for s in specs_by_name({"prefill": {"num_replicas": 1}}).values())


def test_ascend_engines_carry_vllm_ascends_environment_and_the_groups_own():
    args = {**ASCEND, "decode": {**ASCEND["decode"], "env": {"HCCL_BUFFSIZE": "600", "OMP_NUM_THREADS": "4"}}}
    specs = specs_by_name(args)
    for spec in specs.values():
        assert spec.env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
        assert spec.env["TASK_QUEUE_ENABLE"] == "1" and spec.env["OMP_PROC_BIND"] == "false"
        assert spec.env[ENGINE_CHILD_ENV] == "1"
    assert specs["decode-0"].env["HCCL_BUFFSIZE"] == "600" and specs["decode-0"].env["OMP_NUM_THREADS"] == "4"
    assert "HCCL_BUFFSIZE" not in specs["prefill-0"].env and specs["prefill-0"].env["OMP_NUM_THREADS"] == "10"


def test_a_groups_resources_replace_the_default_for_placement():
    args = {**ASCEND, "prefill": {**ASCEND["prefill"], "resources": {"NPU": 4, "pd_prefill": 0.01}}}
    specs = specs_by_name(args)
    assert specs["prefill-0"].resources == {"NPU": 4.0, "pd_prefill": 0.01}
    assert specs["decode-0"].resources == {"NPU": 2.0}


def test_the_shipped_ascend_config_loads_and_builds_engines():
    import yaml

    from serve_app.config.settings import REPO_ROOT

    doc = yaml.safe_load((REPO_ROOT / "configs" / "serve-ascend.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    specs = specs_by_name(app["args"])
    assert [s.name for s in specs.values()] == ["prefill-0", "decode-0", "decode-1"]
    assert specs["prefill-0"].resources == {"NPU": 4.0} and specs["decode-1"].resources == {"NPU": 2.0}
    assert specs["decode-0"].engine_kwargs["additional_config"] == {"recompute_scheduler_enable": True}
    assert doc["proxy_location"] == "Disabled" and app["args"]["router"]["http"]["port"] == 8000


def test_cpu_defaults_bound_the_kv_cache_and_bind_threads():
    specs = specs_by_name({"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}})
    for spec in specs.values():
        assert spec.engine_kwargs["kv_cache_memory_bytes"] > 0
        assert spec.engine_kwargs["enforce_eager"] is True
        assert spec.engine_kwargs["dtype"] == "float32"
        assert spec.env["VLLM_HOST_IP"] == "127.0.0.1"
        # Engine processes spin briefly for their next step, and the core more briefly still for
        # a forward (vllm_plugins/spin.py); a group's env can change either.
        assert float(spec.env["PD_SERVE_ENGINE_CORE_SPIN_S"]) < float(spec.env["PD_SERVE_ENGINE_SPIN_S"]) <= 0.01
        # Its engine core runs on its workers' cores (vllm_plugins/core_affinity.py).
        assert spec.env["PD_SERVE_ENGINE_CORE_BIND"] == "1"
    binds = {spec.env["VLLM_CPU_OMP_THREADS_BIND"] for spec in specs.values()}
    assert len(binds) == min(2, __import__("os").cpu_count() or 1)


def test_engine_kwargs_precedence():
    specs = specs_by_name(
        {
            "engine_kwargs": {"max_num_seqs": 8, "kv_cache_memory_bytes": 1 << 20},
            "decode": {"engine_kwargs": {"max_num_seqs": 4}},
            "max_model_len": 1024,
        }
    )
    assert specs["decode-0"].engine_kwargs["max_num_seqs"] == 4
    assert specs["prefill-0"].engine_kwargs["max_num_seqs"] == 8
    assert specs["decode-0"].engine_kwargs["kv_cache_memory_bytes"] == 1 << 20
    assert specs["decode-0"].engine_kwargs["max_model_len"] == 1024


def test_cpu_bind_list_and_nobind():
    specs = specs_by_name({"decode": {"num_replicas": 2, "cpu_bind": ["1", "0"]}, "prefill": {"cpu_bind": "nobind"}})
    assert specs["decode-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert specs["decode-1"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert specs["prefill-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # An engine whose threads are not bound leaves its engine core's placement alone too.
    assert "PD_SERVE_ENGINE_CORE_BIND" not in specs["prefill-0"].env
    assert specs["decode-0"].env["PD_SERVE_ENGINE_CORE_BIND"] == "1"


def test_cpu_engines_load_the_layerwise_connector_when_prefill_engines_exist():
    specs = specs_by_name({"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 2}})
    prefill = specs["prefill-0"].engine_kwargs["kv_transfer_config"]
    decode = specs["decode-1"].engine_kwargs["kv_transfer_config"]
    assert prefill["kv_connector"] == decode["kv_connector"] == "LayerwisePushConnector"
    assert prefill["kv_connector_module_path"] == "serve_app.kv.layerwise_connector"
    assert (prefill["kv_role"], decode["kv_role"]) == ("kv_producer", "kv_consumer")
    assert decode["kv_port"] == specs["decode-1"].kv_port
    # The engine's name is its KV engine id: the router checks it in every KVReady.
    assert (prefill["engine_id"], decode["engine_id"]) == ("prefill-0", "decode-1")
    colocated = specs_by_name({"prefill": {"num_replicas": 0}, "router": {"mode": "colocated"}})
    assert "kv_transfer_config" not in colocated["decode-0"].engine_kwargs


def test_decode_receive_deadline_follows_the_router_timeouts():
    specs = specs_by_name({"router": {"timeouts": {"kv_ready_s": 7, "prefill_s": 11}}})
    extra = specs["decode-0"].engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["recv_timeout_s"] == 7 + 11 + RECV_DEADLINE_MARGIN_S
    # A receive deadline in the config (which would undercut the router's) is refused at load.
    with pytest.raises(ConfigError, match="recv_timeout_s is set by pd-serve itself"):
        specs_by_name({"kv_connector_extra_config": {"recv_timeout_s": 1}})


def test_every_engine_process_gets_the_parent_watchdog():
    for backend in ("cpu", "ascend"):
        for spec in specs_by_name({"backend": backend}).values():
            assert spec.env[ENGINE_CHILD_ENV] == "1"


def test_cpu_decode_engines_use_the_recompute_scheduler():
    specs = specs_by_name({"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}})
    assert specs["decode-0"].engine_kwargs["scheduler_cls"] == "serve_app.kv.recompute_scheduler.RecomputeScheduler"
    assert "scheduler_cls" not in specs["prefill-0"].engine_kwargs
    off = specs_by_name({"decode": {"recompute": False}})
    assert "scheduler_cls" not in off["decode-0"].engine_kwargs


def test_decode_hands_either_connector_the_relay_as_metaserver():
    """Ascend parity: the same decode deployment serves both backends. What reaches the engine is
    vllm-ascend's decode-first request (its layerwise proxy sends do_remote_prefill=True,
    do_remote_decode=False and a metaserver URL), with the replica's own relay as that URL."""
    from serve_app.engines.metaserver import with_relay

    router_params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "cmpl-1-1"}
    params = with_relay(router_params, "http://127.0.0.1:5555/v1/metaserver")
    assert params == {**router_params, "metaserver": "http://127.0.0.1:5555/v1/metaserver"}
    assert router_params.get("metaserver") is None  # the router's dict is left alone
    for backend in ("cpu", "ascend"):
        decode = specs_by_name({"backend": backend})["decode-0"].engine_kwargs["kv_transfer_config"]
        assert decode["kv_role"] == "kv_consumer"


def test_the_app_hands_each_roles_resources_and_environment_to_ray():
    from serve_app.app import build_app

    app = build_app(ASCEND)
    engines = app._bound_deployment.init_args[1]
    options = {name: e._bound_deployment.ray_actor_options for name, e in engines.items()}
    assert options["prefill"]["resources"] == {"NPU": 4.0} and options["decode"]["resources"] == {"NPU": 2.0}
    env = options["decode"]["runtime_env"]["env_vars"]
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True" and "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_placement_by_custom_resources_for_every_role():
    from serve_app.app import build_app

    args = {
        "prefill": {"num_replicas": 1, "resources": {"pd_node1": 0.01}},
        "decode": {"num_replicas": 2, "resources": {"pd_decode": 1}},
        "router": {"resources": {"pd_node1": 0.01}},
    }
    app = build_app(args)
    router = app._bound_deployment
    engines = router.init_args[1]
    assert router.ray_actor_options["resources"] == {"pd_node1": 0.01}
    assert engines["prefill"]._bound_deployment.ray_actor_options["resources"] == {"pd_node1": 0.01}
    assert engines["decode"]._bound_deployment.ray_actor_options["resources"] == {"pd_decode": 1.0}
    # The default: CPUs only, Ray places engines wherever they fit.
    default = build_app({"prefill": {"num_replicas": 1}})
    assert default._bound_deployment.ray_actor_options["resources"] == {}
    assert all(not e._bound_deployment.ray_actor_options["resources"] for e in default._bound_deployment.init_args[1].values())


def test_mock_engines_get_no_cpu_placement_or_spin_settings():
    for spec in specs_by_name({"backend": "mock", "prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}).values():
        assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env
        assert not any(k.startswith("PD_SERVE_ENGINE_") for k in spec.env)


def test_replicas_keep_off_every_engines_cores_unless_told_otherwise():
    two = {"prefill": {"num_replicas": 1, "cpu_bind": ["2-3"]}, "decode": {"num_replicas": 2, "cpu_bind": ["0", "nobind"]}}
    for spec in specs_by_name(two).values():
        assert spec.engines_cores == (0, 2, 3)  # the nobind engine holds no core
    for spec in specs_by_name({**two, "replica_cpus": "all"}).values():
        assert spec.engines_cores == ()
    for args in (ASCEND, {"backend": "mock"}):
        assert all(spec.engines_cores == () for spec in specs_by_name(args).values())


def test_every_replica_logs_at_the_apps_log_level_and_encoding():
    from serve_app.app import build_app

    for args, level in (({}, "INFO"), ({"log_level": "DEBUG", "log_encoding": "JSON"}, "DEBUG")):
        app = build_app({"prefill": {"num_replicas": 1}, **args})
        router = app._bound_deployment
        configs = [router._deployment_config.logging_config] + [
            e._bound_deployment._deployment_config.logging_config for e in router.init_args[1].values()
        ]
        assert len(configs) == 3
        for config in configs:
            assert config["log_level"] == level and config["encoding"] == args.get("log_encoding", "TEXT")


def test_each_role_is_one_deployment_scaled_by_serve_and_routed_by_pd_serve():
    """Pools: one deployment per role, Serve's own num_replicas / autoscaling_config, pd-serve's
    request router on the engines (pinned calls, membership), and a drain within Serve's
    graceful shutdown timeout."""
    from serve_app.app import ENGINE_REQUEST_ROUTER, build_app

    app = build_app(
        {
            "prefill": {"num_replicas": 2},
            "decode": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 6}, "graceful_shutdown_timeout_s": 20},
            "router": {"num_replicas": "auto"},
        }
    )
    router = app._bound_deployment
    engines = {role: e._bound_deployment for role, e in router.init_args[1].items()}
    assert set(engines) == {"prefill", "decode"}
    prefill, decode = engines["prefill"], engines["decode"]
    assert prefill.num_replicas == 2 and prefill._deployment_config.autoscaling_config is None
    scaling = decode._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 6)
    assert scaling.policy.policy_function == "serve_app.config.autoscaling:DecodeLoadPolicy"
    assert router._deployment_config.autoscaling_config.policy.policy_function == "serve_app.config.autoscaling:RouterLoadPolicy"
    for deployment in engines.values():
        config = deployment._deployment_config
        assert config.request_router_config.request_router_class == ENGINE_REQUEST_ROUTER
    assert decode._deployment_config.graceful_shutdown_timeout_s == 20
    pool_spec, drain_s = decode.init_args
    assert pool_spec.role == "decode" and 0 < drain_s < 20
    # Each replica's own spec follows from its rank: name, KV port block, a unique KV engine id.
    first, second = pool_spec.for_rank(0, "aaaa"), pool_spec.for_rank(1, "bbbb")
    assert (first.name, second.name) == ("decode-0", "decode-1")
    assert second.kv_port - first.kv_port == KV_PORT_STRIDE
    ids = {spec.engine_kwargs["kv_transfer_config"]["engine_id"] for spec in (first, second)}
    assert ids == {"decode-0-aaaa", "decode-1-bbbb"}
    # A prefill rank past what args leaves room for (a deployment override raised the pool)
    # would share decode's first port block: its replica says so at start.
    prefill_spec, _ = prefill.init_args
    assert prefill_spec.port_ranks == 4 and pool_spec.beyond_args(50) is None
    assert prefill_spec.beyond_args(3) is None
    assert "raise the pool's count or max_replicas in args" in prefill_spec.beyond_args(4)
    assert prefill_spec.for_rank(4).kv_port == first.kv_port  # the overlap it warns of


RESUMED = "serve_app.vllm_plugins.resumed_output:ResumedOutputLogitsProcessor"


def test_cpu_decode_engines_load_the_resumed_output_logits_processor():
    """Every decode engine (colocated ones too: attempts also resume after a move or a lost
    engine), after a user's own processors; never prefill engines (their one token is dropped),
    nor with speculative decoding (vLLM refuses custom logits processors there)."""
    specs = specs_by_name({"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}})
    assert specs["decode-0"].engine_kwargs["logits_processors"] == [RESUMED]
    assert "logits_processors" not in specs["prefill-0"].engine_kwargs
    colocated = specs_by_name({"router": {"mode": "colocated"}, "prefill": {"num_replicas": 0}})
    assert colocated["decode-0"].engine_kwargs["logits_processors"] == [RESUMED]
    own = specs_by_name({"decode": {"engine_kwargs": {"logits_processors": ["mine:Proc"]}}})
    assert own["decode-0"].engine_kwargs["logits_processors"] == ["mine:Proc", RESUMED]
    speculative = {"decode": {"engine_kwargs": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}}}
    assert "logits_processors" not in specs_by_name(speculative)["decode-0"].engine_kwargs


def test_ascend_and_mock_decode_engines_load_no_logits_processor():
    assert "logits_processors" not in specs_by_name(ASCEND)["decode-0"].engine_kwargs
    assert "logits_processors" not in specs_by_name({"backend": "mock"})["decode-0"].engine_kwargs


def test_an_engine_does_not_start_without_pd_serves_plugins():
    """Installed (pd-serve on the path only has no entry points for vLLM to find) and allowed by
    an operator's VLLM_PLUGINS: without them an engine runs wrong (a grammar or seeded sampling
    starts over on a resumed attempt) or breakable (a seeded prompt in chunks kills a CPU engine)."""
    import tomllib

    from serve_app.config.backends import CPU, MOCK, environment_problems
    from serve_app.config.settings import REPO_ROOT
    from serve_app.vllm_plugins import ENTRY_POINT_GROUP, ENTRY_POINTS, plugin_problems

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert set(declared) == set(ENTRY_POINTS)
    assert plugin_problems({}) == [] and environment_problems(CPU, {}) == []  # installed, no allowlist
    assert plugin_problems({"VLLM_PLUGINS": ",".join(ENTRY_POINTS) + ",another"}) == []
    (problem,) = environment_problems(CPU, {"VLLM_PLUGINS": "another"})
    assert "VLLM_PLUGINS leaves out" in problem and "pd_serve_seeded_sampling" in problem
    assert environment_problems(MOCK, {"VLLM_PLUGINS": "another"}) == []  # no vLLM engine there


def test_auto_binding_gives_the_engines_the_app_starts_with_a_core_each(monkeypatch):
    """configs/serve-autoscale.yaml on 2 cores: decode's rank 0 came after the most prefill
    engines there can be (2), and so took core 0 beside prefill-0, the router alone on core 1."""
    import yaml

    from serve_app.config import backends
    from tests.support.cluster import REPO_ROOT

    monkeypatch.setattr(backends, "usable_cores", lambda: [0, 1])
    (app,) = yaml.safe_load((REPO_ROOT / "configs" / "serve-autoscale.yaml").read_text())["applications"]
    config = load_config(app["args"])
    assert config.prefill.max_replicas + config.decode.max_replicas > 2
    binds = {s.name: s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in engine_specs(config)}
    assert binds == {"prefill-0": "0", "decode-0": "1"}
    # Where the host has a core for every engine the pools may grow to, none ever shares one.
    monkeypatch.setattr(backends, "usable_cores", lambda: list(range(8)))
    grown = [replica_spec(config, role, rank).env["VLLM_CPU_OMP_THREADS_BIND"] for role in ("prefill", "decode") for rank in range(2)]
    assert grown == ["0", "1", "2", "3"]
    # Where it has not, decode's most engines still get cores of their own, and the prefill
    # engines added first do not land on decode's.
    monkeypatch.setattr(backends, "usable_cores", lambda: list(range(16)))
    big = load_config(
        {"prefill": {"autoscaling_config": {"max_replicas": 12}}, "decode": {"autoscaling_config": {"max_replicas": 8}}}
    )
    prefill = [replica_spec(big, "prefill", rank).env["VLLM_CPU_OMP_THREADS_BIND"] for rank in range(8)]
    decode = [replica_spec(big, "decode", rank).env["VLLM_CPU_OMP_THREADS_BIND"] for rank in range(8)]
    assert prefill == [str(c) for c in range(8)] and decode == [str(c) for c in range(8, 16)]


def test_auto_binding_stays_within_the_cores_the_process_may_use(monkeypatch):
    """In a container whose cpuset is cores 8-11 of a bigger host, a binding to core 0 fails the
    engine's start (libgomp refuses it): engines go round the usable cores, not 0..cpu_count."""
    from serve_app.config import backends

    monkeypatch.setattr(backends, "usable_cores", lambda: [8, 9, 10, 11])
    specs = specs_by_name({"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 2}})
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs.values()] == ["8", "9", "10"]
    assert specs["decode-0"].engines_cores == (8, 9, 10)


def test_replicas_stay_off_the_hub_only_for_a_model_in_a_local_directory(tmp_path):
    """A local model needs nothing from the hub; a model named by its hub id was made offline
    too (the router then failed at start wherever the model was not cached yet)."""
    from serve_app.config.backends import router_env

    local = load_config({"model": str(tmp_path)})
    assert router_env(local)["HF_HUB_OFFLINE"] == "1"
    assert all(s.env["HF_HUB_OFFLINE"] == "1" for s in engine_specs(local))
    hub_tokenizer = load_config({"model": str(tmp_path), "engine_kwargs": {"tokenizer": "Qwen/Qwen2.5-0.5B-Instruct"}})
    assert "HF_HUB_OFFLINE" not in router_env(hub_tokenizer)  # the router fetches the tokenizer
    hub = load_config({"model": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert "HF_HUB_OFFLINE" not in router_env(hub)
    assert all("HF_HUB_OFFLINE" not in s.env for s in engine_specs(hub))
    assert "HF_HUB_OFFLINE" not in router_env(load_config({"backend": "ascend", "model": str(tmp_path)}))


def test_an_operators_memory_share_replaces_the_cpu_backends_kv_cache_bound():
    """vLLM takes kv_cache_memory_bytes over gpu_memory_utilization: the backend's 256 MiB made an
    operator's gpu_memory_utilization do nothing."""
    shared = specs_by_name({"engine_kwargs": {"gpu_memory_utilization": 0.5}})["decode-0"].engine_kwargs
    assert shared["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in shared
    both = specs_by_name({"decode": {"engine_kwargs": {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 30}}})
    assert both["decode-0"].engine_kwargs["kv_cache_memory_bytes"] == 1 << 30
    assert specs_by_name({})["decode-0"].engine_kwargs["kv_cache_memory_bytes"] == 256 << 20
