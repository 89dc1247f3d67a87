"""The layout of tests/ (docs/testing.md): helpers live in tests/support/, a conftest holds
fixtures and pytest hooks only, and no module imports a test module or a conftest (a test module
imported elsewhere runs its module-level code twice and hides what a helper depends on)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported(tree: ast.Module, path: Path) -> list[str]:
    """Every module an ``import`` in ``tree`` names (with ``from x import y``, both x and x.y: y
    may be a module), relative imports resolved against ``path``."""
    package = path.relative_to(TESTS.parent).with_suffix("").parts[:-1]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("pytest.fixture", "fixture")


def test_no_module_imports_a_test_module_or_a_conftest():
    found = []
    for path in modules():
        for name in imported(ast.parse(path.read_text(), str(path)), path):
            last = name.rsplit(".", 1)[-1]
            if name.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                found.append(f"{path.relative_to(TESTS.parent)} imports {name}")
    assert not found, "\n".join(found)


def test_conftest_files_hold_fixtures_and_hooks_only():
    found = []
    for path in TESTS.rglob("conftest.py"):
        tree = ast.parse(path.read_text(), str(path))
        for i, node in enumerate(tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                node.name.startswith("pytest_") or any(is_fixture(d) for d in node.decorator_list)
            ):
                continue
            found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not found, "not a fixture or a hook:\n" + "\n".join(found)


def test_helpers_live_in_tests_support():
    """Outside tests/support/, tests/ holds test modules, conftest files and packages' __init__."""
    stray = [
        str(path.relative_to(TESTS.parent))
        for path in modules()
        if "support" not in path.relative_to(TESTS).parts[:-1]
        and not (path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py"))
    ]
    assert not stray, stray


def environment_writes_on_import(tree: ast.Module) -> list[str]:
    """Statements that run on import (module level, not inside a function or a class, not under
    ``if __name__ == "__main__"``) and write ``os.environ``."""

    def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
        found = []
        for node in body:
            if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                found += top_level([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])])
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(node)
        return found

    writes = ("os.environ[", "os.environ.setdefault(", "os.environ.update(", "os.putenv(", "os.environ.pop(")
    return [ast.unparse(node).splitlines()[0] for node in top_level(tree.body) if any(w in ast.unparse(node) for w in writes)]


def test_no_test_module_or_helper_changes_the_environment_on_import():
    """The test process's environment reaches every Ray worker and engine the session starts: a
    variable set on import (say ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` by a script's module that a
    test imports for its constants) changes every app of the run. Fixtures use monkeypatch;
    scripts set theirs when they run."""
    found = []
    for path in modules():
        writes = environment_writes_on_import(ast.parse(path.read_text(), str(path)))
        found += [f"{path.relative_to(TESTS.parent)}: {line}" for line in writes]
    assert not found, found


def test_the_layout_checks_see_what_they_look_for():
    """The checks above on a module that breaks each rule (so a check that finds nothing is not
    one that cannot find anything)."""
    path = TESTS / "unit" / "test_example.py"
    tree = ast.parse(
        "import tests.unit.test_a\n"
        "from tests.unit.test_b import x\n"
        "from tests.unit import test_c\n"
        "from . import test_d\n"
        "from .conftest import y\n"
        "from tests.support.inprocess import App\n"
    )
    names = imported(tree, path)
    for name in ("tests.unit.test_a", "tests.unit.test_b", "tests.unit.test_c", "tests.unit.test_d", "tests.unit.conftest"):
        assert name in names, (name, names)
    assert not [n for n in names if n.startswith("tests.support") and n.rsplit(".", 1)[-1].startswith("test_")]
    fixture, helper = ast.parse("@pytest.fixture(scope='session')\ndef a(): pass\ndef b(): pass\n").body
    assert any(is_fixture(d) for d in fixture.decorator_list) and not helper.decorator_list
    tree = ast.parse(
        "import os\n"
        "os.environ['A'] = '1'\n"
        "if True:\n    os.environ.setdefault('B', '1')\n"
        "def f():\n    os.environ['C'] = '1'\n"
        "if __name__ == '__main__':\n    os.environ['D'] = '1'\n"
    )
    assert environment_writes_on_import(tree) == ["os.environ['A'] = '1'", "os.environ.setdefault('B', '1')"]
