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
