"""An engine replica's slot on its node (runtime/slots.py): two live engines of a pool never
share a KV port block, even where Serve gives a new replica a rank that a live one was started
with."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from unittest import mock

import pytest

from serve_app.config.backends import pool_spec
from serve_app.config.settings import load_config
from serve_app.runtime.slots import SLOT_DIR_ENV, claim_slot
from tests.support.inprocess import args, kv_port_base, null_engine_metrics


@pytest.fixture(autouse=True)
def slot_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(SLOT_DIR_ENV, str(tmp_path))
    return tmp_path


def test_a_slot_is_held_while_its_holder_lives_and_free_once_it_is_gone():
    first = claim_slot("36000-decode", 1)
    second = claim_slot("36000-decode", 1)
    other_pool = claim_slot("36000-prefill", 1)
    assert (first.number, second.number, other_pool.number) == (1, 2, 1)
    first.release()
    assert claim_slot("36000-decode", 1).number == 1


def test_a_slot_another_process_holds_is_skipped_and_freed_when_that_process_is_killed(slot_dir):
    code = f"import os, sys, time; os.environ[{SLOT_DIR_ENV!r}] = {str(slot_dir)!r}; "
    code += "from serve_app.runtime.slots import claim_slot; s = claim_slot('36000-decode', 0); print(s.number, flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        assert claim_slot("36000-decode", 0).number == 1
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
    deadline = time.monotonic() + 5
    while (slot := claim_slot("36000-decode", 0)).number != 0:
        slot.release()
        assert time.monotonic() < deadline, "the killed process's slot was not freed"


def test_two_replicas_serve_gives_one_rank_get_kv_port_blocks_of_their_own():
    """Ray Serve renumbers live replicas' ranks when a pool shrinks (ranks 0, 1, 2; rank 0
    stops; the replica started as rank 2 is now rank 1), and gives the next new replica rank 2
    again. The live one still binds what rank 2 gave it: the new one must take another slot."""
    config = load_config({"kv_port_base": kv_port_base(), **args(decode={"num_replicas": 4})})
    spec = pool_spec(config, "decode")
    asyncio.run(start_two(spec))


async def start_two(spec) -> None:
    from serve_app.engines.decode import Decode

    servers = []
    try:
        for replica_id in ("started-as-rank-2", "given-rank-2-again"):
            server = Decode.func_or_class.__new__(Decode.func_or_class)
            with (
                mock.patch("serve_app.engines.server.replica_identity", return_value=(2, replica_id)),
                mock.patch("serve_app.engines.server.freeze_startup_heap"),
                mock.patch("serve_app.engines.server.engine_metrics", null_engine_metrics),
            ):
                await server.__init__(spec)
            servers.append(server)
        old, new = (s.spec for s in servers)
        assert old.kv_port != new.kv_port and (old.kv_port - new.kv_port) % 16 == 0
        assert old.name == new.name == "decode-2"  # the router tells them apart (test_pools.py)
    finally:
        for server in servers:
            if server.call_server is not None:
                await server.call_server.stop()
            stopping = server.__del__()
            if stopping is not None:
                await stopping
