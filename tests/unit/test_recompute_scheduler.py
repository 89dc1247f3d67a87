"""RecomputeScheduler on a real vLLM ``Scheduler`` built from the tiny model's config.

Written in the style of vLLM's own scheduler tests (tests/v1/core/utils.py and
tests/v1/kv_connector/unit/utils.py in vLLM's repository): a real ``VllmConfig`` and
``KVCacheConfig`` with a handful of KV blocks, real ``Request`` objects, and a fake
``ModelRunnerOutput`` that samples one token per scheduled request. No model weights, no
engine, no Ray: only the scheduler's bookkeeping is exercised.

The workload (``PROMPT_LENS``) fills the pool exactly: r0 (the oldest) reaches a block
boundary first, at ``PRESSURE_STEP``, when no block is free, so vLLM picks the newest running
request, r2, as its preemption victim. The base ``Scheduler`` requeues r2 to recompute it
locally; RecomputeScheduler must instead finish it "recomputed" and leave r0 and r1 alone.

RecomputeScheduler overrides the private ``Scheduler._preempt_request``; the signature guard at
the end fails loudly when a vLLM upgrade changes that hook.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from serve_app.config.settings import DEFAULT_MODEL_DIR
from serve_app.kv.recompute_scheduler import RecomputeScheduler
from serve_app.wire.protocol import RECOMPUTED

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_TOKENS = 8
# Oldest first. r0 crosses into its second block at step 2; r2 (the newest) holds two blocks.
PROMPT_LENS = {"r0": 15, "r1": 10, "r2": 20}
# The block pool keeps one null block; the other four are exactly what the prompts fill.
NUM_BLOCKS = 1 + 1 + 1 + 2
AMPLE_BLOCKS = 64
# Step 0 prefills all three, step 1 decodes all three, step 2 needs r0's second block.
PRESSURE_STEP = 2
VICTIM = "r2"
SURVIVORS = ("r0", "r1")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """ModelConfig reads the tiny model's config from disk; never ask the Hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# --- vLLM-style helpers ---------------------------------------------------------------------


def create_scheduler(scheduler_cls: type[Scheduler], num_blocks: int, policy: str = "fcfs") -> Scheduler:
    """Like vLLM's ``create_scheduler``, but from the tiny model's config and with its real
    KV layout (2 layers, 2 KV heads of 32, float32) as one full-attention group."""
    model_config = ModelConfig(model=str(DEFAULT_MODEL_DIR), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
            policy=policy,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
    )
    # The engine sets this after profiling; the scheduler asserts it is set.
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    hf = model_config.hf_config
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim, dtype=torch.float32),
            )
        ],
    )
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def create_requests(eos_token_id: int, priorities: dict[str, int] | None = None) -> dict[str, Request]:
    """Like vLLM's ``create_requests``: distinct prompts (no shared prefix), oldest first."""
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    requests = {}
    for i, (request_id, prompt_len) in enumerate(PROMPT_LENS.items()):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        params.update_from_generation_config({}, eos_token_id)
        requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=[3 + 100 * i + j for j in range(prompt_len)],
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=block_hasher,
            priority=(priorities or {}).get(request_id, 0),
        )
    return requests


def start(scheduler_cls: type[Scheduler], num_blocks: int = NUM_BLOCKS) -> tuple[Scheduler, dict[str, Request]]:
    scheduler = create_scheduler(scheduler_cls, num_blocks)
    requests = create_requests(scheduler.vllm_config.model_config.hf_config.eos_token_id)
    for request in requests.values():
        scheduler.add_request(request)
    return scheduler, requests


def fake_token(request_id: str, num_output_tokens: int) -> int:
    """A deterministic token per (request, position), so a misplaced token shows."""
    return 10 + 97 * int(request_id[1:]) + num_output_tokens


