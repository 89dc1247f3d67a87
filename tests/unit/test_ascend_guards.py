"""Ascend pitfalls guarded where pd-serve can see them (issue 36, points 2-5): the recompute
switch only where vllm-ascend accepts it, and the environment an Ascend engine starts with.

The recompute rule is read from vllm-ascend 0.23.0.post1's own platform.py (the sdist that
tests/unit/test_ascend_reference.py reads) and applied to every engine of every shipped Ascend
config and of its colocated variant."""

from __future__ import annotations

import copy
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_app.app import build_app
from serve_app.config.backends import (
    ASCEND,
    CPU,
    engine_specs,
    environment_problems,
    no_proxy_with_loopback,
    prepare_engine_environment,
)
from serve_app.config.settings import ConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
SDIST = REPO_ROOT / ".cache" / "reference" / "vllm_ascend-0.23.0.post1.tar.gz"
SHIPPED = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def ascend_args() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in SHIPPED:
        for app in yaml.safe_load(path.read_text())["applications"]:
            if app["args"].get("backend") == "ascend":
                out.append((path.name, app["args"]))
                colocated = copy.deepcopy(app["args"])
                colocated["prefill"] = {**colocated.get("prefill", {}), "num_replicas": 0}
                colocated["router"] = {**colocated.get("router", {}), "mode": "colocated"}
                out.append((f"{path.name}, colocated", colocated))
    return out


CASES = ascend_args()


def platform_source() -> str:
    assert SDIST.exists(), f"{SDIST} is missing: `make test` fetches it (scripts/fetch_reference.py)"
    with tarfile.open(SDIST, "r:gz") as tar:
        member = tar.extractfile("vllm_ascend-0.23.0.post1/vllm_ascend/platform.py")
        assert member is not None
        return member.read().decode()


def vllm_ascend_accepts(engine_kwargs: dict[str, Any]) -> str | None:
    """vllm-ascend's platform.py rule for recompute_scheduler_enable, as its source states it
    (checked below): a producer ignores it, anything but a consumer raises ValueError."""
    if not engine_kwargs.get("additional_config", {}).get("recompute_scheduler_enable"):
        return None
    role = (engine_kwargs.get("kv_transfer_config") or {}).get("kv_role")
    if role == "kv_producer" or role == "kv_consumer":
        return None
    return f"ValueError: recompute_scheduler_enable on kv_role={role!r}"


def test_the_rule_is_the_one_in_vllm_ascends_platform_source():
    source = platform_source()
    assert "if ascend_config.recompute_scheduler_enable:" in source
    assert 'if kv_role == "kv_producer":' in source
    assert 'elif kv_transfer_config is None or kv_role != "kv_consumer":\n                raise ValueError(' in source


def test_there_is_a_shipped_ascend_config_and_its_colocated_variant():
    assert len(CASES) >= 2 and any("colocated" in name for name, _ in CASES)


@pytest.mark.parametrize("name,args", CASES, ids=[name for name, _ in CASES])
def test_every_ascend_engine_starts_under_vllm_ascends_recompute_rule(name, args):
    specs = engine_specs(load_config(args))
    assert specs
    for spec in specs:
        assert vllm_ascend_accepts(spec.engine_kwargs) is None, (name, spec.name)
    decode = [s for s in specs if s.role == "decode"]
    with_transfer = all("kv_transfer_config" in s.engine_kwargs for s in decode)
    # Disaggregated: recompute on every decode engine; colocated: off (no KV consumer to carry it).
    assert all(bool(s.engine_kwargs.get("additional_config", {}).get("recompute_scheduler_enable")) == with_transfer for s in decode)


def test_the_old_colocated_ascend_arguments_would_not_start():
    """What pd-serve produced before the fix, through the same rule: the check can fail."""
    kwargs = {"model": "m", "additional_config": {"recompute_scheduler_enable": True}}
    assert vllm_ascend_accepts(kwargs) is not None


@pytest.mark.parametrize(
    "name", ["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"]
)
def test_an_ascend_engine_refuses_the_variables_that_break_it(name):
    environ = {"PATH": "/bin", name: "1"}
    with pytest.raises(RuntimeError, match=name):
        prepare_engine_environment(ASCEND, environ)
    assert environment_problems(ASCEND, {name: "0"}) == [] and environment_problems(ASCEND, {name: ""}) == []
    assert environment_problems(CPU, {name: "1"}) == []  # the CPU backend needs neither guard
    args = {"backend": "ascend", "model": "/m", "decode": {"env": {name: "1"}}}
    with pytest.raises(ConfigError, match=f"decode.env: {name}"):
        build_app(args)


def test_an_ascend_engine_keeps_loopback_out_of_any_proxy():
    environ = {"HTTP_PROXY": "http://proxy:3128", "no_proxy": "example.com,127.0.0.1"}
    prepare_engine_environment(ASCEND, environ)
    for name in ("NO_PROXY", "no_proxy"):
        assert environ[name] == "example.com,127.0.0.1,localhost,::1"
    fresh: dict[str, str] = {}
    prepare_engine_environment(ASCEND, fresh)
    assert fresh["NO_PROXY"] == "127.0.0.1,localhost,::1"
    assert no_proxy_with_loopback(" a , ,b") == "a,b,127.0.0.1,localhost,::1"
    untouched: dict[str, str] = {}
    prepare_engine_environment(CPU, untouched)
    assert untouched == {}
