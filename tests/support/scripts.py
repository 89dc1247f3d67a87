"""The benchmark scripts (scripts/*.py) as modules, for the tests of their pure parts."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@contextlib.contextmanager
def scripts_loaded(*names: str) -> Iterator[dict[str, ModuleType]]:
    """Load ``names`` (in order) from scripts/, where they import each other as top-level
    modules; afterwards forget every module loaded from scripts/, so no test sees another's."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        modules = {}
        for name in names:
            spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while it loads
            spec.loader.exec_module(module)
            modules[name] = module
        yield modules
    finally:
        sys.path.remove(str(SCRIPTS))
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").parent == SCRIPTS:
                sys.modules.pop(name, None)