def create_model_runner_output(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """Like vLLM's ``create_model_runner_output``: one sampled token per scheduled request
    whose prompt is done (a partial prefill chunk samples nothing, as the real runner does)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens  # already advanced by schedule()
        sampled.append([fake_token(req_id, request.num_output_tokens)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def finish(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> dict[str, EngineCoreOutput]:
    """``update_from_output`` with the fake runner's output, flattened by request id."""
    outputs = scheduler.update_from_output(scheduler_output, create_model_runner_output(scheduler, scheduler_output))
    flat = {}
    for client_outputs in outputs.values():
        for output in client_outputs.outputs:
            assert output.request_id not in flat, f"two outputs for {output.request_id} in one step"
            flat[output.request_id] = output
    return flat


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    scheduler_output = scheduler.schedule()
    return scheduler_output, finish(scheduler, scheduler_output)


def block_ids(scheduler: Scheduler, request_id: str) -> list[int]:
    # Read req_to_blocks without indexing it: it is a defaultdict, and a lookup would add the key.
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return [block.block_id for block in manager.req_to_blocks.get(request_id, ())]


def num_free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def free_block_ids(scheduler: Scheduler) -> set[int]:
    return {block.block_id for block in scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()}


def waiting_ids(scheduler: Scheduler) -> set[str]:
    return {r.request_id for r in scheduler.waiting} | {r.request_id for r in scheduler.kv_holding_waiting}


def running_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """vLLM's ``assert_scheduler_empty`` (tests/v1/kv_connector/unit/utils.py): no leaks."""
    # Scheduler metadata.
    assert len(scheduler.requests) == 0
    assert len(scheduler.waiting) == 0
    assert len(scheduler.kv_holding_waiting) == 0
    assert len(scheduler.deferred_waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_req_ids) == 0
    assert len(scheduler.finished_recving_kv_req_ids) == 0
    assert len(scheduler._inflight_prefills) == 0
    assert len(scheduler.deferred_frees) == 0
    assert scheduler.get_num_unfinished_requests() == 0
    if isinstance(scheduler, RecomputeScheduler):
        assert scheduler._given_back == []
    # Encoder cache manager.
    assert len(scheduler.encoder_cache_manager.freed) == 0
    assert len(scheduler.encoder_cache_manager.cached) == 0
    # KV cache manager.
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert len(manager.req_to_blocks) == 0
    assert len(manager.num_cached_block) == 0
    block_pool = scheduler.kv_cache_manager.block_pool
    assert block_pool.free_block_queue.num_free_blocks == block_pool.num_gpu_blocks - 1  # all but the null block
    # Only the ref counts drop to 0; prefix-cache hashes stay until a block is evicted.
    for block in block_pool.blocks:
        assert block.ref_cnt == 0


def run_to_pressure(scheduler: Scheduler, requests: dict[str, Request]) -> None:
    """Steps 0..PRESSURE_STEP-1: everyone prefills and decodes, no finishes, pool full."""
    for n in range(PRESSURE_STEP):
        scheduler_output, outputs = step(scheduler)
        assert set(scheduler_output.num_scheduled_tokens) == set(PROMPT_LENS), f"step {n}"
        assert all(output.finish_reason is None for output in outputs.values()), f"step {n}"
    assert running_ids(scheduler) == list(PROMPT_LENS)
    assert num_free_blocks(scheduler) == 0
    assert [len(block_ids(scheduler, rid)) for rid in PROMPT_LENS] == [1, 1, 2]
    # r0 has filled its block: its next decode needs a new one.
    assert requests["r0"].num_computed_tokens == BLOCK_SIZE


def run_to_completion(scheduler: Scheduler, max_steps: int = 50) -> dict[str, tuple[list[int], EngineCoreOutput]]:
    """Step until nothing is unfinished; return each request's streamed tokens and final output."""
    streamed: dict[str, list[int]] = {}
    final: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler)
        for request_id, output in outputs.items():
            assert request_id not in final, f"{request_id} produced output after finishing"
            streamed.setdefault(request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                final[request_id] = output
    else:
        pytest.fail(f"requests still unfinished after {max_steps} steps")
    # One more step flushes finished_req_ids to the (fake) workers, as the engine's next step would.
    scheduler_output, outputs = step(scheduler)
    assert scheduler_output.total_num_scheduled_tokens == 0 and outputs == {}
    return {request_id: (streamed.get(request_id, []), final[request_id]) for request_id in final}


def snapshot(requests: dict[str, Request]) -> dict[str, tuple[int, list[int]]]:
    return {rid: (r.num_computed_tokens, list(r.output_token_ids)) for rid, r in requests.items()}


# --- tests ----------------------------------------------------------------------------------


def test_victim_is_given_back_with_blocks_freed_at_once_and_others_untouched():
    scheduler, requests = start(RecomputeScheduler)
    run_to_pressure(scheduler, requests)
    victim = requests[VICTIM]
    victim_blocks = block_ids(scheduler, VICTIM)
    before = snapshot(requests)

    scheduler_output = scheduler.schedule()

    # Inside schedule(), at once: finished "recomputed", gone from every queue, blocks released.
    assert victim.status == RequestStatus.FINISHED_STOPPED
    assert victim.stop_reason == RECOMPUTED
    assert VICTIM not in scheduler.requests
    assert VICTIM not in running_ids(scheduler) and VICTIM not in waiting_ids(scheduler)
    assert running_ids(scheduler) == list(SURVIVORS)
    assert block_ids(scheduler, VICTIM) == []
    # r0 took one of the victim's two blocks; the other is back in the free pool right now.
    assert num_free_blocks(scheduler) == 0 + len(victim_blocks) - 1
    cached = scheduler_output.scheduled_cached_reqs
    (r0_new_blocks,) = cached.new_block_ids[cached.req_ids.index("r0")]
    assert len(r0_new_blocks) == 1 and r0_new_blocks[0] in victim_blocks
    assert free_block_ids(scheduler) == set(victim_blocks) - set(r0_new_blocks)
    # The workers are told the victim is finished (drop its state), not preempted.
    assert scheduler_output.finished_req_ids == {VICTIM}
    assert not scheduler_output.preempted_req_ids
    assert scheduler_output.num_scheduled_tokens == dict.fromkeys(SURVIVORS, 1)
    assert victim.num_preemptions == 1  # counted as vLLM counts its own preemptions
    assert scheduler.num_given_back == 1

    outputs = finish(scheduler, scheduler_output)

    # The victim's end: finish_reason stop, stop_reason "recomputed", no new tokens.
    end = outputs[VICTIM]
    assert end.new_token_ids == []
    assert end.finish_reason == FinishReason.STOP
    assert end.stop_reason == RECOMPUTED
    # vLLM's metrics count it as a preemption (vllm:num_preemptions), as they would vLLM's own.
    assert EngineCoreEventType.PREEMPTED in [event.type for event in end.events or []]
    # Everything it streamed before stays valid: no token dropped, none added.
    assert list(victim.output_token_ids) == before[VICTIM][1]
    assert len(victim.output_token_ids) == PRESSURE_STEP
    # The others decoded this step exactly as if nothing had happened.
    for rid in SURVIVORS:
        computed, tokens = before[rid]
        assert requests[rid].num_computed_tokens == computed + 1
        assert outputs[rid].new_token_ids == [fake_token(rid, len(tokens))]
        assert outputs[rid].finish_reason is None
        assert list(requests[rid].output_token_ids) == [*tokens, fake_token(rid, len(tokens))]
    assert set(outputs) == {VICTIM, *SURVIVORS}

    # ... and keep decoding on the next step; the victim never comes back.
    scheduler_output, outputs = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == dict.fromkeys(SURVIVORS, 1)
    assert not scheduler_output.finished_req_ids and not scheduler_output.preempted_req_ids
    assert set(outputs) == set(SURVIVORS)
    assert scheduler.num_given_back == 1


def test_under_priority_scheduling_the_request_of_latest_priority_is_given_back():
    """vLLM's priority policy picks the victim (the running request of the latest priority, not
    the newest); the override changes only what becomes of it."""
    scheduler = create_scheduler(RecomputeScheduler, NUM_BLOCKS, policy="priority")
    requests = create_requests(scheduler.vllm_config.model_config.hf_config.eos_token_id, priorities={"r1": 5})
    for request in requests.values():
        scheduler.add_request(request)
    for _ in range(PRESSURE_STEP):
        step(scheduler)
    assert num_free_blocks(scheduler) == 0 and requests["r0"].num_computed_tokens == BLOCK_SIZE

    scheduler_output = scheduler.schedule()

    assert requests["r1"].stop_reason == RECOMPUTED and scheduler.num_given_back == 1
    assert sorted(running_ids(scheduler)) == ["r0", "r2"] and scheduler_output.finished_req_ids == {"r1"}
    outputs = finish(scheduler, scheduler_output)
    end = outputs["r1"]
    assert end.new_token_ids == [] and end.stop_reason == RECOMPUTED and end.finish_reason == FinishReason.STOP
    assert [len(outputs[rid].new_token_ids) for rid in ("r0", "r2")] == [1, 1]  # the others decode on
    results = run_to_completion(scheduler)
    left = MAX_TOKENS - PRESSURE_STEP - 1
    assert {rid: len(tokens) for rid, (tokens, _) in results.items()} == {"r0": left, "r2": left}
    assert_scheduler_empty(scheduler)


def test_base_scheduler_preempts_the_same_victim_locally():
    """The contrast (and what a regression of RecomputeScheduler would look like): the base
    Scheduler frees the same victim's blocks but requeues it to recompute here, finishing nothing."""
    scheduler, requests = start(Scheduler)
    run_to_pressure(scheduler, requests)
    victim = requests[VICTIM]

    scheduler_output = scheduler.schedule()

    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0  # its context is recomputed from scratch, locally
    assert VICTIM in scheduler.requests and VICTIM in waiting_ids(scheduler)
    assert running_ids(scheduler) == list(SURVIVORS)
    assert block_ids(scheduler, VICTIM) == []
    assert scheduler_output.preempted_req_ids == {VICTIM}
    assert VICTIM not in scheduler_output.finished_req_ids
    assert scheduler_output.num_scheduled_tokens == dict.fromkeys(SURVIVORS, 1)

    outputs = finish(scheduler, scheduler_output)
    assert VICTIM not in outputs  # no finish, no stop_reason: the client never hears of it
    assert all(output.finish_reason is None for output in outputs.values())

    # Run on: the victim resumes here once blocks free up and gets all its tokens.
    results = run_to_completion(scheduler)
    assert set(results) == set(PROMPT_LENS)
    tokens, end = results[VICTIM]
    assert end.finish_reason == FinishReason.LENGTH and end.stop_reason != RECOMPUTED
    assert len(tokens) == MAX_TOKENS - PRESSURE_STEP
    assert_scheduler_empty(scheduler)


def test_scheduler_empty_after_run_to_completion_and_survivors_match_an_unpressured_run():
    ample, _ = start(RecomputeScheduler, AMPLE_BLOCKS)
    expected = run_to_completion(ample)
    assert ample.num_given_back == 0
    assert all(end.finish_reason == FinishReason.LENGTH for _, end in expected.values())
    assert_scheduler_empty(ample)

    scheduler, requests = start(RecomputeScheduler)
    results = run_to_completion(scheduler)
    assert scheduler.num_given_back == 1
    assert set(results) == set(PROMPT_LENS)
    # The survivors streamed exactly what they stream with no memory pressure at all.
    for rid in SURVIVORS:
        tokens, end = results[rid]
        assert tokens == expected[rid][0]
        assert (end.finish_reason, end.stop_reason) == (FinishReason.LENGTH, None)
        assert list(requests[rid].output_token_ids) == tokens
    # The victim streamed a prefix of that, then ended "recomputed" with nothing new.
    tokens, end = results[VICTIM]
    assert tokens == expected[VICTIM][0][:PRESSURE_STEP]
    assert (end.new_token_ids, end.finish_reason, end.stop_reason) == ([], FinishReason.STOP, RECOMPUTED)
    assert_scheduler_empty(scheduler)


def test_scheduler_empty_after_aborting_the_survivors():
    scheduler, requests = start(RecomputeScheduler)
    run_to_pressure(scheduler, requests)
    _, outputs = step(scheduler)
    assert outputs[VICTIM].stop_reason == RECOMPUTED

    # The victim is already gone: an abort for it (e.g. from the router) finds nothing.
    aborted = scheduler.finish_requests(list(PROMPT_LENS), RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in aborted) == sorted(SURVIVORS)
    assert requests[VICTIM].status == RequestStatus.FINISHED_STOPPED
    assert num_free_blocks(scheduler) == NUM_BLOCKS - 1

    scheduler_output, outputs = step(scheduler)
    assert scheduler_output.finished_req_ids == set(SURVIVORS)
    assert outputs == {}
    assert_scheduler_empty(scheduler)


def test_preempt_request_signature_matches_the_override():
    """RecomputeScheduler overrides private vLLM API: fail here, loudly, when it changes."""
    base = inspect.signature(Scheduler._preempt_request)
    names = list(base.parameters)
    assert names[:3] == ["self", "request", "timestamp"], f"Scheduler._preempt_request is now {base}"
    assert names[3:] in ([], ["drop_stale_output"]), f"Scheduler._preempt_request is now {base}"
    # Every call the base scheduler can make binds to the override.
    override = inspect.signature(RecomputeScheduler._preempt_request)
    assert set(base.parameters) <= set(override.parameters), f"{override} does not take all of {base}"
    for name, parameter in override.parameters.items():
        if name not in base.parameters:
            assert parameter.default is not inspect.Parameter.empty, f"override's extra {name} needs a default"
    # schedule() still preempts through the hook (and reset_prefix_cache(reset_running_requests=True) does too).
    assert "self._preempt_request(" in inspect.getsource(Scheduler.schedule)
    # The override frees the victim with _free_request(request).
    free = inspect.signature(Scheduler._free_request)
    assert list(free.parameters)[:2] == ["self", "request"], f"Scheduler._free_request is now {free}"
    assert all(p.default is not inspect.Parameter.empty for p in list(free.parameters.values())[2:])


def test_a_changed_hook_leaves_vllms_own_preemption_in_place(monkeypatch, caplog):
    """Where vLLM's private hooks are not the ones the override was written against, the
    scheduler stands aside (logged, naming the symbol): it preempts as vLLM does, gives nothing back."""
    import logging

    from serve_app.kv.recompute_scheduler import SYMBOLS

    original = Scheduler._free_request

    def _free_request(self, request, delay_free_blocks=False, reason=None):
        return original(self, request, delay_free_blocks)

    monkeypatch.setattr(Scheduler, "_free_request", _free_request)
    with caplog.at_level(logging.WARNING, "pd_serve.kv"):
        scheduler, requests = start(RecomputeScheduler)
    assert any(SYMBOLS[1] in r.getMessage() and "signature is now" in r.getMessage() for r in caplog.records)
    run_to_pressure(scheduler, requests)
    scheduler_output = scheduler.schedule()
    assert requests[VICTIM].status == RequestStatus.PREEMPTED
    assert scheduler_output.preempted_req_ids == {VICTIM}
    assert scheduler.num_given_back == 0
    finish(scheduler, scheduler_output)
    results = run_to_completion(scheduler)
    assert all(end.stop_reason != RECOMPUTED for _, end in results.values())
    assert_scheduler_empty(scheduler)
