"""No secret and no internal address reaches a client or a log line (issue 31, point 5).

The engine call's token travels in a header of every router-engine call; aiohttp's errors carry
the request's headers in their repr and the endpoint's URL in their text. A transport error that
ends a response (every attempt failed) used to reach the client whole, and every attempt's
failure was logged with it."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from unittest import mock

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tests.log_capture import RecordList
from tests.unit.inprocess import MOCK_ARGS, App

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def http_args() -> dict[str, Any]:
    args = json.loads(json.dumps(MOCK_ARGS))
    args["router"] = {**args["router"], "engine_transport": "http", "max_attempts": 2}
    return args


def leaky_error(url: str, token: str) -> aiohttp.ClientResponseError:
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {token}"}))
    info = aiohttp.RequestInfo(URL(url), "POST", headers, URL(url))
    return aiohttp.ClientResponseError(info, (), status=502, message=f"bad gateway at {url}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_transport_error_leaks_neither_the_token_nor_the_url(engines_without_ray, tiny_tokenizer, stream):
    logs = RecordList()
    router_log = logging.getLogger("pd_serve")
    router_log.addHandler(logs)

    async def main() -> None:
        app = await App.start(http_args(), tiny_tokenizer)
        try:
            endpoints = [e.call_server.endpoint for e in app.engines.values() if e.call_server is not None]
            assert endpoints and all(e.token for e in endpoints)
            token, url = endpoints[0].token, endpoints[0].url
            assert token in repr(leaky_error(url, token))  # what the old code put in its reason

            def failing_post(target: str, **kwargs: Any) -> Any:
                raise leaky_error(target, kwargs["headers"]["Authorization"].split()[-1])

            session = app.service.pool.client._http()
            with mock.patch.object(session, "post", failing_post):
                body = json.dumps({"prompt": [11, 12, 13], "max_tokens": 4, "stream": stream}).encode()
                response = await app.service.http("completions", body)
                if hasattr(response, "body_iterator"):
                    seen = "".join([chunk async for chunk in response.body_iterator])
                else:
                    seen = response.body.decode()
            assert "error" in seen and '"code":502' in seen.replace(" ", "")
            lines = [r.getMessage() + str(getattr(r, "exc_text", "") or "") for r in logs.records]
            failures = "\n".join(line for line in lines if "attempt" in line or "gave up" in line)
            assert "failed" in failures  # the failures were logged...
            for secret in [e.token for e in endpoints]:
                assert secret not in seen and secret not in "\n".join(lines)  # ... no token anywhere ...
            for address in [e.url for e in endpoints] + ["127.0.0.1:"]:
                # ... and no address in what the client saw or in the failures' lines (an engine's
                # start-up line names its endpoint for the operator, on purpose).
                assert address not in seen and address not in failures, address
            await app.idle()
        finally:
            await app.stop()

    try:
        asyncio.run(main())
    finally:
        router_log.removeHandler(logs)
