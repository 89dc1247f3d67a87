"""``build_app(args)``: the application ``configs/serve.yaml`` imports.

One router deployment (the HTTP ingress) and one single-replica deployment per engine
(``prefill-0``, ``decode-0``, ...). Every replica reserves an explicit ``num_cpus`` from the
config, so the whole app fits a small host, and engine replicas get their environment
(thread binding, loopback, offline hub) through Ray's runtime_env, where the dashboard shows it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ray.serve import Application

from serve_app.config import ConfigError, load_config
from serve_app.engines.backends import BACKENDS, EngineSpec, engine_specs, environment_problems

ENGINE_MAX_ONGOING_REQUESTS = 1024

# Serve's per-replica knobs of its throughput-optimized mode: run user code and the handle router
# on the replica's main event loop rather than on threads of their own, so a request or a
# streamed item does not hop between threads (and contend for the GIL) on its way through. Our
# replicas never block their loop for long (vLLM's AsyncLLM is async; the router's tokenization is
# short).
SERVE_REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


@dataclass(frozen=True)
class Plugins:
    """Replacement classes, from Python only (never from the config file): the deployments to run
    the engines with, and the KV connector class (``module:Class``) the engines load. The tests
    use them to put fault-injecting subclasses in place; production code paths carry no test
    branches."""

    prefill_cls: Any = None
    decode_cls: Any = None
    kv_connector: str | None = None


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The application of ``configs/serve.yaml`` (Serve calls app builders with the args alone)."""
    return build_app_with(args, Plugins())


def build_app_with(args: dict[str, Any] | None, plugins: Plugins) -> Application:
    """``build_app`` with replacement classes, for Python callers (the tests)."""
    from serve_app.engines.decode import Decode
    from serve_app.engines.prefill import Prefill
    from serve_app.router.deployment import Router

    config = load_config(args)
    engines = {}
    for spec in engine_specs(config):
        problems = environment_problems(BACKENDS[config.backend], spec.env)
        if problems:
            raise ConfigError(f"invalid pd-serve config: {spec.role}.env: " + "; ".join(problems))
        if plugins.kv_connector:
            spec = _with_connector(spec, plugins.kv_connector)
        deployment = (plugins.prefill_cls or Prefill) if spec.role == "prefill" else (plugins.decode_cls or Decode)
        engines[spec.name] = deployment.options(
            name=spec.name,
            num_replicas=1,
            max_ongoing_requests=ENGINE_MAX_ONGOING_REQUESTS,
            health_check_period_s=spec.health_check_period_s,
            health_check_timeout_s=spec.health_check_timeout_s,
            graceful_shutdown_timeout_s=5,
            # The router polls stats twice a second; access logs would be mostly that.
            logging_config={"enable_access_log": False, "encoding": config.log_encoding, "log_level": config.log_level},
            ray_actor_options={
                "num_cpus": spec.num_cpus,
                "resources": spec.resources,
                "runtime_env": {"env_vars": {**SERVE_REPLICA_ENV, **spec.env}},
            },
        ).bind(spec)
    router = config.router
    return Router.options(
        name="router",
        num_replicas=router.num_replicas,
        max_ongoing_requests=router.max_ongoing_requests,
        logging_config={"encoding": config.log_encoding, "log_level": config.log_level},
        ray_actor_options={
            "num_cpus": router.num_cpus,
            "resources": dict(router.resources),
            "runtime_env": {"env_vars": {**SERVE_REPLICA_ENV, **BACKENDS[config.backend].router_env}},
        },
    ).bind(config.model_dump(mode="json"), engines)


def _with_connector(spec: EngineSpec, connector: str) -> EngineSpec:
    module, _, cls = connector.partition(":")
    kwargs = dict(spec.engine_kwargs)
    if "kv_transfer_config" not in kwargs:
        return spec
    kwargs["kv_transfer_config"] = {**kwargs["kv_transfer_config"], "kv_connector": cls, "kv_connector_module_path": module}
    return dataclasses.replace(spec, engine_kwargs=kwargs)
