"""The decode engine core's doorbell (serve_app/kv/wakeup.py): its wait ends when the worker
rings or a step reported a finished receive, the worker rings when a transfer can be settled, and
vLLM's engine core still sleeps where this was written to wait."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest

from serve_app.kv.consumer import ConsumerWorker
from serve_app.kv.layerwise_connector import LayerwisePushConnector
from serve_app.kv.metadata import LayerwiseMetadata, RecvSpec
from serve_app.kv.scheduler_side import SchedulerSide
from serve_app.kv.wakeup import Doorbell, DoorbellRinger, _CoreTime, install_core_wait
from tests.support.kv_helpers import Peer, layer_data, patterned_caches, port_of, sched_output, settings

LONG_S = 30.0  # a wait that only a ring ends before a test's timeout


@pytest.fixture
def doorbell():
    bell = Doorbell()
    yield bell
    bell.close()


def wait_in_thread(bell: Doorbell, timeout_s: float) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(bell.wait(timeout_s)), daemon=True)
    thread.start()
    return thread, result


def test_a_ring_from_another_process_end_ends_the_wait(doorbell):
    thread, result = wait_in_thread(doorbell, LONG_S)
    time.sleep(0.05)
    assert thread.is_alive()  # nothing rang yet
    ringer = DoorbellRinger()
    ringer.aim(doorbell.port, doorbell.token)
    ringer.ring()
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and result == [True]
    ringer.close()


def test_rings_that_came_before_the_wait_end_it_once(doorbell):
    ringer = DoorbellRinger()
    ringer.aim(doorbell.port, doorbell.token)
    for _ in range(5):
        ringer.ring()
    time.sleep(0.05)
    assert doorbell.wait(LONG_S) is True
    # All five were answered by that one wait (one step settles every ready transfer).
    assert doorbell.wait(0.01) is False
    ringer.close()


def test_a_step_that_reported_a_receive_skips_the_next_wait(doorbell):
    doorbell.ring_here()
    started = time.monotonic()
    assert doorbell.wait(LONG_S) is True
    assert time.monotonic() - started < LONG_S / 3
    assert doorbell.wait(0.01) is False  # only the next one


def test_without_a_ring_the_wait_lasts_its_interval(doorbell):
    started = time.monotonic()
    assert doorbell.wait(0.05) is False
    assert time.monotonic() - started >= 0.04


def test_a_ringer_without_a_port_and_a_closed_doorbell_are_harmless():
    """A ring before any step named a doorbell reaches nobody, one at a doorbell that closed is
    lost; neither raises, and the ringer rings the next doorbell it is aimed at."""
    ringer = DoorbellRinger()
    bell = Doorbell()
    ringer.ring()  # no step has named the doorbell yet
    assert ringer.port is None and bell.wait(0.05) is False  # nothing was sent
    ringer.aim(bell.port, bell.token)
    bell.close()
    ringer.ring()  # nobody listens any more
    ringer.ring()  # (on Linux the first may leave a refusal for the next send to report)
    restarted = Doorbell()  # the engine core's scheduler side again, on a new port
    try:
        ringer.aim(restarted.port, restarted.token)
        ringer.ring()
        assert restarted.wait(LONG_S) is True
    finally:
        restarted.close()
        ringer.close()


def fake_core_module(source: str) -> types.ModuleType:
    """A module built from ``source``, with its source readable the way vLLM's is."""
    import linecache

    name = f"fake_core_{abs(hash(source))}"
    filename = f"<{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


CORE_LIKE = """
import time


class EngineCoreProc:
    def _process_engine_step(self):
        outputs, model_executed = self.step_fn()
        if not model_executed and self.scheduler.has_requests():
            time.sleep(0.001)
        return model_executed
"""


