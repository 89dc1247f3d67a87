"""The decode replica's metaserver relay, over real loopback HTTP (plain asyncio.run, no plugin)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from serve_app.engines.metaserver import PATH, MetaserverRelay, with_relay

TIMEOUT_S = 5.0


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post_json(url: str, body: dict) -> tuple[int, dict]:
    return post(url, json.dumps(body).encode())


def run(coro_fn):
    """Run an async test body with a started relay, always stopping it."""

    async def main():
        relay = MetaserverRelay()
        await relay.start()
        try:
            await asyncio.wait_for(coro_fn(relay), TIMEOUT_S * 2)
        finally:
            await relay.stop()

    asyncio.run(main())


KV_PARAMS = {
    "request_id": "att-1",
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [3, 5],
    "remote_block_size": 16,
    "remote_engine_id": "engine-d",
    "remote_host": "127.0.0.1",
    "remote_port": 4567,
    "remote_tp_size": 1,
    "remote_cached_tokens": 0,
}


def test_url_is_loopback_and_path():
    async def body(relay: MetaserverRelay):
        assert relay.url.startswith("http://127.0.0.1:")
        assert relay.url.endswith(PATH)
        assert relay.pending == 0

    run(body)


def test_expected_request_resolves_with_the_body():
    async def body(relay: MetaserverRelay):
        future = relay.expect("att-1")
        assert relay.pending == 1 and not future.done()
        status, reply = await asyncio.to_thread(post_json, relay.url, KV_PARAMS)
        assert (status, reply) == (200, {"status": "ok"})
        assert future.done()
        assert await future == KV_PARAMS
        # A second callback for the same attempt finds nobody waiting any more.
        status, reply = await asyncio.to_thread(post_json, relay.url, KV_PARAMS)
        assert status == 404 and "att-1" in reply["error"]

    run(body)


def test_unknown_request_is_404():
    async def body(relay: MetaserverRelay):
        other = relay.expect("att-2")
        status, reply = await asyncio.to_thread(post_json, relay.url, {**KV_PARAMS, "request_id": "att-404"})
        assert status == 404 and "att-404" in reply["error"]
        assert not other.done()

    run(body)


@pytest.mark.parametrize("data", [json.dumps({"remote_block_ids": [1]}).encode(), b"not json", b"[1, 2]"])
def test_body_without_request_id_is_400(data):
    async def body(relay: MetaserverRelay):
        future = relay.expect("att-1")
        status, reply = await asyncio.to_thread(post, relay.url, data)
        assert status == 400 and "request_id" in reply["error"]
        assert not future.done()

    run(body)


def test_forget_cancels_the_future_and_later_callbacks_are_404():
    async def body(relay: MetaserverRelay):
        future = relay.expect("att-1")
        relay.forget("att-1")
        assert future.cancelled() and relay.pending == 0
        relay.forget("att-1")  # twice, or an unknown id: a no-op
        relay.forget("never")
        status, _ = await asyncio.to_thread(post_json, relay.url, KV_PARAMS)
        assert status == 404

    run(body)


def test_forget_after_resolution_keeps_the_result():
    async def body(relay: MetaserverRelay):
        future = relay.expect("att-1")
        status, _ = await asyncio.to_thread(post_json, relay.url, KV_PARAMS)
        assert status == 200
        relay.forget("att-1")
        assert not future.cancelled() and future.result() == KV_PARAMS
        assert relay.pending == 0

    run(body)


def test_connector_callback_reaches_the_relay():
    """The decode connector's own POST helper, against the real relay."""
    from serve_app.kv.layerwise_connector import _post_metaserver

    async def body(relay: MetaserverRelay):
        future = relay.expect("att-1")
        await asyncio.to_thread(_post_metaserver, relay.url, {**KV_PARAMS, "token_ids": []})
        assert (await asyncio.wait_for(future, TIMEOUT_S))["remote_block_ids"] == [3, 5]

    run(body)


def test_stop_ends_the_server():
    async def main():
        relay = MetaserverRelay()
        await relay.start()
        status, _ = await asyncio.to_thread(post_json, relay.url, KV_PARAMS)
        assert status == 404  # it serves
        await relay.stop()
        assert relay._task is not None and relay._task.done()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(post_json, relay.url, KV_PARAMS)

    asyncio.run(main())


def test_stop_before_start_is_a_no_op():
    asyncio.run(MetaserverRelay().stop())


def test_with_relay_adds_metaserver():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "att-1"}
    out = with_relay(params, "http://127.0.0.1:1/v1/metaserver")
    assert out == {**params, "metaserver": "http://127.0.0.1:1/v1/metaserver"}
    assert "metaserver" not in params
