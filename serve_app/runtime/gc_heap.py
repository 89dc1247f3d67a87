"""Keep the garbage collector off the heap a replica built at start.

A replica starts by importing and building a great deal that lives as long as it does: vLLM's
protocol modules, transformers, the tokenizer, Ray's and Serve's own state (hundreds of
thousands of objects the collector tracks in a router replica). Python's collector walks all of
them in every full collection, and serving a steady stream of requests triggers one every few
seconds (each request's objects that outlive two young collections count towards it), each a
pause of some 0.4 s for every stream in flight. Frozen, the start-up heap is never walked again
(docs/performance.md, "What made the difference"). vLLM's OpenAI server freezes its start-up
heap for the same reason, so the benchmark's yardstick already does this.

While that heap is built, the collector's full collections walk it again and again as it grows
(each time it grows by a quarter): an engine replica's import of vLLM and its engine's
configuration ran 9 of them, 1.2 s of CPU on this class of host. An engine replica builds its
start-up heap with the collector paused: vLLM's AsyncLLM on the tiny model, started in a fresh
process with the collector off there until it runs, was running 18.2 s after launch instead of
22.5 s (means of three starts each, alternated, on this 2-core host).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("pd_serve")


def freeze_startup_heap(owner: str) -> int:
    """Collect what start-up left as garbage, then move every surviving object to the
    collector's permanent generation, which no collection walks. Objects made later are
    collected as usual. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects from start-up frozen out of garbage collection", owner, frozen)
    return frozen


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection inside: for building a heap that lives as long as the process
    (what start-up leaves as garbage is collected by ``freeze_startup_heap`` after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