def test_the_core_wait_replaces_only_the_engine_core_modules_sleep(doorbell):
    module = fake_core_module(CORE_LIKE)
    assert install_core_wait(doorbell, module) is True
    proxy = module.time
    assert isinstance(proxy, _CoreTime)
    assert proxy.monotonic is time.monotonic and proxy.perf_counter is time.perf_counter
    doorbell.ring_here()
    started = time.monotonic()
    proxy.sleep(LONG_S)  # the doorbell's wait: rung, so it returns at once
    assert time.monotonic() - started < LONG_S / 3
    assert time.sleep is not proxy.sleep  # the real module is untouched
    # A second engine-core scheduler (a restarted one) takes over the same proxy.
    other = Doorbell()
    assert install_core_wait(other, module) is True and module.time is proxy and proxy._doorbell is other
    other.close()


def test_a_module_that_is_not_the_expected_engine_core_is_left_alone(doorbell):
    no_engine = fake_core_module("import time\n")
    assert install_core_wait(doorbell, no_engine) is False and no_engine.time is time
    # A second sleep elsewhere in the module: routing it to the doorbell would change more than the poll.
    two_sleeps = fake_core_module(CORE_LIKE + "\n\ndef shutdown():\n    time.sleep(1)\n")
    assert install_core_wait(doorbell, two_sleeps) is False and two_sleeps.time is time
    # The poll no longer follows a forward-less step.
    moved = fake_core_module(CORE_LIKE.replace("if not model_executed and", "if"))
    assert install_core_wait(doorbell, moved) is False and moved.time is time
    # Someone else replaced the module's time already.
    other = fake_core_module(CORE_LIKE)
    other.time = types.SimpleNamespace(sleep=time.sleep)
    assert install_core_wait(doorbell, other) is False


def test_vllms_engine_core_is_recognised():
    """What wakeup.py relies on: vLLM's engine-core module calls ``time.sleep`` in one place, the
    poll after a step that ran no forward. If a vLLM upgrade moves it, this fails instead of the
    doorbell silently waiting somewhere else."""
    from vllm.v1.engine import core

    from serve_app.kv.wakeup import sleeps_only_after_forwardless_steps

    assert sleeps_only_after_forwardless_steps(core)


def test_the_decode_connector_installs_the_wait_and_prefill_does_not(monkeypatch):
    installed: list[Doorbell] = []
    monkeypatch.setattr("serve_app.kv.layerwise_connector.install_core_wait", lambda bell: installed.append(bell) or True)
    connector = LayerwisePushConnector.__new__(LayerwisePushConnector)
    decode = connector._make_scheduler_side(settings())
    assert decode.doorbell is installed[0]
    meta = decode.build_connector_meta(sched_output(), None)
    assert (meta.wake_port, meta.wake_token) == (installed[0].port, installed[0].token)
    prefill = connector._make_scheduler_side(settings(is_producer=True))
    assert prefill.doorbell is None and len(installed) == 1
    meta = prefill.build_connector_meta(sched_output(), None)
    assert meta.wake_port is None and meta.wake_token is None
    decode.close()
    prefill.close()


def test_a_reported_receive_rings_the_engine_cores_own_doorbell(doorbell):
    side = SchedulerSide(settings(), doorbell=doorbell)
    side.on_connector_output(types.SimpleNamespace(finished_recving=set()))
    assert doorbell.wait(0.01) is False
    side.on_connector_output(types.SimpleNamespace(finished_recving={"req-1"}))
    assert doorbell.wait(LONG_S) is True


# ------------------------------------------------------------------ the worker rings
@pytest.fixture
def consumer_and_bell(doorbell):
    worker = ConsumerWorker(settings())
    worker.register_kv_caches(patterned_caches(seed=1))
    yield worker, doorbell
    worker.close()


def arm_with_doorbell(worker: ConsumerWorker, bell: Doorbell, req_id: str, tid: str, block_ids: list[int]) -> str:
    secret = f"secret-of-{tid}"
    spec = RecvSpec(req_id, tid, secret, block_ids, 8, 30.0)
    worker.on_step(LayerwiseMetadata(recv=[spec], wake_port=bell.port, wake_token=bell.token))
    return secret


