"""A mock engine (``backend: mock``): vLLM's engine interface at a chosen cost, with no model and
no torch import. It is a benchmark and test tool, never a default.

It behaves like the real engines where the router can tell: token ids are a deterministic
function of the sequence so far (so a resumed attempt continues exactly where the last one
stopped), a decode engine steps all its running requests together every ``decode_step_s``, a
prompt costs ``prefill_s_per_token`` per uncached token, and KV capacity is counted in tokens: a
decode engine that runs out finishes its newest request with ``stop_reason="recomputed"``.

Disaggregated attempts go through the same motions as with the real connector: the decode engine
"allocates" the prompt's KV, POSTs its KV parameters (with a transfer secret) to the request's
metaserver URL and waits; the prefill engine computes the prompt and then "pushes" by telling
the decode engine's side channel (a line of JSON over TCP, to the host and port the KVReady
named) that the transfer is done; only then does decode start sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from serve_app.engines.pacing import FinishSignal, StreamPacer
from serve_app.engines.records import Recent, TransferRecords
from serve_app.wire.protocol import RECOMPUTED, EngineRequest, EngineStats, KVEndpoint, Role, TokenDelta, TokenLogprob
from serve_app.wire.sampling import RESUMED_OUTPUT_TOKENS, sampling_fields

logger = logging.getLogger("pd_serve.engine")

MOCK_VOCAB = 1000
FIRST_TOKEN_ID = 10


def next_token(sequence: list[int]) -> int:
    """The mock model: the next token depends only on the sequence so far (its last two tokens
    and its length)."""
    return _next(sequence[-1] if sequence else 1, sequence[-2] if len(sequence) > 1 else 7, len(sequence))


def _next(last: int, before_last: int, length: int) -> int:
    return (last * 1103515245 + before_last * 12345 + length * 2654435761) % MOCK_VOCAB + FIRST_TOKEN_ID


async def _post_json(url: str, body: dict[str, Any]) -> None:
    """A bare HTTP/1.1 POST (the metaserver callback): the mock should cost the host little, so
    that what a benchmark on it measures is the router."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        await reader.read()  # the relay's answer; its status does not matter to the mock
    finally:
        writer.close()


@dataclass(frozen=True)
class MockCosts:
    prefill_s_per_token: float
    decode_step_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    recv_timeout_s: float = 60.0


