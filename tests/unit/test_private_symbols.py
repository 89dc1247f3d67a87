"""The manifest of other libraries' private symbols pd-serve relies on
(serve_app/runtime/private_symbols.py): every entry holds on the installed vLLM, torch, Ray,
uvicorn and transformers; a changed symbol is reported by name; the plug-ins stand aside on one;
and a private name used in serve_app without an entry fails here.

Runs on vLLM 0.32 and, through tests/unit/test_on_vllm_023.py, on vLLM 0.23, where the entries
whose ``vllm`` field does not name 0.23 are skipped.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import logging
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest

import serve_app
from serve_app.runtime import private_symbols
from serve_app.runtime.private_symbols import CALLABLE, CLASS, INSTANCE_ATTRIBUTE, INT, MANIFEST, MODULE, Symbol, check, unchanged

PACKAGE = Path(serve_app.__file__).resolve().parent
VLLM = private_symbols.vllm_version()
CPU_PATH = pytest.mark.skipif(VLLM not in private_symbols.CPU, reason="serve_app/kv runs on the CPU path's vLLM only")
LIBRARIES = {"vllm", "torch", "ray", "uvicorn", "transformers"}
COVERED = {s.qualname.rpartition(".")[2] for s in MANIFEST.values()} | {name for s in MANIFEST.values() for name in s.takes}


def test_the_installed_vllm_is_one_the_manifest_names():
    assert VLLM in {v for s in MANIFEST.values() for v in s.vllm}, VLLM


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_the_symbol_is_as_pd_serve_expects(name: str):
    symbol = MANIFEST[name]
    if VLLM not in symbol.vllm:
        pytest.skip(f"{name} need not hold on vLLM {VLLM} (only {', '.join(symbol.vllm)})")
    problem = check(name)
    assert problem is None, f"{problem} (the manifest has: {symbol.shape})"


def test_every_entry_says_what_and_where():
    for symbol in MANIFEST.values():
        assert symbol.library in LIBRARIES, symbol.name
        assert symbol.use in ("patch", "override", "read", "option"), symbol.name
        assert (PACKAGE.parent / symbol.used_by).is_file(), symbol.name
        assert set(symbol.vllm) <= {"0.23", "0.32"} and symbol.vllm, symbol.name
        if symbol.kind == CALLABLE:
            assert symbol.params or symbol.takes, f"{symbol.name}: a callable entry names its parameters"
        if symbol.kind == INSTANCE_ATTRIBUTE:
            assert symbol.source_has, f"{symbol.name}: an instance attribute entry says where the library sets it"


# --- the checker reports what changed --------------------------------------------------------


@pytest.fixture
def fake_library(monkeypatch) -> types.ModuleType:
    """A library of one class, in sys.modules, made afresh for each test, and manifest entries for
    its symbols."""

    class Hooks:
        LIMIT = 5

        class Options:
            pass

        def __init__(self) -> None:
            self._state = 1

        def hook(self, request, timestamp):
            return request, timestamp

        def run(self):
            return self.hook(None, 0.0)

        def options(self, *, method_name=None, _by_reference=None):
            return self

    module = types.ModuleType("pd_serve_fake_library")
    module.Hooks = Hooks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for symbol in (
        Symbol(module.__name__, "Hooks.hook", "vllm", "override", "serve_app/app.py", ("0.32",), params=("(self, request, timestamp)",)),
        Symbol(module.__name__, "Hooks.LIMIT", "vllm", "patch", "serve_app/app.py", ("0.32",), kind=INT),
        Symbol(module.__name__, "Hooks.Options", "vllm", "read", "serve_app/app.py", ("0.32",), kind=CLASS),
        Symbol(module.__name__, "Hooks.options", "ray", "option", "serve_app/app.py", ("0.32",), takes=("_by_reference",)),
        Symbol(
            module.__name__,
            "Hooks._state",
            "vllm",
            "read",
            "serve_app/app.py",
            ("0.32",),
            kind=INSTANCE_ATTRIBUTE,
            source_has=(("Hooks.__init__", "self._state ="), ("Hooks.run", "self.hook(")),
        ),
        Symbol("pd_serve_no_such_library", "Thing", "vllm", "read", "serve_app/app.py", ("0.32",), kind=MODULE),
    ):
        monkeypatch.setitem(MANIFEST, symbol.name, symbol)
    return module


def test_the_fake_library_matches_as_written(fake_library):
    for name in ("Hooks.hook", "Hooks.LIMIT", "Hooks.Options", "Hooks.options", "Hooks._state"):
        assert check(f"{fake_library.__name__}.{name}") is None, name


def _one_parameter(self, request):
    return request


def _takes_anything(self, **kwargs):
    return self


def _sets_nothing(self):
    pass


def _runs_nothing(self):
    pass


@pytest.mark.parametrize(
    "name,attr,value,reported",
    [
        ("Hooks.hook", "hook", _one_parameter, r"signature is now \(self, request\); pd-serve expects \(self, request, timestamp\)"),
        ("Hooks.hook", "hook", None, r"Hooks\.hook: gone"),
        ("Hooks.LIMIT", "LIMIT", "5", r"is now str, not an int"),
        ("Hooks.Options", "Options", _sets_nothing, r"is now function, not a class"),
        ("Hooks.options", "options", _takes_anything, r"no longer takes _by_reference"),
        ("Hooks._state", "__init__", _sets_nothing, r"Hooks\.__init__ no longer has 'self\._state ='"),
        ("Hooks._state", "run", _runs_nothing, r"Hooks\.run no longer has 'self\.hook\('"),
    ],
)
def test_a_changed_symbol_is_reported_by_name(fake_library, name, attr, value, reported):
    if value is None:
        delattr(fake_library.Hooks, attr)
    else:
        setattr(fake_library.Hooks, attr, value)
    problem = check(f"{fake_library.__name__}.{name}")
    assert problem is not None and problem.startswith(f"{fake_library.__name__}.{name}: "), problem
    assert re.search(reported, problem), problem


def test_texts_that_must_come_in_order_are_checked_in_order(fake_library, monkeypatch):
    """Where pd-serve depends on what the library does first (vLLM's penalties after its logits
    processors): the same texts in another order are a change."""
    name = f"{fake_library.__name__}.Hooks.run"
    texts = (("Hooks.run", "return"), ("Hooks.run", "self.hook("))
    symbol = Symbol(fake_library.__name__, "Hooks.run", "vllm", "read", "serve_app/app.py", ("0.32",), params=("(self)",), source_has=texts)
    monkeypatch.setitem(MANIFEST, name, symbol)
    assert check(name) is None  # in any order
    monkeypatch.setitem(MANIFEST, name, dataclasses.replace(MANIFEST[name], in_order=True))
    assert check(name) is None
    monkeypatch.setitem(MANIFEST, name, dataclasses.replace(MANIFEST[name], source_has=texts[::-1]))
    problem = check(name)
    assert problem is not None and "no longer has 'return' after the text before it" in problem, problem


def test_a_library_that_does_not_import_is_reported(fake_library):
    problem = check("pd_serve_no_such_library.Thing")
    assert problem is not None and "does not import" in problem


def test_an_overloaded_pybind_function_is_read_from_its_docstring(monkeypatch):
    """torch's ProcessGroupGloo.__init__ has no signature object, only overloads in its docstring:
    the check still tells one changed overload."""
    name = "torch.distributed.distributed_c10d.ProcessGroupGloo.__init__"
    expected = MANIFEST[name]
    assert check(name) is None
    changed = dataclasses.replace(expected, params=("(self, store, rank, size, timeout, extra)",))
    monkeypatch.setitem(MANIFEST, name, changed)
    problem = check(name)
    assert problem is not None and "(self, store, rank, size, options) | (self, store, rank, size, timeout)" in problem, problem


def test_unchanged_logs_each_mismatch_and_says_what_is_off(fake_library, caplog):
    log = logging.getLogger("pd_serve.test")
    fake_library.Hooks.LIMIT = "5"
    fake_library.Hooks.options = lambda self: self
    names = [f"{fake_library.__name__}.{n}" for n in ("Hooks.hook", "Hooks.LIMIT", "Hooks.options")]
    with caplog.at_level(logging.WARNING, "pd_serve.test"):
        assert unchanged(names, log, "the widget") is False
    # As a set: once an earlier test has routed pd-serve's logs through Serve's logger too, caplog
    # is handed each record twice.
    messages = sorted({r.getMessage() for r in caplog.records})
    assert len(messages) == 2 and all("runs without the widget" in m for m in messages)
    assert "Hooks.LIMIT" in messages[0] and "Hooks.options" in messages[1]
    caplog.clear()
    assert unchanged([f"{fake_library.__name__}.Hooks.hook"], log, "the widget") is True
    assert not caplog.records


def test_a_real_symbol_changed_under_a_plugin_is_reported(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    class SpinCondition:
        def __init__(self, is_reader, context, notify_address):
            pass

    monkeypatch.setattr(shm_broadcast, "SpinCondition", SpinCondition)
    problem = check("vllm.distributed.device_communicators.shm_broadcast.SpinCondition.__init__")
    assert problem is not None and "(self, is_reader, context, notify_address)" in problem, problem


# --- the plug-ins stand aside ----------------------------------------------------------------


def warnings_naming(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]


def test_the_spin_plugin_stands_aside_on_a_changed_spin_condition(monkeypatch, caplog):
    from vllm.distributed.device_communicators import shm_broadcast

    from serve_app.vllm_plugins import spin

    class SpinCondition:
        def __init__(self, is_reader, context, notify_address, busy_loop_s=1, cancel=None):
            self.busy_loop_s = busy_loop_s

    original_init = SpinCondition.__init__
    monkeypatch.setattr(shm_broadcast, "SpinCondition", SpinCondition)
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", "5000", raising=False)
    monkeypatch.setenv(spin.ENV, "0.005")
    with caplog.at_level(logging.WARNING, "pd_serve.engine"):
        spin.install()
    assert SpinCondition.__init__ is original_init and not hasattr(SpinCondition, "_pd_serve_spin_s")
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == "5000"
    assert warnings_naming(caplog, spin.SPIN_CONDITION) and warnings_naming(caplog, spin.RECHECK_INTERVAL)


def test_the_gloo_plugin_stands_aside_on_changed_options(monkeypatch, caplog):
    from torch.distributed import distributed_c10d as c10d

    from serve_app.vllm_plugins import gloo_device

    real = c10d.ProcessGroupGloo

    class ProcessGroupGloo(real):  # type: ignore[misc, valid-type]
        class _Options:  # lost its _devices
            _timeout = None

    monkeypatch.setattr(c10d, "ProcessGroupGloo", ProcessGroupGloo)
    monkeypatch.setenv(gloo_device.ENV, "1")
    with caplog.at_level(logging.WARNING, "pd_serve.engine"):
        gloo_device.install()
    assert "__init__" not in vars(ProcessGroupGloo)
    assert warnings_naming(caplog, "ProcessGroupGloo._Options._devices")


def test_the_stat_logger_leaves_out_the_part_whose_symbols_changed(monkeypatch, caplog):
    from vllm.v1.metrics import ray_wrappers

    from serve_app.vllm_plugins.stat_logger import LABEL_SYMBOLS, RECORD, ray_stat_logger

    base = ray_wrappers.RayPrometheusStatLogger
    whole = ray_stat_logger("decode-0", "decode")
    assert whole is not base and whole._gauge_cls is not ray_wrappers.RayGaugeWrapper and "record" in vars(whole)

    monkeypatch.setattr(ray_wrappers.RayPrometheusMetric, "_build_tags", lambda self, labels: {})
    with caplog.at_level(logging.WARNING, "pd_serve.engine"):
        unlabelled = ray_stat_logger("decode-0", "decode")
    assert unlabelled._gauge_cls is ray_wrappers.RayGaugeWrapper and "record" in vars(unlabelled)  # still throttled
    assert warnings_naming(caplog, LABEL_SYMBOLS[1])

    monkeypatch.setattr(base, "record", lambda self, scheduler_stats, iteration_stats: None)
    assert ray_stat_logger("decode-0", "decode") is base
    assert warnings_naming(caplog, RECORD)


def test_the_http_protocol_stands_aside_on_a_changed_uvicorn(monkeypatch, caplog):
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from serve_app.runtime.http_server import coalescing_http_protocol

    assert issubclass(coalescing_http_protocol(implementation="httptools"), HttpToolsProtocol)
    assert coalescing_http_protocol(implementation="httptools") is not HttpToolsProtocol
    monkeypatch.setattr(HttpToolsProtocol, "on_headers_complete", lambda self, parser: None)
    with caplog.at_level(logging.WARNING, "pd_serve"):
        assert coalescing_http_protocol(implementation="httptools") is HttpToolsProtocol
    assert warnings_naming(caplog, "HttpToolsProtocol.on_headers_complete")


def test_the_router_keeps_a_plain_engine_handle_when_options_lose_by_reference(monkeypatch, caplog):
    from ray.serve.handle import DeploymentHandle

    from serve_app.router.deployment import engine_handle

    class Handle:
        def options(self, **kwargs):
            return ("options", kwargs)

    assert engine_handle(Handle(), "grpc")[0] == "options"
    monkeypatch.setattr(DeploymentHandle, "options", lambda self, *, method_name=None, stream=None: self)
    with caplog.at_level(logging.WARNING, "pd_serve.router"):
        handle = Handle()
        assert engine_handle(handle, "grpc") is handle
    assert warnings_naming(caplog, "DeploymentHandle.options")


@CPU_PATH
def test_the_kv_doorbell_stands_aside_on_a_changed_engine_core(monkeypatch, caplog):
    import time

    from vllm.v1.engine import core

    from serve_app.kv.wakeup import Doorbell, install_core_wait

    monkeypatch.setattr(core.EngineCoreProc, "_process_engine_step", lambda self, budget: False)
    doorbell = Doorbell()
    try:
        with caplog.at_level(logging.WARNING, "pd_serve.kv"):
            assert install_core_wait(doorbell) is False
        assert core.time is time
        assert warnings_naming(caplog, "EngineCoreProc._process_engine_step")
    finally:
        doorbell.close()


@CPU_PATH
def test_the_kv_connector_refuses_to_start_naming_the_changed_symbol(monkeypatch):
    """It cannot stand aside (no KV would move): it fails at once, saying why."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from serve_app.kv.layerwise_connector import LayerwisePushConnector

    monkeypatch.setattr(KVConnectorBase_V1, "_get_connector_metadata", lambda self, step: None)
    with pytest.raises(RuntimeError, match=r"KVConnectorBase_V1\._get_connector_metadata: signature is now \(self, step\)"):
        LayerwisePushConnector(None, KVConnectorRole.WORKER)  # type: ignore[arg-type]


