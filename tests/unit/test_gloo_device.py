"""The shared Gloo device plug-in (serve_app/vllm_plugins/gloo_device.py), in fresh interpreters (it
patches torch.distributed's module state): asked for, a process's Gloo groups keep one loop
thread between them and still work, alone and across two ranks; not asked for, torch is left
as it is."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest

from tests.support.kv_helpers import free_port

# One rank or two (argv[1]), the groups vLLM's CPU worker makes (world, then two per parallel
# dimension), collectives on each, then teardown as vLLM does it. Prints the Gloo loop threads.
PROBE = """
import glob, os, sys
import torch, torch.distributed as dist
from serve_app.vllm_plugins import gloo_device

def gloo_threads():
    return sum(1 for t in glob.glob("/proc/%d/task/*" % os.getpid()) if open(t + "/comm").read().startswith("gloo"))

def run(rank, size, port):
    gloo_device.install()
    gloo_device.install()  # idempotent: vLLM may load its plugins more than once
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=size)
    everyone = list(range(size))
    groups = [dist.new_group(everyone, backend="gloo") for _ in range(12)]
    for group in groups:
        x = torch.full((1000,), float(rank + 1))
        dist.all_reduce(x, group=group)
        assert x[0].item() == size * (size + 1) / 2, x[0]
        y = torch.full((3,), float(rank))
        dist.broadcast(y, size - 1, group=group)
        assert y[0].item() == size - 1
        dist.barrier(group=group)
    # Still torch's own class, so torch's checks on a group's backend hold (a timeout reaches it).
    from torch.distributed import distributed_c10d as c10d
    import datetime, warnings
    assert isinstance(groups[0]._get_backend(torch.device("cpu")), c10d.ProcessGroupGloo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c10d._set_pg_timeout(datetime.timedelta(seconds=60), groups[0])
    os.write(1, ("%d %d\\n" % (rank, gloo_threads())).encode())  # one write: the ranks share stdout
    for group in groups:
        dist.destroy_process_group(group)
    dist.destroy_process_group()

if __name__ == "__main__":
    size, port = int(sys.argv[1]), int(sys.argv[2])
    if size == 1:
        run(0, 1, port)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run, args=(size, port), nprocs=size)
"""


def probe(size: int, shared: bool, tmp_path) -> list[tuple[int, int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("PD_SERVE_SHARED_GLOO_DEVICE", "GLOO_SOCKET_IFNAME")}
    if shared:
        env["PD_SERVE_SHARED_GLOO_DEVICE"] = "1"
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(script), str(size), str(free_port())], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()]
    return sorted((int(rank), int(threads)) for rank, threads in rows)


@pytest.mark.slow  # fresh interpreters that import torch, one per rank
def test_shared_one_rank_groups_keep_one_loop_thread_and_work(tmp_path):
    assert probe(1, shared=True, tmp_path=tmp_path) == [(0, 1)]


@pytest.mark.slow  # fresh interpreters that import torch, one per rank
def test_shared_across_two_ranks_collectives_still_work(tmp_path):
    assert probe(2, shared=True, tmp_path=tmp_path) == [(0, 1), (1, 1)]


@pytest.mark.slow  # fresh interpreters that import torch, one per rank
def test_not_asked_for_torch_makes_a_device_per_group(tmp_path):
    """The plug-in's reason to exist: without it every group brings a loop thread (13 here)."""
    assert probe(1, shared=False, tmp_path=tmp_path) == [(0, 13)]


def test_groups_share_devices_made_once_and_callers_own_options_are_kept(monkeypatch):
    from serve_app.vllm_plugins import gloo_device

    def fake_gloo() -> type:
        class FakeGloo:
            class _Options:
                def __init__(self):
                    self._timeout = None
                    self._devices = []

            made: list = []

            @staticmethod
            def create_default_device():
                FakeGloo.made.append(("default",))
                return FakeGloo.made[-1]

            @staticmethod
            def create_device(interface=""):
                FakeGloo.made.append(("interface", interface))
                return FakeGloo.made[-1]

            def __init__(self, store, rank, size, options):
                self.options = options

        FakeGloo.__init__ = gloo_device.shared_device_init(FakeGloo)
        return FakeGloo

    monkeypatch.delenv(gloo_device.IFNAME_ENV, raising=False)
    gloo = fake_gloo()
    first, second = gloo("store", 0, 1, timeout=datetime.timedelta(seconds=5)), gloo("store", 0, 1)
    assert first.options._devices == second.options._devices == [("default",)] == gloo.made
    assert first.options._timeout.total_seconds() == 5 and second.options._timeout is None
    own = gloo._Options()
    assert gloo("store", 0, 1, own).options is own
    # torch makes one device per interface named in GLOO_SOCKET_IFNAME; so does the shared set.
    monkeypatch.setenv(gloo_device.IFNAME_ENV, "lo,eth0")
    gloo = fake_gloo()
    assert gloo("store", 0, 1).options._devices == gloo("store", 0, 1).options._devices == [("interface", "lo"), ("interface", "eth0")]
    assert len(gloo.made) == 2
