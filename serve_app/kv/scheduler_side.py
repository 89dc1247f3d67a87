"""The connector's scheduler side (engine-core process): it decides, the workers move bytes.

Decode (``kv_consumer``): a request with ``do_remote_prefill`` reports its uncached prompt tokens
as loaded asynchronously; once vLLM has allocated their blocks, this side arms the receive (a
``RecvSpec`` with a fresh per-transfer secret, for the worker) and POSTs the KV parameters to the
request's ``metaserver`` URL, keys as vllm-ascend's MooncakeLayerwiseConnector posts them, plus
``transfer_secret``.

Prefill (``kv_producer``): a request with ``do_remote_decode`` and a remote address gets a send
plan; each step's metadata then says which of its blocks the worker pushes during that forward.
"""

from __future__ import annotations

import errno
import http.client
import json
import logging
import secrets
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serve_app.kv.metadata import LayerwiseMetadata, RecvSpec, SendSpec, Settings
from serve_app.kv.wakeup import Doorbell
from serve_app.kv.wire import valid_transfer_id

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pd_serve.kv")

METASERVER_RETRIES = 3
METASERVER_TIMEOUT_S = 10.0
# Reuse a connection only if idle for less than this: well inside the relay's keep-alive (5 s).
METASERVER_MAX_IDLE_S = 2.0
RECENT_TRANSFER_IDS = 8192  # ids remembered after their transfer ended, so none is armed twice


def post_metaserver(url: str, body: dict[str, Any]) -> None:
    """POST the decode engine's KV parameters; retried briefly, then logged (the router's
    kv_ready deadline covers a callback that never arrives)."""
    data = json.dumps(body).encode()
    for attempt in range(1, METASERVER_RETRIES + 1):
        try:
            _KEPT_ALIVE.post(url, data)
            return
        except RelayRefused as exc:  # answered: the attempt is over there, or the URL is not its
            logger.info("the metaserver relay took no KV parameters for %s: %s", body.get("request_id"), exc)
            return
        except Exception as exc:
            if attempt == METASERVER_RETRIES:
                logger.warning("metaserver unreachable for %s: %s", body.get("request_id"), _error_kind(exc))
            else:
                time.sleep(0.05 * attempt)


class RelayRefused(RuntimeError):
    """The relay answered with an error status: asking again gets the same answer."""


class KeptAliveConnections:
    """One kept-alive HTTP connection per poster thread and relay address.

    The callback sits on the critical path of every disaggregated request, and it runs in the
    engine core's process: a fresh connection per request (what ``urllib`` makes) costs a
    handshake, a close and about 0.2 ms more of that process's CPU per POST than a kept-alive
    one. The relay (uvicorn) closes a connection idle for its keep-alive interval; one idle for
    ``max_idle_s`` is not reused here, and a reused one that fails anyway is replaced at once,
    before the caller's retries."""

    def __init__(self, max_idle_s: float = METASERVER_MAX_IDLE_S) -> None:
        self.max_idle_s = max_idle_s
        self._local = threading.local()

    def post(self, url: str, data: bytes) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            # Not the URL itself: its path holds the request's one-time relay token.
            raise ValueError(f"the metaserver URL must be http://host:port/path (scheme {parts.scheme!r})")
        key = (parts.hostname, parts.port or 80)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        cached: dict[tuple[str, int], tuple[http.client.HTTPConnection, float]] | None = getattr(self._local, "conns", None)
        if cached is None:
            cached = self._local.conns = {}
        conn, last_used = cached.pop(key, (None, 0.0))
        if conn is not None and time.monotonic() - last_used > self.max_idle_s:
            conn.close()
            conn = None
        if conn is not None:
            try:
                status = _post_on(conn, path, data)
            except (http.client.HTTPException, OSError):
                conn.close()  # the relay closed it meanwhile: a fresh connection, at once
                conn = None
        if conn is None:
            conn = http.client.HTTPConnection(*key, timeout=METASERVER_TIMEOUT_S)
            try:
                conn.connect()
                # Headers and body go out in two writes: without this the body waits for the
                # relay's delayed acknowledgement of the headers (tens of ms).
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                status = _post_on(conn, path, data)
            except BaseException:
                conn.close()
                raise
        cached[key] = (conn, time.monotonic())
        if status >= 400:
            raise RelayRefused(f"HTTP {status}")


