"""``build_app(args)``: the application ``configs/serve.yaml`` imports.

One router deployment (the HTTP ingress) and one single-replica deployment per engine
(``prefill-0``, ``decode-0``, ...). Every replica reserves an explicit ``num_cpus`` from the
config, so the whole app fits a small host, and engine replicas get their environment
(thread binding, loopback, offline hub) through Ray's runtime_env, where the dashboard shows it.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.config import load_config
from serve_app.engines.backends import BACKENDS, engine_specs

ENGINE_MAX_ONGOING_REQUESTS = 1024


def build_app(args: dict[str, Any] | None = None) -> Application:
    from serve_app.engines.decode import Decode
    from serve_app.engines.prefill import Prefill
    from serve_app.router.deployment import Router

    config = load_config(args)
    engines = {}
    for spec in engine_specs(config):
        deployment = Prefill if spec.role == "prefill" else Decode
        engines[spec.name] = deployment.options(
            name=spec.name,
            num_replicas=1,
            max_ongoing_requests=ENGINE_MAX_ONGOING_REQUESTS,
            health_check_period_s=spec.health_check_period_s,
            health_check_timeout_s=spec.health_check_timeout_s,
            graceful_shutdown_timeout_s=5,
            # The router polls stats twice a second; access logs would be mostly that.
            logging_config={"enable_access_log": False},
            ray_actor_options={"num_cpus": spec.num_cpus, "runtime_env": {"env_vars": spec.env}},
        ).bind(spec)
    router = config.router
    return Router.options(
        name="router",
        num_replicas=router.num_replicas,
        max_ongoing_requests=router.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": router.num_cpus,
            "runtime_env": {"env_vars": dict(BACKENDS[config.backend].engine_env)},
        },
    ).bind(config.model_dump(mode="json"), engines)