# --- the manifest covers the code ------------------------------------------------------------

# Found by grepping serve_app for private names read, set, overridden or passed on vLLM, torch,
# Ray, uvicorn and transformers objects, and for patched library attributes.
KNOWN_PRIVATE_USES = {
    "_by_reference",  # router/deployment.py
    "_deployment_id",  # router/replica_router.py
    "_preempt_request",  # kv/recompute_scheduler.py
    "_free_request",
    "_get_connector_metadata",  # kv/layerwise_connector.py
    "_kv_cache_manager",
    "_process_engine_step",  # kv/wakeup.py
    "time",
    "_Options",  # vllm_plugins/gloo_device.py
    "_timeout",
    "_devices",
    "SpinCondition.__init__",  # vllm_plugins/spin.py
    "SHM_READER_RECHECK_INTERVAL_MS",
    "_get_tag_keys",  # vllm_plugins/stat_logger.py
    "_build_tags",
    "_tags",
    "_gauge_cls",
    "_counter_cls",
    "_histogram_cls",
    "_spec_decoding_cls",
    "_kv_connector_cls",
    "_perf_metrics_cls",
    "_validate_logit_bias",  # router/parsing.py
    "_validate_stop_token_ids",
    "_validate_allowed_token_ids",
    "_tokenizer",  # router/text.py
    "capture_signals",  # runtime/http_server.py
    "on_headers_complete",
}


