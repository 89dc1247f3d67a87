import gc
import weakref

from serve_app.runtime.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: object = self


def test_freezes_the_live_heap_and_collects_startup_garbage_first() -> None:
    kept = Node()
    garbage = Node()  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap("test")
        assert dead() is None  # collected, not frozen for the life of the process
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # in the permanent generation
        later = Node()  # what is made afterwards is tracked, and collected, as usual
        later_ref = weakref.ref(later)
        assert any(obj is later for obj in gc.get_objects())
        del later
        gc.collect()
        assert later_ref() is None
    finally:
        gc.unfreeze()


def test_collection_paused_runs_no_automatic_collection_and_restores_the_collector() -> None:
    import pytest

    from serve_app.runtime.gc_heap import collection_paused

    assert gc.isenabled()
    collections = []
    gc.callbacks.append(collect := lambda phase, info: collections.append(phase))
    try:
        with collection_paused():
            assert not gc.isenabled()
            keep = [Node() for _ in range(50_000)]  # enough to trigger young collections if enabled
            inside = len(collections)
        assert inside == 0 and gc.isenabled() and keep
        with pytest.raises(RuntimeError), collection_paused():
            raise RuntimeError("a start that fails")
        assert gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(collect)


def test_an_engine_replica_starts_its_engine_with_the_collector_paused_then_freezes_the_heap(tmp_path, monkeypatch) -> None:
    """The engine replica's start (here a mock engine's) runs with no automatic collection; the
    collector is back on, and the start-up heap frozen, once the replica is up."""
    import asyncio
    from unittest import mock

    from serve_app.config.backends import pool_spec
    from serve_app.config.settings import load_config
    from serve_app.engines.decode import Decode
    from serve_app.engines.mock_runner import MockEngine
    from serve_app.runtime.slots import SLOT_DIR_ENV
    from tests.support.inprocess import args, kv_port_base, null_engine_metrics

    monkeypatch.setenv(SLOT_DIR_ENV, str(tmp_path))
    spec = pool_spec(load_config({"kv_port_base": kv_port_base(), **args()}), "decode")
    seen: list[bool] = []
    start = MockEngine.start

    async def recording_start(self: MockEngine) -> None:
        seen.append(gc.isenabled())
        await start(self)

    async def body() -> None:
        server = Decode.func_or_class.__new__(Decode.func_or_class)
        with (
            mock.patch.object(MockEngine, "start", recording_start),
            mock.patch("serve_app.engines.server.replica_identity", return_value=(0, "r0")),
            mock.patch("serve_app.engines.server.engine_metrics", null_engine_metrics),
        ):
            await server.__init__(spec)
        try:
            assert seen == [False] and gc.isenabled() and gc.get_freeze_count() > 0
        finally:
            if server.call_server is not None:
                await server.call_server.stop()
            stopping = server.__del__()
            if stopping is not None:
                await stopping

    try:
        asyncio.run(body())
    finally:
        gc.enable()
        gc.unfreeze()
