"""``build_app(args)``: the application ``configs/serve.yaml`` imports.

Three deployments: ``router`` (the HTTP ingress), ``prefill`` and ``decode``, each role's engines
being the replicas of its deployment. Their counts are Serve's: ``num_replicas``, or an
``autoscaling_config`` whose policy reads the load each engine reports (serve_app/config/autoscaling.py).
The engine deployments route calls with pd-serve's request router (router/replica_router.py), so
the schedule's choice of replica is the one called, and every router learns of replicas as Serve
starts and stops them. Every replica reserves an explicit ``num_cpus`` from the config, so the
whole app fits a small host, and engine replicas get their environment (thread binding, loopback,
offline hub) through Ray's runtime_env, where the dashboard shows it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ray.serve import Application

from serve_app.config.autoscaling import DEFAULT_POLICY
from serve_app.config.backends import BACKENDS, environment_problems, pool_spec, replica_spec, replicas_keep_off, router_env
from serve_app.config.settings import ConfigError, load_config

logger = logging.getLogger("pd_serve.app")

ENGINE_REQUEST_ROUTER = "serve_app.router.replica_router:EngineRequestRouter"
# How often a stopping engine replica checks Serve's own count of its requests before Serve calls
# its destructor, which waits for the engine itself to be empty (engines/server.py): the router's
# HTTP calls are not in Serve's count, so the destructor's wait is the one that matters.
SHUTDOWN_WAIT_LOOP_S = 0.5
# What a stopping replica leaves of graceful_shutdown_timeout_s for Serve's own steps.
SHUTDOWN_MARGIN_S = 2.0

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


def _warn_if_cluster_is_short(config: Any) -> None:
    """Say so at start when the cluster's CPUs cannot hold every pool at its most (not an error:
    a cluster that grows places them later)."""
    import ray

    if not ray.is_initialized():
        return
    short = config.cpus_short_of(float(ray.cluster_resources().get("CPU", 0.0)))
    if short:
        logger.warning("pd-serve config: %s", short)


def _warn_if_prefill_idle(config: Any) -> None:
    for problem in (config.idle_prefill(), config.side_channel_short()):
        if problem:
            logger.warning("pd-serve config: %s", problem)


def _check_tool_parser(config: Any) -> None:
    """A tool-call parser vLLM does not have fails ``serve run`` here, not each router replica's
    start (which loads it with the tokenizer and checks that they fit)."""
    name = config.router.tool_call_parser
    if not name or config.router.tool_parser_plugin:  # a plugin's parsers exist once it runs, on the router's node
        return
    from serve_app.router.output_parsers import check_known

    try:
        check_known(tool=name)
    except ValueError as exc:
        raise ConfigError(f"invalid pd-serve config: {exc}") from None


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The application of ``configs/serve.yaml`` (Serve calls app builders with the args alone)."""
    return build_app_with(args, Plugins())


def build_app_with(args: dict[str, Any] | None, plugins: Plugins) -> Application:
    """``build_app`` with replacement classes, for Python callers (the tests)."""
    from ray.serve.config import RequestRouterConfig

    from serve_app.engines.decode import Decode
    from serve_app.engines.prefill import Prefill
    from serve_app.router.deployment import Router

    config = load_config(args)
    _check_tool_parser(config)
    _warn_if_cluster_is_short(config)
    _warn_if_prefill_idle(config)
    config_data = config.deployment_args()
    cores = list(replicas_keep_off(config))
    engines = {}
    roles = ("prefill", "decode") if config.has_prefill() else ("decode",)
    for role in roles:
        group = getattr(config, role)
        first = replica_spec(config, role, 0)  # the options every replica of the role shares
        problems = environment_problems(BACKENDS[config.backend], first.env)
        if problems:
            raise ConfigError(f"invalid pd-serve config: {role}.env: " + "; ".join(problems))
        deployment = (plugins.prefill_cls or Prefill) if role == "prefill" else (plugins.decode_cls or Decode)
        drain_s = max(0.0, group.graceful_shutdown_timeout_s - SHUTDOWN_WAIT_LOOP_S - SHUTDOWN_MARGIN_S)
        spec = pool_spec(config, role, plugins.kv_connector)
        engines[role] = deployment.options(
            name=role,
            **group.serve_options(DEFAULT_POLICY[role]),
            max_ongoing_requests=group.max_ongoing_requests,
            health_check_period_s=first.health_check_period_s,
            health_check_timeout_s=first.health_check_timeout_s,
            graceful_shutdown_timeout_s=group.graceful_shutdown_timeout_s,
            graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
            **({"max_surge_percent": group.max_surge_percent} if group.max_surge_percent is not None else {}),
            request_router_config=RequestRouterConfig(request_router_class=ENGINE_REQUEST_ROUTER),
            # The router polls every engine's stats (router.stats_interval_s); access logs would be mostly that.
            logging_config={"enable_access_log": False, "encoding": config.log_encoding, "log_level": config.log_level},
            ray_actor_options={
                "num_cpus": first.num_cpus,
                "resources": first.resources,
                "runtime_env": {"env_vars": {**SERVE_REPLICA_ENV, **first.env}},
            },
        ).bind(spec, drain_s)
    router = config.router
    return Router.options(
        name="router",
        **router.serve_options(DEFAULT_POLICY["router"]),
        max_ongoing_requests=router.max_ongoing_requests,
        graceful_shutdown_timeout_s=router.graceful_shutdown_timeout_s,
        # A change to any of the app's args restarts the router replicas too (Serve versions every
        # deployment of an app by its args): replacements listen before the old ones stop.
        max_surge_percent=router.max_surge_percent,
        logging_config={"encoding": config.log_encoding, "log_level": config.log_level},
        ray_actor_options={
            "num_cpus": router.num_cpus,
            "resources": dict(router.resources),
            "runtime_env": {"env_vars": {**SERVE_REPLICA_ENV, **router_env(config)}},
        },
    ).bind(config_data, engines, cores)