def test_every_private_use_found_by_hand_has_an_entry():
    names = {s.qualname for s in MANIFEST.values()} | COVERED
    assert not KNOWN_PRIVATE_USES - names, f"no manifest entry for {sorted(KNOWN_PRIVATE_USES - names)}"


def private_names_used_but_not_defined() -> dict[str, str]:
    """Private names serve_app reads, passes as keyword arguments or names in strings (getattr,
    class attributes given to ``type``) but defines nowhere itself: another library's, then."""
    private = re.compile(r"^_[A-Za-z]\w*$")
    used: dict[str, str] = {}
    defined: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "private_symbols.py":  # the manifest's own text names them all
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            defined |= _definitions(node)
            names: list[str] = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.keyword) and node.arg:
                names = [node.arg]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            for name in names:
                if private.match(name) and not name.startswith(("_pd_", "__")):
                    used.setdefault(name, f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}")
    return {name: where for name, where in used.items() if name not in defined}


def _definitions(node: ast.AST) -> set[str]:
    """What a node defines as pd-serve's own: functions, classes and their parameters, class-body
    and module-level assignments, imports, and ``self.<name> =`` in an ``__init__``."""
    found: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found.add(node.name)
        found |= {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        if node.name in ("__init__", "__post_init__"):
            for sub in ast.walk(node):
                for target in _targets(sub):
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                        found.add(target.attr)
    if isinstance(node, (ast.ClassDef, ast.Module)):
        if isinstance(node, ast.ClassDef):
            found.add(node.name)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and item.value is None and isinstance(node, ast.ClassDef):
                continue  # an annotation only: an attribute something else sets
            found |= {t.id for t in _targets(item) if isinstance(t, ast.Name)}
            if isinstance(item, (ast.Import, ast.ImportFrom)):
                found |= {(a.asname or a.name).split(".")[0] for a in item.names}
    return found


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    else:
        return []
    return [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def test_every_private_name_serve_app_uses_but_does_not_define_has_an_entry():
    """A heuristic by name: a private name pd-serve also defines itself somewhere (``_tags``,
    ``_tokenizer``) is missed here, and is in KNOWN_PRIVATE_USES above instead."""
    foreign = private_names_used_but_not_defined()
    assert "_by_reference" in foreign and "_deployment_id" in foreign, "the scan no longer sees what it should"
    missing = {name: where for name, where in foreign.items() if name not in COVERED}
    assert not missing, f"private names of other libraries without a manifest entry: {missing}"


def serve_app_classes() -> list[type]:
    """Every class serve_app defines, the ones its functions build included."""
    modules = []
    for info in pkgutil.walk_packages(serve_app.__path__, "serve_app."):
        if info.name.startswith("serve_app.kv") and VLLM not in private_symbols.CPU:
            continue  # the CPU path's plug-ins import vLLM 0.32's connector API
        modules.append(importlib.import_module(info.name))
    classes = [c for m in modules for c in vars(m).values() if isinstance(c, type) and c.__module__.startswith("serve_app")]
    from serve_app.runtime.http_server import coalescing_http_protocol
    from serve_app.vllm_plugins.stat_logger import ray_stat_logger

    logger_cls = ray_stat_logger("decode-0", "decode")
    classes += [logger_cls, *(v for v in vars(logger_cls).values() if isinstance(v, type))]
    classes += [coalescing_http_protocol(implementation=impl) for impl in ("httptools", "h11")]
    return classes


def test_every_private_library_attribute_a_serve_app_class_overrides_has_an_entry():
    overrides: dict[str, str] = {}
    for cls in serve_app_classes():
        mine = [k for k in cls.__mro__ if k.__module__.startswith("serve_app")]
        theirs = [k for k in cls.__mro__ if k.__module__.split(".")[0] in LIBRARIES]
        for name in {n for k in mine for n in vars(k)}:
            if name.startswith("_") and not name.startswith(("__", "_pd_")) and name != "_abc_impl":
                for base in theirs:
                    if name in vars(base):
                        overrides[name] = f"{cls.__qualname__} over {base.__module__}.{base.__qualname__}"
    expected = {"_get_tag_keys", "_build_tags", "_gauge_cls"} | ({"_preempt_request"} if VLLM in private_symbols.CPU else set())
    assert expected <= set(overrides), f"the scan no longer sees what it should: {sorted(overrides)}"
    missing = {name: where for name, where in overrides.items() if name not in COVERED}
    assert not missing, f"private library attributes overridden without a manifest entry: {missing}"