def _error_kind(exc: BaseException) -> str:
    """An error of a POST by class and errno only: the text of http.client's and the OS's errors
    can name the relay's address, and the relay's URL holds a one-time token."""
    code = exc.errno if isinstance(exc, OSError) else None
    return f"{type(exc).__name__}, {errno.errorcode[code]}" if isinstance(code, int) and code in errno.errorcode else type(exc).__name__


def _post_on(conn: http.client.HTTPConnection, path: str, data: bytes) -> int:
    conn.request("POST", path, body=data, headers={"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


_KEPT_ALIVE = KeptAliveConnections()


@dataclass
class SendPlan:
    transfer_id: str
    secret: str
    host: str
    port: int
    remote_block_ids: list[int]
    prompt_len: int
    next_token: int  # the first prompt position not pushed yet
    error: str | None = None


class SchedulerSide:
    def __init__(
        self,
        settings: Settings,
        post: Callable[[str, dict[str, Any]], None] = post_metaserver,
        doorbell: Doorbell | None = None,
    ) -> None:
        self.s = settings
        self._post = post
        self.doorbell = doorbell
        self._new_recv: list[RecvSpec] = []
        self._sending: dict[str, SendPlan] = {}
        # Transfer ids armed now (engine request id -> transfer id) and recently: an id is armed
        # once per engine.
        self._armed: dict[str, str] = {}
        self._armed_ids: set[str] = set()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._poster = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-metaserver")

    # Decode ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.s.is_producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if num_computed_tokens % self.s.block_size:
            # The whole prompt was a prefix-cache hit and vLLM recomputes its last position
            # itself; that position sits in a shared cached block no transfer may write.
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if self.s.is_producer or not params or not params.get("do_remote_prefill"):
            return
        # Arm once: vLLM may call this again after the transfer, for new blocks.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return  # the whole prompt was cached locally: no transfer, no KVReady
        block_ids = list(blocks.get_block_ids()[0])
        cached = request.num_prompt_tokens - num_external_tokens
        transfer_id = str(params.get("request_id") or request.request_id)
        spec = RecvSpec(
            req_id=request.request_id,
            transfer_id=transfer_id,
            secret=secrets.token_urlsafe(24),
            # Leading blocks hold prefix-cached tokens (cached is a whole number of blocks) and
            # may be shared with other requests: only the blocks after them are writable.
            block_ids=block_ids[cached // self.s.block_size :],
            num_tokens=num_external_tokens,
            timeout_s=self.s.recv_timeout_s,
        )
        if not valid_transfer_id(transfer_id):
            # No frame naming it would pass the wire's checks: fail it now, not at the deadline.
            spec.rejected = f"transfer id {transfer_id!r} is not one the KV side channel accepts"
        elif transfer_id in self._armed_ids or transfer_id in self._recent:
            spec.rejected = f"transfer id {transfer_id} is already in use on this engine"
        if spec.rejected is not None:
            logger.warning("request %s: %s", request.request_id, spec.rejected)
            self._new_recv.append(spec)
            return
        self._armed[request.request_id] = transfer_id
        self._armed_ids.add(transfer_id)
        self._new_recv.append(spec)
        url = params.get("metaserver")
        if not url:
            logger.warning("request %s asks for remote prefill but names no metaserver", transfer_id)
            return
        self.submit_post(str(url), self.kv_params(transfer_id, spec.secret, block_ids, cached))

    def kv_params(self, transfer_id: str, secret: str, block_ids: list[int], cached: int) -> dict[str, Any]:
        """The callback body: MooncakeLayerwiseConnector's keys, plus this transfer's secret."""
        return {
            "token_ids": [],
            "request_id": transfer_id,
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": block_ids,
            "remote_block_size": self.s.block_size,
            "remote_engine_id": self.s.engine_id,
            "remote_host": self.s.host,
            "remote_port": self.s.port,
            "remote_tp_size": self.s.tp_size,
            "remote_cached_tokens": cached,
            "transfer_secret": secret,
        }

    def submit_post(self, url: str, body: dict[str, Any]) -> None:
        self._poster.submit(self._post, url, body)

    # Prefill ---------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not self.s.is_producer or not params or not params.get("do_remote_decode") or not params.get("remote_host"):
            return
        self._sending[request.request_id] = self.send_plan(request, params)

    def send_plan(self, request: Request, params: dict[str, Any]) -> SendPlan:
        error = None
        try:
            remote_block_ids = [int(b) for b in params.get("remote_block_ids") or []]
            cached = int(params.get("remote_cached_tokens") or 0)
            port = int(params["remote_port"])
            block_size = int(params.get("remote_block_size") or self.s.block_size)
        except (TypeError, ValueError, KeyError) as exc:
            remote_block_ids, cached, port, block_size = [], 0, 0, self.s.block_size
            error = f"bad kv_transfer_params: {exc!r}"
        if error is None and block_size != self.s.block_size:
            error = f"decode uses blocks of {block_size} tokens, this engine {self.s.block_size}"
        if error is None and cached % self.s.block_size:
            error = f"remote_cached_tokens {cached} is not a whole number of blocks"
        return SendPlan(
            transfer_id=str(params.get("request_id") or request.request_id),
            secret=str(params.get("transfer_secret") or ""),
            host=str(params["remote_host"]),
            port=port,
            remote_block_ids=remote_block_ids,
            prompt_len=request.num_prompt_tokens,
            next_token=cached,
            error=error,
        )

    def build_connector_meta(self, so: SchedulerOutput, kv_cache_manager: Any) -> LayerwiseMetadata:
        meta = LayerwiseMetadata(
            recv=self._new_recv,
            finished=sorted(so.finished_req_ids),
            wake_port=self.doorbell.port if self.doorbell is not None else None,
            wake_token=self.doorbell.token if self.doorbell is not None else None,
        )
        self._new_recv = []
        if self._sending:
            computed_before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
            for req_id, scheduled in so.num_scheduled_tokens.items():
                plan = self._sending.get(req_id)
                if plan is None or plan.next_token >= plan.prompt_len:
                    continue
                end = min(computed_before.get(req_id, 0) + scheduled, plan.prompt_len)
                if end <= plan.next_token:
                    continue
                meta.send.append(self._send_spec(req_id, plan, end, kv_cache_manager))
                plan.next_token = end
        return meta

    def _send_spec(self, req_id: str, plan: SendPlan, end: int, kv_cache_manager: Any) -> SendSpec:
        bs = self.s.block_size
        first, last = plan.next_token // bs, (end - 1) // bs
        local = list(kv_cache_manager.get_block_ids(req_id)[0])
        error = plan.error
        if error is None and (last >= len(plan.remote_block_ids) or last >= len(local)):
            error = f"block list too short: need {last + 1}, remote {len(plan.remote_block_ids)}, local {len(local)}"
        return SendSpec(
            req_id=req_id,
            transfer_id=plan.transfer_id,
            secret=plan.secret,
            host=plan.host,
            port=plan.port,
            local_block_ids=local[first : last + 1],
            remote_block_ids=plan.remote_block_ids[first : last + 1],
            num_tokens=end - plan.next_token,
            last_chunk=end >= plan.prompt_len,
            error=error,
        )

    def on_connector_output(self, output: KVConnectorOutput) -> None:
        """A step reported finished receives: the step that schedules their requests need not
        wait out vLLM's poll interval."""
        if self.doorbell is not None and output.finished_recving:
            self.doorbell.ring_here()

    # Both ------------------------------------------------------------------------------
    def forget(self, req_id: str) -> None:
        """The request finished: its send plan and its armed transfer id are over."""
        self._sending.pop(req_id, None)
        transfer_id = self._armed.pop(req_id, None)
        if transfer_id is not None:
            self._armed_ids.discard(transfer_id)
            self._recent[transfer_id] = None
            while len(self._recent) > RECENT_TRANSFER_IDS:
                self._recent.popitem(last=False)

    def close(self) -> None:
        self._poster.shutdown(wait=False)
        if self.doorbell is not None:
            self.doorbell.close()
