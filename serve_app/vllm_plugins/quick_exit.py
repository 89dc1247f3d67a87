"""An engine's child processes exit without a last garbage collection over their whole heap.

When Serve stops an engine replica (scale-down, a redeploy, ``serve.delete``), vLLM shuts the
engine down: the EngineCore waits for its worker to exit, then exits itself, and the replica
waits for both. On shutdown vLLM un-freezes the start-up heap it froze (so that an engine
deleted inside a process that lives on frees its memory), so the interpreter's final collections
then traverse every object torch, vLLM and transformers created. py-spy on this 2-core host:
1.8 s of a worker's exit and 1.3 s of the EngineCore's went there, one after the other (an
engine's shutdown 4.5 s, 1.4 s with this plug-in); under load the worker overran vLLM's 5 s grace
and was killed. In a process that is about to end that work frees nothing anyone can use.

``install`` is a vLLM general plug-in (pyproject's ``vllm.general_plugins``). In a child process of
a pd-serve engine (the parent watchdog's marker in its environment, and a multiprocessing
parent) it registers ``gc.freeze`` at exit. Freezing stops no exit handler from running; by then
vLLM's explicit teardown (message queues, process groups) has run, and objects are still
released by reference counting as the interpreter tears its modules down. Only cyclic garbage
left at exit is not collected, which the process's end frees anyway.

Before it, under Serve each engine's stop overran vLLM's 5 s grace and its EngineCore was
SIGKILLed, which left the shared-memory segments of its message queues in /dev/shm (sparse files
of 168 and 252 MB each). Stops now leave none; a replica Ray kills (``ray stop --force``, a lost
node, ``ray.shutdown``) still does, since Ray kills its whole process group, Python's resource
tracker (which would unlink them) included.
"""

from __future__ import annotations

import atexit
import gc

from serve_app.vllm_plugins.processes import pd_serve_engine_child

_installed = False


def install() -> None:
    global _installed
    if _installed or not pd_serve_engine_child():
        return
    _installed = True
    atexit.register(gc.freeze)
