"""Seeded sampling on vLLM's CPU engines: safe under chunked prefill, and exact across a recompute.

A request with a ``seed`` (and ``temperature > 0``) gets its own ``torch.Generator``, made in the
model runner from the seed (``GPUModelRunner._update_states``), and vLLM's CPU sampler
(``TopKTopPSampler.forward_cpu``) takes one draw from it at every step that samples for the
request. Two things go wrong with that here:

* A step that computes only part of a prompt (chunked prefill: a prompt longer than the step's
  token budget, or several prompts sharing it) samples too, and vLLM throws that token away and
  undoes its draw with ``gen.set_offset(gen.get_offset() - 4)`` (``_bookkeeping_sync``), which
  only a CUDA generator supports. torch's CPU generator raises, and the engine core dies: any
  client could take a CPU engine down with a seeded long prompt, or two shorter ones at once.
* A resumed attempt (``wire.sampling.RESUMED_OUTPUT_TOKENS``) starts a new generator from the
  seed, so its sampling replays the first attempt's draws instead of going on from where the
  request had got to: the response is not the one an uninterrupted run gives.

``install`` is a vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point), active
where the engine's environment sets ``PD_SERVE_SEEDED_SAMPLING=1`` (the CPU backend does), in the
process that runs the model: a worker, or the engine's own process where vLLM runs it in-process
(the replica and the engine core would import the sampler and model runner for nothing, about a
second each). It gives each seeded request a ``StepGenerator`` (``step_generator.py``): the same
generator, which remembers its state before each sampling step so that vLLM's undo restores it,
and which skips, before its first step, the draws of the output tokens the earlier attempts
sampled. How many draws a step takes is
the sampler's business; the generator replays them with the sampler's own settings (its
float64 Gumbel noise or not, the vocabulary size), so the next draw is the one the request's own
uninterrupted run would take.

With speculative decoding vLLM's rejection sampler also draws from the generator; a resumed
attempt there is not reproducible (README, Limits). On Ascend, vllm-ascend samples on the NPU,
where generators have offsets: nothing here applies.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from serve_app.runtime.private_symbols import PATCHED, patch_once
from serve_app.vllm_plugins.processes import runs_the_model
from serve_app.wire.sampling import resumed_output_tokens

logger = logging.getLogger("pd_serve.engine")

ENV = "PD_SERVE_SEEDED_SAMPLING"

_STATE = "vllm.v1.worker.gpu_input_batch.CachedRequestState"
_SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler"
_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
SYMBOLS = (
    f"{_STATE}.__post_init__",
    f"{_SAMPLER}.forward_cpu",
    f"{_RUNNER}._update_states",
    f"{_RUNNER}._bookkeeping_sync",
    "vllm.v1.executor.multiproc_executor.WorkerProc.make_worker_process",
)


def install() -> None:
    if os.environ.get(ENV) != "1" or not runs_the_model():
        return
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
        from vllm.v1.worker.gpu_input_batch import CachedRequestState
    except ImportError:  # a vLLM without the V1 worker: nothing to do
        return
    if getattr(TopKTopPSampler.forward_cpu, PATCHED, False):
        return  # loaded before in this process
    without = "seeded sampling that survives chunked prefill and a recompute"
    if not patch_once(TopKTopPSampler, "forward_cpu", marking_steps, SYMBOLS, logger, without):
        # Not a lost optimisation: without it any client's seeded prompt computed in chunks kills
        # this CPU engine core (the warning above names what differs in this vLLM).
        raise RuntimeError(
            f"pd-serve cannot install its seeded sampling on this vLLM, and without it a seeded prompt "
            f"computed in chunks kills the engine: run the vLLM pd-serve supports (or unset {ENV} to run without it)"
        )
    CachedRequestState.__post_init__ = with_step_generator(CachedRequestState.__post_init__)


def with_step_generator(post_init: Any) -> Any:
    """``CachedRequestState.__post_init__``, then its CPU generator (a seeded request's) swapped
    for a ``StepGenerator`` that skips the steps of the earlier attempts' output."""
    from serve_app.vllm_plugins.step_generator import StepGenerator

    def __post_init__(self: Any) -> None:  # noqa: N807
        post_init(self)
        generator = self.generator
        if generator is None or isinstance(generator, StepGenerator) or generator.device.type != "cpu":
            return
        self.generator = StepGenerator.like(generator, skip_steps=earlier_steps(self.sampling_params))

    return __post_init__


def earlier_steps(params: Any) -> int:
    """The sampling steps a resumed attempt's earlier attempts took: one per output token. Never
    raises: this runs in the model runner, where an exception ends the engine (the router alone
    sets the mark, and the decode engines' logits processor refuses a bad one at admission)."""
    if params is None:
        return 0
    try:
        return resumed_output_tokens(params)
    except ValueError:
        logger.warning("seeded sampling: a malformed resumed-attempt mark was ignored")
        return 0


def marking_steps(original: Any) -> Any:
    """``TopKTopPSampler.forward_cpu`` that lets each request's ``StepGenerator`` prepare first."""
    from serve_app.vllm_plugins.step_generator import StepGenerator

    def forward_cpu(self: Any, logits: Any, generators: dict[int, Any], k: Any, p: Any) -> Any:
        for generator in generators.values():
            if isinstance(generator, StepGenerator):
                generator.before_step(self.use_fp64_gumbel, logits.shape[-1])
        return original(self, logits, generators, k, p)

    return forward_cpu
