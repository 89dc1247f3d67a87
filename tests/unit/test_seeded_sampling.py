"""Seeded sampling on the CPU (vllm_plugins/seeded_sampling.py, step_generator.py) against vLLM's
own CPU sampler, ``TopKTopPSampler.forward_cpu``: a ``StepGenerator`` draws what torch's generator
draws, undoes a thrown-away step as vLLM's model runner asks, and a resumed one samples what the
uninterrupted request sampled next. tests/integration/test_seeded_sampling.py runs it in a real
engine; test_recompute_e2e.py through a recompute."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import vllm._custom_ops  # noqa: F401  (registers the CPU sampler's fused kernel)
from vllm import SamplingParams
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState

from serve_app.config.backends import CPU
from serve_app.vllm_plugins import seeded_sampling
from serve_app.vllm_plugins.processes import WORKER_PROCESS
from serve_app.vllm_plugins.seeded_sampling import (
    ENV,
    earlier_steps,
    install,
    marking_steps,
    runs_the_model,
    with_step_generator,
)
from serve_app.vllm_plugins.step_generator import STEP_OFFSET, StepGenerator
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS

VOCAB = 512
STEPS = 12
SEED = 7
ROW = 1  # the seeded request's row; the others sample from the global generator


@pytest.fixture
def patched(monkeypatch):
    """vLLM's classes as the plug-in leaves them, restored afterwards."""
    monkeypatch.setattr(TopKTopPSampler, "forward_cpu", marking_steps(TopKTopPSampler.forward_cpu))
    monkeypatch.setattr(CachedRequestState, "__post_init__", with_step_generator(CachedRequestState.__post_init__))


def step_logits() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(3, VOCAB) for _ in range(STEPS)]


def seeded() -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(SEED)
    return generator


def sample(sampler: TopKTopPSampler, generator: torch.Generator, steps: list[torch.Tensor], top_p: float | None) -> list[int]:
    p = None if top_p is None else torch.full((3,), top_p)
    tokens, _ = zip(*(sampler.forward(logits.clone(), {ROW: generator}, None, p) for logits in steps))
    return [int(t[ROW]) for t in tokens]


SAMPLERS = [pytest.param(False, id="gumbel-seeds"), pytest.param(True, id="fp64-gumbel")]


@pytest.mark.parametrize("fp64", SAMPLERS)
@pytest.mark.parametrize("top_p", [None, 0.8])
def test_a_resumed_generator_samples_what_the_uninterrupted_request_sampled_next(patched, fp64, top_p):
    sampler = TopKTopPSampler(use_fp64_gumbel=fp64)
    steps = step_logits()
    plain = sample(sampler, seeded(), steps, top_p)
    assert sample(sampler, StepGenerator.like(seeded()), steps, top_p) == plain  # the same draws as torch's
    for earlier in (1, 5, STEPS - 1):
        resumed = sample(sampler, StepGenerator.like(seeded(), skip_steps=earlier), steps[earlier:], top_p)
        assert resumed == plain[earlier:]
    # The premise: a generator made afresh from the seed samples something else.
    assert sample(sampler, seeded(), steps[5:], top_p) != plain[5:]


@pytest.mark.parametrize("fp64", SAMPLERS)
def test_a_thrown_away_step_is_undone_as_vllm_undoes_it(patched, fp64):
    """A chunk of a prompt samples too; vLLM throws the token away and takes one step's draw back
    with ``gen.set_offset(gen.get_offset() - 4)`` (GPUModelRunner._bookkeeping_sync)."""
    sampler = TopKTopPSampler(use_fp64_gumbel=fp64)
    steps = step_logits()
    plain = sample(sampler, seeded(), steps, None)
    generator = StepGenerator.like(seeded(), skip_steps=2)
    got = []
    for i, logits in enumerate(steps[2:], start=2):
        if i in (2, 3, 7):  # chunks before the sampled step
            sampler.forward(logits.clone(), {ROW: generator}, None, None)
            generator.set_offset(generator.get_offset() - STEP_OFFSET)
        tokens, _ = sampler.forward(logits.clone(), {ROW: generator}, None, None)
        got.append(int(tokens[ROW]))
    assert got == plain[2:]


def test_torch_cpu_generators_cannot_undo_a_draw():
    """Why vLLM's CPU engine dies on a seeded prompt it computes in chunks."""
    with pytest.raises(RuntimeError, match="offset"):
        seeded().get_offset()