@dataclass
class _Sequence:
    request_id: str
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    logprobs: int | None
    recomputes: bool  # finish with "recomputed" when KV runs out (else wait, as vLLM preempts)
    output: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # produced, not yet handed to the stream
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    prompt_logprobs: int | None = None
    kv_ready: bool = True  # False while a disaggregated attempt waits for its push
    transfer: tuple[str, str] | None = None  # (transfer id, secret) while waiting
    deadline: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    finish: FinishSignal = field(default_factory=FinishSignal)  # ends the stream's pacing wait

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class MockEngine:
    """The engine-runner interface (engines/runner.py: ``generate``, ``abort``, ``stats``, ...) without a model."""

    def __init__(
        self, name: str, role: Role, costs: MockCosts, endpoint: KVEndpoint | None, recompute: bool, pacer: StreamPacer | None = None
    ) -> None:
        self.name = name
        self.pacer = pacer or StreamPacer()
        self.role = role
        self.costs = costs
        self.endpoint = endpoint
        self.recompute = recompute
        self.kv_capacity_tokens = costs.kv_capacity_tokens
        self.requests = Recent()
        self.records = TransferRecords()
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._work = asyncio.Event()  # set when a request joins the waiting queue
        self._compute = asyncio.Lock()  # one prompt computed at a time, as one engine would
        self._tasks: list[asyncio.Task] = []
        self._server: asyncio.AbstractServer | None = None
        self.post_callback = _post_json  # the metaserver POST (tests replace it to lose callbacks)

    async def start(self) -> None:
        if self.role == "decode":
            self._tasks.append(asyncio.get_running_loop().create_task(self._step_loop()))
            if self.endpoint is not None:
                self._server = await asyncio.start_server(self._side_channel, self.endpoint.host, self.endpoint.port)
        logger.info("mock engine %s (%s) started, KV capacity %d tokens", self.name, self.role, self.kv_capacity_tokens)

    # ------------------------------------------------------------------ the runner interface
    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        fields = sampling_fields(request.sampling_params)
        seq = _Sequence(
            request_id=request.request_id,
            prompt=list(request.prompt_token_ids),
            max_tokens=int(fields.get("max_tokens") or 16),
            min_tokens=int(fields.get("min_tokens") or 0),
            stop_token_ids=frozenset(fields.get("stop_token_ids") or ()),
            logprobs=fields.get("logprobs"),
            prompt_logprobs=fields.get("prompt_logprobs"),
            recomputes=self.recompute,
        )
        record: dict[str, Any] = {"prompt_tokens": len(seq.prompt), "output_tokens": 0, "finish_reason": None}
        if resumed := (fields.get("extra_args") or {}).get(RESUMED_OUTPUT_TOKENS):
            record["resumed_output_tokens"] = resumed  # the router's mark (vLLM's penalties read it)
        self.requests.put(seq.request_id, record)
        params = request.kv_transfer_params or {}
        if self.role == "prefill":
            async for delta in self._prefill(seq, params, record):
                yield delta
            return
        self._by_id[seq.request_id] = seq
        try:
            if params.get("do_remote_prefill"):
                await self._await_kv(seq, params)
            self._waiting.append(seq)
            self._work.set()
            first = True
            # Paced from its first output on, as vLLM's runner: a request still queued sends
            # nothing, and counting it would hold the streams that do (pacing.py).
            await seq.wake.wait()
            with self.pacer.stream() as pace:
                while True:
                    await seq.finish.hold(pace.wait_s())  # the steps meanwhile join the next delta
                    seq.wake.clear()
                    tokens, seq.pending = seq.pending, []
                    delta = TokenDelta(token_ids=tokens, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
                    if seq.logprobs is not None:
                        delta.logprobs = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in tokens]
                    if first:
                        if seq.prompt_logprobs is not None:  # the mock model's: -0.25 for every prompt token
                            delta.prompt_logprobs = [None] + [TokenLogprob(t, -0.25, ((t, -0.25),), rank=1) for t in seq.prompt[1:]]
                        delta.num_cached_tokens = seq.cached_tokens
                        record["num_cached_tokens"] = seq.cached_tokens
                        first = False
                    record["output_tokens"] += len(tokens)
                    record["finish_reason"], record["stop_reason"] = seq.finish_reason, seq.stop_reason
                    yield delta
                    pace.sent()
                    # The delta sent, not the sequence now: it may have finished while this
                    # generator waited at the yield, and that ending is the next delta's to tell.
                    if delta.finish_reason is not None:
                        return
                    await seq.wake.wait()
        finally:
            self._drop(seq)

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort", None)

    def held(self) -> list[str]:
        return list(self._by_id)

    async def check_health(self) -> None:
        for task in self._tasks:
            if task.done():
                raise RuntimeError(f"mock engine {self.name}: its step loop ended")

    def stats(self) -> EngineStats:
        used = sum(s.tokens for s in self._running) + sum(len(s.prompt) for s in self._waiting if not s.kv_ready)
        return EngineStats(
            name=self.name,
            role=self.role,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=min(1.0, used / self.kv_capacity_tokens) if self.kv_capacity_tokens else 0.0,
            kv_capacity_tokens=self.kv_capacity_tokens,
            inflight=len(self._by_id),
            healthy=all(not t.done() for t in self._tasks),
        )

    def transfers(self) -> dict[str, Any]:
        return self.records.all()

    async def transfer_record(self, transfer_id: str, timeout_s: float) -> dict[str, Any] | None:
        return await self.records.wait_for(transfer_id, timeout_s)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()

    # ------------------------------------------------------------------ decode
    async def _await_kv(self, seq: _Sequence, params: dict[str, Any]) -> None:
        """Allocate the prompt's KV, post the KV parameters, wait for prefill's push."""
        assert self.endpoint is not None
        transfer_id, secret = str(params.get("request_id") or seq.request_id), secrets.token_urlsafe(16)
        seq.kv_ready, seq.transfer = False, (transfer_id, secret)
        seq.deadline = time.monotonic() + self.costs.recv_timeout_s
        body = {
            "token_ids": [],
            "request_id": transfer_id,
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [0],
            "remote_block_size": 128,
            "remote_engine_id": self.endpoint.engine_id,
            "remote_host": self.endpoint.host,
            "remote_port": self.endpoint.port,
            "remote_tp_size": 1,
            "remote_cached_tokens": 0,
            "transfer_secret": secret,
        }
        url = params.get("metaserver")
        if url:
            with contextlib.suppress(OSError, ValueError):
                await self.post_callback(str(url), body)
        while not seq.kv_ready and seq.finish_reason is None:
            remaining = seq.deadline - time.monotonic()
            if remaining <= 0:
                self._finish(seq, "error", None)
                break
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
            # meets the wake-up, and the aborted stream would then run on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await seq.wake.wait()
            seq.wake.clear()
        seq.cached_tokens = len(seq.prompt)
        if seq.finish_reason is not None:
            seq.wake.set()  # the stream reports how it ended

    async def _side_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One JSON line per push, from whoever connects to the KV port. A line over the reader's
        limit (64 KiB; ValueError) closes the connection; nothing here is logged: a stranger's
        bytes are refused, not reported one traceback each."""
        try:
            while line := await reader.readline():
                ok = self._push_done(line)
                writer.write(b"ok\n" if ok else b"no\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    def _push_done(self, line: bytes) -> bool:
        try:
            message = json.loads(line)
            transfer_id, secret = str(message["transfer"]), str(message["secret"])
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past Python's limit
            return False
        for seq in self._by_id.values():
            if seq.transfer is not None and seq.transfer[0] == transfer_id:
                if not hmac.compare_digest(seq.transfer[1], secret):
                    return False
                seq.kv_ready, seq.transfer = True, None
                seq.wake.set()
                return True
        return False

    async def _step_loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                # Idle: no steps (an engine that spun here would take CPU from what is measured).
                self._work.clear()
                await self._work.wait()
            started = time.monotonic()
            await self._admit()
            self._step()
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.costs.decode_step_s - elapsed))

    async def _admit(self) -> None:
        """Waiting requests whose KV is here join the batch while there is room; a colocated one
        first pays for its prompt."""
        used = sum(s.tokens for s in self._running)
        for seq in list(self._waiting):
            if len(self._running) >= self.costs.max_num_seqs or used + seq.tokens + 1 > self.kv_capacity_tokens:
                break
            self._waiting.remove(seq)
            if seq.cached_tokens < seq.tokens:
                async with self._compute:
                    await asyncio.sleep(self.costs.prefill_s_per_token * (seq.tokens - seq.cached_tokens))
                if seq.finish_reason is not None:  # aborted during its prefill: it never runs
                    continue
            self._running.append(seq)
            used += seq.tokens

    def _step(self) -> None:
        """One token for every running request; recompute the newest while KV does not fit."""
        while self._running and sum(s.tokens + 1 for s in self._running) > self.kv_capacity_tokens:
            victim = self._running[-1]
            if victim.recomputes:
                self._finish(victim, "stop", RECOMPUTED)
            else:  # vLLM would preempt it and recompute it here later
                self._running.remove(victim)
                victim.cached_tokens = 0
                self._waiting.insert(0, victim)
        for seq in list(self._running):
            tail = seq.output if len(seq.output) >= 2 else seq.prompt[-2:] + seq.output
            token = _next(tail[-1], tail[-2] if len(tail) > 1 else 7, seq.tokens)
            seq.output.append(token)
            seq.pending.append(token)
            if len(seq.output) >= seq.min_tokens and token in seq.stop_token_ids:
                self._finish(seq, "stop", token)
            elif len(seq.output) >= seq.max_tokens:
                self._finish(seq, "length", None)
            seq.wake.set()

    def _finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._drop_from_batch(seq)
        seq.wake.set()
        seq.finish.set()

    def _drop_from_batch(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)

    def _drop(self, seq: _Sequence) -> None:
        self._drop_from_batch(seq)
        self._by_id.pop(seq.request_id, None)

    # ------------------------------------------------------------------ prefill
    async def _prefill(self, seq: _Sequence, params: dict[str, Any], record: dict[str, Any]) -> AsyncIterator[TokenDelta]:
        self._by_id[seq.request_id] = seq
        try:
            cached = int(params.get("remote_cached_tokens") or 0)
            async with self._compute:
                # An abort (``_finish``) ends the computation, as vLLM's does.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.costs.prefill_s_per_token * max(0, len(seq.prompt) - cached)):
                        await seq.wake.wait()
            if seq.finish_reason == "abort":
                record["finish_reason"] = "abort"
                yield TokenDelta(token_ids=[], finish_reason="abort")
                return
            if params.get("do_remote_decode") and params.get("remote_host"):
                await self._push(seq, params)
            record["output_tokens"], record["finish_reason"] = 1, "length"
            yield TokenDelta(token_ids=[next_token(seq.prompt)], finish_reason="length")
        finally:
            self._by_id.pop(seq.request_id, None)

    async def _push(self, seq: _Sequence, params: dict[str, Any]) -> None:
        transfer_id = str(params.get("request_id") or seq.request_id)
        record: dict[str, Any] = {"role": "prefill", "tokens_pushed": len(seq.prompt), "first_layer_sent_at": time.time()}
        try:
            reader, writer = await asyncio.open_connection(str(params["remote_host"]), int(params["remote_port"]))
            try:
                message = {"transfer": transfer_id, "secret": str(params.get("transfer_secret") or "")}
                writer.write(json.dumps(message).encode() + b"\n")
                await writer.drain()
                answer = await reader.readline()
            finally:
                writer.close()
            record["outcome"] = "done" if answer == b"ok\n" else "failed"
            if record["outcome"] == "failed":
                record["error"] = "the decode engine refused the push"
        except (OSError, ValueError, KeyError) as exc:
            record.update(outcome="failed", error=f"push failed: {exc!r}")
        record["forward_done_at"] = time.time()
        self.records.add({transfer_id: record})
