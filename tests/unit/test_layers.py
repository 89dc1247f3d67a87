"""The package's layers (docs/design.md, "Layers"): a module imports only from its own package or
from a layer below it, and the router and the engines meet only in the layers below both. Read
from the source's import statements (every one, also those inside functions), without importing
anything, so a new upward import fails here and not as an import cycle on some later day."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "serve_app"

# Lowest first. A package may import from any layer with a lower number; packages on one layer
# never import each other.
LAYERS: dict[str, int] = {
    "runtime": 0,  # process-level utilities: HTTP server, logs, metrics, ports, heap, CPU placement, version switches
    "wire": 1,  # what router and engines exchange: protocol types, frames, sampling
    "vllm_plugins": 2,  # code vLLM loads into its own processes
    "kv": 2,  # the KV connector and the recompute scheduler, inside vLLM's processes
    "config": 3,  # settings, engine backends, autoscaling policies
    "engines": 4,  # engine replicas and the runners behind them
    "router": 4,  # the ingress, the schedule, the pool
    "app": 5,  # the Serve application: binds it all
}


def package_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "serve_app", module
    return parts[1] if len(parts) > 1 else "app"


def imports_of(path: Path) -> set[str]:
    """Every ``serve_app`` module this file imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("serve_app"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serve_app"):
            if node.module == "serve_app":  # "from serve_app import x": x is a package or module
                found.update(f"serve_app.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def own_package(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else "app"


def test_every_module_lives_in_a_layer():
    """No loose module at the top but the app itself: a new one must say which layer it is in."""
    assert {own_package(p) for p in modules()} <= set(LAYERS)
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py", "app.py"}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_its_own_package_or_lower_layers(path: Path):
    mine = own_package(path)
    wrong = []
    for module in sorted(imports_of(path)):
        theirs = package_of(module)
        if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
            wrong.append(f"{module} (layer {theirs}: {LAYERS[theirs]}, this module's: {mine}: {LAYERS[mine]})")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports upward or sideways: {wrong}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader above finds imports inside functions and the ``from serve_app import`` form."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from serve_app.router import pool\n\nfrom serve_app import app\nimport serve_app.wire.protocol\n")
    assert imports_of(source) == {"serve_app.router", "serve_app.app", "serve_app.wire.protocol"}
    assert package_of("serve_app.router") == "router" and package_of("serve_app.app") == "app"