def test_the_worker_rings_for_each_layer_and_for_the_last_frame_of_a_transfer(consumer_and_bell):
    """A layer frame rings too: the step it wakes writes the layer while prefill computes the
    next, instead of every layer waiting for the done frame (or for a poll)."""
    worker, bell = consumer_and_bell
    secret = arm_with_doorbell(worker, bell, "req-1", "t-1", [2, 3])
    peer = Peer(port_of(worker))
    data = layer_data(2, seed=4)
    peer.layer("t-1", secret, [2, 3], data["l0"])
    assert bell.wait(LONG_S) is True
    assert worker.results() == (set(), set())  # the step it wakes writes the layer, settles nothing
    assert worker._waiting["t-1"].layers == {"l0"}  # written at once, not when the done frame comes
    peer.layer("t-1", secret, [2, 3], data["l1"], layer="l1")
    assert bell.wait(LONG_S) is True
    assert worker.results() == (set(), set())
    peer.done("t-1", secret, frames=2)
    assert bell.wait(LONG_S) is True
    assert worker.results() == ({"req-1"}, set())  # and the step it wakes reports the transfer
    peer.close()


def test_the_worker_rings_when_a_transfer_fails(consumer_and_bell):
    worker, bell = consumer_and_bell
    secret = arm_with_doorbell(worker, bell, "req-1", "t-1", [2, 3])
    peer = Peer(port_of(worker))
    peer.failed("t-1", secret, "prefill died")
    assert bell.wait(LONG_S) is True
    assert worker.results() == ({"req-1"}, {"req-1"})
    # A connection that ends with a transfer still receiving fails it and rings too.
    secret = arm_with_doorbell(worker, bell, "req-2", "t-2", [4])
    peer = Peer(port_of(worker))
    peer.layer("t-2", secret, [4], layer_data(1, seed=5)["l0"])
    time.sleep(0.1)
    bell.wait(0.01)
    peer.close()
    assert bell.wait(LONG_S) is True
    assert worker.results() == ({"req-2"}, {"req-2"})


# ------------------------------------------------------------------ how long the engine core waits
KV_WAITING = "waiting for remote KV"  # stands for vLLM's RequestStatus.WAITING_FOR_REMOTE_KVS


class FakeScheduler:
    def __init__(self, *statuses: str, running: int = 0, finished: bool = False) -> None:
        self.requests = {f"req-{i}": types.SimpleNamespace(status=status) for i, status in enumerate(statuses)}
        self.running = [object()] * running
        self.finished = finished

    def has_finished_requests(self) -> bool:
        return self.finished

    def has_requests(self) -> bool:
        return bool(self.requests)


DP_CORE_LIKE = CORE_LIKE + """

class DPEngineCoreProc(EngineCoreProc):
    pass
"""


def forwardless_core(bell: Doorbell, scheduler: FakeScheduler, waiting_for_kv: str | None = KV_WAITING, data_parallel: bool = False):
    """vLLM's engine core as CORE_LIKE shapes it, its step running no forward, with the doorbell's
    wait installed."""
    import queue

    module = fake_core_module(DP_CORE_LIKE)
    assert install_core_wait(bell, module, waiting_for_kv=waiting_for_kv)
    core = module.DPEngineCoreProc() if data_parallel else module.EngineCoreProc()
    core.scheduler = scheduler
    core.input_queue = queue.Queue()
    core.step_fn = lambda: (None, False)
    return core


def step_in_thread(core) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def step() -> None:
        started = time.monotonic()
        core._process_engine_step()
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread, took


def test_while_every_request_waits_for_its_kv_the_core_waits_until_a_ring(doorbell, monkeypatch):
    """No step can do anything until a frame comes, so the engine core does not poll its worker
    every millisecond: it waits for the worker's ring."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING, KV_WAITING))
    thread, took = step_in_thread(core)
    time.sleep(0.1)  # a hundred of vLLM's poll intervals
    assert thread.is_alive()
    ringer = DoorbellRinger()
    ringer.aim(doorbell.port, doorbell.token)
    ringer.ring()
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and 0.1 <= took[0] < LONG_S / 3
    ringer.close()


def test_new_input_ends_the_long_wait(doorbell, monkeypatch):
    """A new request or an abort is handled at once, not after the KV wait."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING))
    thread, took = step_in_thread(core)
    time.sleep(0.1)
    assert thread.is_alive()
    core.input_queue.put(("ADD", "req-new"))
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took[0] < LONG_S / 3
    # Input that is already there: no wait at all beyond the check.
    thread, took = step_in_thread(core)
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took[0] < LONG_S / 3


