"""API keys for the router's HTTP routes, as vLLM's server's ``--api-key``.

An operator who serves the OpenAI API beyond the loopback (``router.http.host: 0.0.0.0``, or
Serve's proxy) needs what ``vllm serve --api-key`` gives: clients without a key are refused
before anything else is done for them, body unread. The keys come from ``router.api_keys``, or,
where that is left unset, from ``VLLM_API_KEY`` in the router replicas' environment (as vLLM's
server reads it). The Serve config is shown on the Ray dashboard, so the environment keeps a key
off it.

Every route but ``/health`` (load balancers and probes carry no key) is guarded, ``/tokenize``
and ``/detokenize`` included, which vLLM's server leaves open (it guards ``/v1/*`` alone): they
spend the router's CPU on the client's text. ``/pd/engines`` also admits the operator token. The
handle API is not guarded: a caller that holds a Serve handle is inside the cluster.

Keys are kept as SHA-256 digests and each presented key is compared with every one of them
(``secrets.compare_digest``), so the time a refusal takes says nothing of a key's prefix.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Mapping

from starlette.responses import JSONResponse

from serve_app.router.errors import error_body

ENV_VAR = "VLLM_API_KEY"
UNAUTHORIZED = "Missing or invalid API key: send the header 'Authorization: Bearer <key>'"


class ClientKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key) for key in keys if key]

    @classmethod
    def of(cls, configured: list[str] | None, environ: Mapping[str, str]) -> ClientKeys:
        """``router.api_keys`` where set (an empty list: no keys, whatever the environment says),
        else ``VLLM_API_KEY``."""
        return cls(configured if configured is not None else [environ.get(ENV_VAR, "")])

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def admit(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (no keys: anyone)."""
        if not self._digests:
            return True
        if authorization is None:
            return False
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = _digest(key.strip(" "))
        found = False
        for digest in self._digests:
            found |= secrets.compare_digest(presented, digest)
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def unauthorized() -> JSONResponse:
    """The 401 a client without a valid key gets (RFC 6750's challenge with it)."""
    return JSONResponse(error_body(UNAUTHORIZED, 401), 401, headers={"WWW-Authenticate": "Bearer"})