def test_only_the_last_steps_draw_can_be_undone(patched):
    sampler = TopKTopPSampler()
    generator = StepGenerator.like(seeded())
    with pytest.raises(RuntimeError):
        generator.set_offset(generator.get_offset() - STEP_OFFSET)  # no step yet
    for logits in step_logits()[:2]:
        sampler.forward(logits, {ROW: generator}, None, None)
    assert generator.get_offset() == 2 * STEP_OFFSET
    with pytest.raises(RuntimeError):
        generator.set_offset(0)  # two steps back
    generator.set_offset(STEP_OFFSET)
    with pytest.raises(RuntimeError):
        generator.set_offset(0)  # the step before has no state kept


def request_state(params: SamplingParams | None, generator: torch.Generator | None) -> CachedRequestState:
    return CachedRequestState(
        req_id="r",
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=params,
        generator=generator,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


def test_a_seeded_requests_state_gets_a_step_generator_skipping_the_earlier_output(patched):
    params = SamplingParams(seed=SEED, temperature=1.0, extra_args={RESUMED_OUTPUT_TOKENS: 9})
    generator = seeded()
    state = request_state(params, generator)
    assert isinstance(state.generator, StepGenerator) and state.generator.skip_steps == 9
    assert torch.equal(state.generator.get_state(), generator.get_state())
    assert request_state(SamplingParams(seed=SEED, temperature=1.0), seeded()).generator.skip_steps == 0
    assert request_state(SamplingParams(temperature=1.0), None).generator is None


def test_a_malformed_mark_is_ignored_rather_than_ending_the_engine():
    for bad in (-1, "3", True, 2.5):
        assert earlier_steps(SamplingParams(extra_args={RESUMED_OUTPUT_TOKENS: bad})) == 0
    assert earlier_steps(None) == 0


def test_install_patches_only_where_the_environment_asks_in_the_models_process_and_once(monkeypatch):
    original_forward, original_post_init = TopKTopPSampler.forward_cpu, CachedRequestState.__post_init__
    monkeypatch.setattr(TopKTopPSampler, "forward_cpu", original_forward)
    monkeypatch.setattr(CachedRequestState, "__post_init__", original_post_init)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", f"{WORKER_PROCESS}0")
    install()
    assert TopKTopPSampler.forward_cpu is original_forward
    monkeypatch.setenv(ENV, "1")
    for name in ("EngineCore_DP0", "MainProcess"):  # the engine core and the replica: no model here
        monkeypatch.setattr(multiprocessing.current_process(), "name", name)
        install()
        assert TopKTopPSampler.forward_cpu is original_forward
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # ... unless vLLM runs the model in-process
    assert runs_the_model()
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(multiprocessing.current_process(), "name", f"{WORKER_PROCESS}0")
    install()
    patched_forward = TopKTopPSampler.forward_cpu
    assert patched_forward is not original_forward and CachedRequestState.__post_init__ is not original_post_init
    install()
    assert TopKTopPSampler.forward_cpu is patched_forward


def test_the_cpu_backend_turns_it_on_for_its_engines():
    assert CPU.engine_env[seeded_sampling.ENV] == "1"


def test_an_engine_does_not_start_without_it_where_its_environment_asks_for_it(monkeypatch):
    """Not an optimisation to stand aside from: without it any client's seeded prompt computed in
    chunks kills a CPU engine core. A vLLM whose symbols differ fails the engine's start, loudly."""
    from serve_app.runtime import private_symbols

    monkeypatch.setattr(TopKTopPSampler, "forward_cpu", TopKTopPSampler.forward_cpu)
    monkeypatch.setattr(CachedRequestState, "__post_init__", CachedRequestState.__post_init__)
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(multiprocessing.current_process(), "name", f"{WORKER_PROCESS}0")
    monkeypatch.setattr(private_symbols, "unchanged", lambda *args, **kwargs: False)
    with pytest.raises(RuntimeError, match="seeded prompt computed in chunks"):
        install()


def test_the_cpu_backend_keeps_vllms_v1_model_runner_whose_sampler_the_plugins_patch(monkeypatch):
    """vLLM 0.32 takes its V2 model runner wherever Triton imports (triton-cpu on x86): there the
    decode engines' logits processor is refused at start and seeded sampling is left out."""
    import vllm.envs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", CPU.engine_env["VLLM_USE_V2_MODEL_RUNNER"])
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is False