def test_the_long_wait_is_bounded(doorbell, monkeypatch):
    """A lost ring or a transfer's deadline is noticed by a step after at most KV_WAIT_MAX_S."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", 0.2)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING))
    thread, took = step_in_thread(core)
    thread.join(timeout=LONG_S)
    assert not thread.is_alive() and 0.19 <= took[0] < LONG_S / 3


@pytest.mark.parametrize(
    "scheduler",
    [
        FakeScheduler(KV_WAITING, running=1),  # a running request: the next step may run a forward
        FakeScheduler(KV_WAITING, "waiting for its grammar"),  # another wait that no ring ends
        FakeScheduler(KV_WAITING, finished=True),  # a finished request the next step reports
        FakeScheduler(),  # nothing held (a connector's pending work keeps the engine stepping)
    ],
    ids=["running", "other-status", "finished", "empty"],
)
def test_in_any_other_state_the_wait_is_vllms_poll_interval(doorbell, monkeypatch, scheduler):
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, scheduler)
    thread, took = step_in_thread(core)
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took[0] < LONG_S / 3


def test_a_scheduler_without_what_the_long_wait_reads_keeps_the_poll_interval(doorbell, monkeypatch, caplog):
    """A scheduler class of the user's own that lacks vLLM's attributes: the engine keeps
    running with vLLM's poll instead of failing on the first forward-less step, and the log says
    it is the scheduler (not where the poll is called from)."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING))
    core.scheduler = types.SimpleNamespace(has_requests=lambda: True)
    with caplog.at_level(logging.WARNING, logger="pd_serve"):
        thread, took = step_in_thread(core)
        thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took and took[0] < LONG_S / 3
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "engine core: its scheduler (SimpleNamespace) lacks vLLM's requests, running or has_finished_requests; "
        "KV waits last one poll interval"
    ) in messages
    assert not any("its poll is not called from" in m for m in messages), messages


def test_a_data_parallel_rank_waits_the_poll_interval(doorbell, monkeypatch):
    """Data-parallel ranks step in lock-step: a long wait in one would hold the others back."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING), data_parallel=True)
    thread, took = step_in_thread(core)
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took[0] < LONG_S / 3


def test_without_vllms_status_or_an_engine_core_caller_the_wait_is_the_poll_interval(doorbell, monkeypatch, caplog):
    """Where what the long wait reads changed (no status), or the sleep is not the engine step's,
    the wait lasts vLLM's interval."""
    monkeypatch.setattr("serve_app.kv.wakeup.KV_WAIT_MAX_S", LONG_S)
    core = forwardless_core(doorbell, FakeScheduler(KV_WAITING), waiting_for_kv=None)
    thread, took = step_in_thread(core)
    thread.join(timeout=LONG_S / 3)
    assert not thread.is_alive() and took[0] < LONG_S / 3
    # Called from elsewhere: the proxy cannot find an engine core, so it stands aside for good.
    other = fake_core_module(CORE_LIKE)
    assert install_core_wait(doorbell, other, waiting_for_kv=KV_WAITING)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pd_serve"):
        other.time.sleep(0.001)
    assert time.monotonic() - started < LONG_S / 3 and other.time._core is None and other.time._looked
    assert any("its poll is not called from" in r.getMessage() for r in caplog.records)


def test_vllms_status_for_a_request_waiting_for_kv_is_found():
    from vllm.v1.request import RequestStatus

    from serve_app.kv.wakeup import _vllms_waiting_for_kv

    assert _vllms_waiting_for_kv() is RequestStatus.WAITING_FOR_REMOTE_KVS
