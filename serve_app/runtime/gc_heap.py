"""Keep the garbage collector off the heap a replica built at start.

A replica starts by importing and building a great deal that lives as long as it does: vLLM's
protocol modules, transformers, the tokenizer, Ray's and Serve's own state (hundreds of
thousands of objects the collector tracks in a router replica). Python's collector walks all of
them in every full collection, and serving a steady stream of requests triggers one every few
seconds (each request's objects that outlive two young collections count towards it), each a
pause of some 0.4 s for every stream in flight. Frozen, the start-up heap is never walked again
(docs/performance.md, "What made the difference"). vLLM's OpenAI server freezes its start-up
heap for the same reason, so the benchmark's yardstick already does this.
"""

from __future__ import annotations

import gc
import logging

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
