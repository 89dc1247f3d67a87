"""A CPU sampling generator that can undo a step and skip ahead (vllm_plugins/seeded_sampling.py
says why vLLM's CPU engines need one)."""

from __future__ import annotations

import torch

# What vLLM's undo of one step's draw takes off a generator's offset (a CUDA Philox generator
# counts in fours); ``StepGenerator`` counts its steps in the same unit.
STEP_OFFSET = 4


class StepGenerator(torch.Generator):
    """A CPU generator whose last sampling step can be undone, and which first skips the draws of
    ``skip_steps`` steps. torch's own CPU generator has no offset to rewind."""

    skip_steps = 0
    _steps = 0
    _before_step: torch.Tensor | None = None

    @classmethod
    def like(cls, generator: torch.Generator, *, skip_steps: int = 0) -> StepGenerator:
        """A ``StepGenerator`` in ``generator``'s state (vLLM made it from the request's seed)."""
        step_generator = cls(generator.device)
        step_generator.set_state(generator.get_state())
        step_generator.skip_steps = skip_steps
        return step_generator

    def before_step(self, use_fp64_gumbel: bool, vocab_size: int) -> None:
        """Called by the sampler before it draws for this request: skip what is still to be
        skipped, as the sampler would have drawn it, then remember the state."""
        for _ in range(self.skip_steps):
            draw(self, use_fp64_gumbel, vocab_size)
        self.skip_steps = 0
        self._before_step = self.get_state()
        self._steps += 1

    def get_offset(self) -> int:
        return self._steps * STEP_OFFSET

    def set_offset(self, offset: int) -> None:
        if self._before_step is None or offset != (self._steps - 1) * STEP_OFFSET:
            raise RuntimeError("a CPU sampling generator can undo its last step's draw only")
        self.set_state(self._before_step)
        self._before_step = None
        self._steps -= 1


def draw(generator: torch.Generator, use_fp64_gumbel: bool, vocab_size: int) -> None:
    """One sampling step's draw for one request, as ``TopKTopPSampler.forward_cpu`` takes it."""
    if use_fp64_gumbel:
        torch.empty(vocab_size, dtype=torch.float64).exponential_(generator=generator)
    else:
        torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
