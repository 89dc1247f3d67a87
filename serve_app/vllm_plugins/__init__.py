"""pd-serve's plug-ins into vLLM's engine processes (pyproject's ``vllm.general_plugins``)."""

from __future__ import annotations

from collections.abc import Mapping

ENTRY_POINT_GROUP = "vllm.general_plugins"
# Every plug-in pd-serve installs (pyproject.toml; tests/unit/test_backends.py holds them equal).
ENTRY_POINTS = (
    "pd_serve_parent_watchdog",
    "pd_serve_quick_exit",
    "pd_serve_engine_spin",
    "pd_serve_engine_core_bind",
    "pd_serve_shared_gloo_device",
    "pd_serve_seeded_sampling",
    "pd_serve_resumed_grammar",
)


def plugin_problems(env: Mapping[str, str]) -> list[str]:
    """Why vLLM would start an engine without pd-serve's plug-ins: not installed (pd-serve on the
    path only: its entry points are what vLLM finds), or left out of an operator's
    ``VLLM_PLUGINS`` allowlist. Without them an engine runs, but wrong (a resumed grammar or seeded
    sampling starts over) or breakable (a seeded prompt in chunks kills a CPU engine core)."""
    from importlib.metadata import entry_points

    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    problems = []
    missing = [name for name in ENTRY_POINTS if name not in installed]
    if missing:
        problems.append(f"pd-serve's vLLM plug-ins {missing} are not installed: install pd-serve (pip install -e .), not only its path")
    allowed = env.get("VLLM_PLUGINS")
    if allowed is not None:
        left_out = [name for name in ENTRY_POINTS if name not in allowed.split(",")]
        if left_out:
            problems.append(f"VLLM_PLUGINS leaves out pd-serve's plug-ins {left_out}: add them")
    return problems
