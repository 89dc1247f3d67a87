"""Engine process hygiene without Ray: the parent watchdog, the quick exit, and settling the KV port at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from unittest import mock

import pytest

from serve_app.engines.kv_endpoint import KVPortBusy, port_holder, settle_kv_endpoint
from serve_app.runtime.ports import late_bound_ports
from serve_app.vllm_plugins.processes import ENGINE_CHILD_ENV

PARENT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time

    def child():
        from serve_app.vllm_plugins.watchdog import install
        install()
        time.sleep(60)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=child, daemon=False)
        p.start()
        print(p.pid, flush=True)
        time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not reaped yet
        return f.read().split()[2] != "Z"


@pytest.mark.slow  # a parent and a spawned child process, watched for seconds
@pytest.mark.parametrize("enabled", [True, False])
def test_an_engine_child_process_dies_with_its_parent(tmp_path, enabled):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, ENGINE_CHILD_ENV: "1" if enabled else "0", "PYTHONPATH": os.getcwd()}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the child is up and, when enabled, watching
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child) is not enabled
    finally:
        parent.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_the_watchdog_stays_out_of_processes_that_are_not_engine_children(monkeypatch):
    import serve_app.vllm_plugins.watchdog as watchdog

    monkeypatch.setattr(watchdog, "_started", False)
    monkeypatch.setenv(ENGINE_CHILD_ENV, "1")
    watchdog.install()  # this pytest process has no multiprocessing parent
    assert watchdog._started is False


EXITING_CHILD = textwrap.dedent(
    """
    import atexit, gc, multiprocessing, sys

    def child():
        # Registered before the plug-in, so it runs after it: what the interpreter's last
        # collections would find still to traverse.
        atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
        from serve_app.vllm_plugins.quick_exit import install
        install()
        sys.exit(0)  # as a spawned vLLM process ends

    if __name__ == "__main__":
        p = multiprocessing.get_context("spawn").Process(target=child)
        p.start()
        p.join()
    """
)


@pytest.mark.slow  # a spawned child process
@pytest.mark.parametrize("enabled", [True, False])
def test_an_engine_child_process_exits_with_its_heap_frozen(tmp_path, enabled):
    """vLLM un-freezes its heap on shutdown; an engine's child process freezes it again at exit,
    after every other exit handler, so the interpreter's final collections skip it. Only in a
    pd-serve engine's children: elsewhere nothing changes."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_CHILD)
    env = {**os.environ, ENGINE_CHILD_ENV: "1" if enabled else "0", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    frozen = int(out.stdout.split("frozen at exit:")[1].split()[0])
    assert (frozen > 10_000) is enabled, out.stdout + out.stderr


def test_the_quick_exit_stays_out_of_processes_that_are_not_engine_children(monkeypatch):
    import atexit

    import serve_app.vllm_plugins.quick_exit as quick_exit

    monkeypatch.setattr(quick_exit, "_installed", False)
    monkeypatch.setenv(ENGINE_CHILD_ENV, "1")
    with mock.patch.object(atexit, "register") as register:
        quick_exit.install()  # this pytest process has no multiprocessing parent
    assert not register.called and quick_exit._installed is False


def kv_kwargs(port: int) -> dict:
    return {"model": "m", "kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_consumer", "kv_port": port, "engine_id": "decode-0"}}


def test_a_free_port_is_kept():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs, endpoint = settle_kv_endpoint(kv_kwargs(port), listens=True, fallback=True)
    assert endpoint is not None and (endpoint.engine_id, endpoint.host, endpoint.port) == ("decode-0", "127.0.0.1", port)
    assert kwargs["kv_transfer_config"]["kv_port"] == port
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["kv_host"] == "127.0.0.1"


def test_a_busy_port_is_replaced_or_refused_naming_its_holder():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    busy = holder.getsockname()[1]
    try:
        original = kv_kwargs(busy)
        kwargs, endpoint = settle_kv_endpoint(original, listens=True, fallback=True)
        assert endpoint is not None and endpoint.port != busy
        assert endpoint.port in late_bound_ports()  # not one an outgoing connection may take first
        assert kwargs["kv_transfer_config"]["kv_port"] == endpoint.port
        assert original["kv_transfer_config"]["kv_port"] == busy  # the spec is left alone
        with pytest.raises(KVPortBusy, match=f"KV port {busy} .* in use by pid {os.getpid()}"):
            settle_kv_endpoint(kv_kwargs(busy), listens=True, fallback=False)
        assert port_holder(busy).startswith(f"pid {os.getpid()}")
        # An engine that only connects out (the CPU prefill) does not care.
        _, endpoint = settle_kv_endpoint(kv_kwargs(busy), listens=False, fallback=False)
        assert endpoint is not None and endpoint.port == busy
    finally:
        holder.close()


def test_an_engine_without_a_connector_has_no_endpoint():
    kwargs, endpoint = settle_kv_endpoint({"model": "m"}, listens=True, fallback=True)
    assert endpoint is None and kwargs == {"model": "m"}
