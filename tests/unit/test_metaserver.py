"""The decode replica's metaserver relay, over real loopback HTTP (plain asyncio.run, no plugin)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_app.engines.metaserver import PATH, MetaserverRelay, with_relay

TIMEOUT_S = 5.0


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:  # Starlette's own 404/405 for paths the relay does not route
            return exc.code, {"error": raw.decode(errors="replace")}


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
        _, url = relay.expect("att-1")
        assert url.startswith(relay.url + "/") and len(url) > len(relay.url) + 20  # a secret token

    run(body)


def test_expected_request_resolves_with_the_body():
    async def body(relay: MetaserverRelay):
        future, url = relay.expect("att-1")
        assert relay.pending == 1 and not future.done()
        status, reply = await asyncio.to_thread(post_json, url, KV_PARAMS)
        assert (status, reply) == (200, {"status": "ok"})
        assert future.done()
        assert await future == KV_PARAMS
        # A second callback for the same attempt finds nobody waiting any more.
        status, reply = await asyncio.to_thread(post_json, url, KV_PARAMS)
        assert status == 404

    run(body)


def test_each_request_has_its_own_url_and_no_other_is_answered():
    async def body(relay: MetaserverRelay):
        mine, url = relay.expect("att-1")
        other, other_url = relay.expect("att-2")
        assert url != other_url
        # The relay's base URL, a guessed token, or another request's URL: nothing is resolved.
        for wrong in (relay.url, relay.url + "/guess", relay.url + "/" + "x" * 32):
            status, _ = await asyncio.to_thread(post_json, wrong, KV_PARAMS)
            assert status in (404, 405)
        status, reply = await asyncio.to_thread(post_json, other_url, KV_PARAMS)  # att-1's body at att-2's URL
        assert status == 403
        assert not mine.done() and not other.done()
        with pytest.raises(ValueError):
            relay.expect("att-1")  # one wait per request

    run(body)


@pytest.mark.parametrize("data", [json.dumps({"remote_block_ids": [1]}).encode(), b"not json", b"[1, 2]"])
def test_body_without_request_id_is_400(data):
    async def body(relay: MetaserverRelay):
        future, url = relay.expect("att-1")
        status, reply = await asyncio.to_thread(post, url, data)
        assert status == 400 and "request_id" in reply["error"]
        assert not future.done()

    run(body)


def test_forget_cancels_the_future_and_later_callbacks_are_404():
    async def body(relay: MetaserverRelay):
        future, url = relay.expect("att-1")
        relay.forget("att-1")
        assert future.cancelled() and relay.pending == 0
        relay.forget("att-1")  # twice, or an unknown id: a no-op
        relay.forget("never")
        status, _ = await asyncio.to_thread(post_json, url, KV_PARAMS)
        assert status == 404

    run(body)


def test_a_callback_whose_attempt_ends_while_its_body_arrives_is_a_404():
    """The connector writes the header and the body apart: the attempt can end (``forget``)
    between them. That was an InvalidStateError, a 500 and a logged traceback."""
    import socket

    async def body(relay: MetaserverRelay):
        _, url = relay.expect("att-1")
        host_port, path = url.removeprefix("http://").split("/", 1)
        host, port = host_port.split(":")
        data = json.dumps(KV_PARAMS).encode()

        def send_in_two(sock: socket.socket) -> None:
            head = b"POST /%s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path.encode()
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(data))

        sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
        try:
            await asyncio.to_thread(send_in_two, sock)
            await asyncio.sleep(0.2)  # the relay is reading the body
            relay.forget("att-1")
            await asyncio.to_thread(sock.sendall, data)
            answer = await asyncio.to_thread(sock.recv, 4096)
        finally:
            sock.close()
        assert answer.startswith(b"HTTP/1.1 404"), answer[:80]

    run(body)


def test_forget_after_resolution_keeps_the_result():
    async def body(relay: MetaserverRelay):
        future, url = relay.expect("att-1")
        status, _ = await asyncio.to_thread(post_json, url, KV_PARAMS)
        assert status == 200
        relay.forget("att-1")
        assert not future.cancelled() and future.result() == KV_PARAMS
        assert relay.pending == 0

    run(body)


def test_connector_callback_reaches_the_relay():
    """The decode connector's own POST helper, against the real relay."""
    from serve_app.kv.scheduler_side import post_metaserver

    async def body(relay: MetaserverRelay):
        future, url = relay.expect("att-1")
        await asyncio.to_thread(post_metaserver, url, {**KV_PARAMS, "token_ids": []})
        assert (await asyncio.wait_for(future, TIMEOUT_S))["remote_block_ids"] == [3, 5]

    run(body)


def test_a_callback_the_relay_refuses_is_not_posted_again():
    """A 404 means the attempt is over (aborted, timed out): posting it twice more only cost the
    engine core's poster thread, and ended in a warning that the relay was unreachable."""
    from serve_app.kv.scheduler_side import post_metaserver

    async def body(relay: MetaserverRelay):
        state = relay._server._server.server_state
        _, url = relay.expect("att-1")
        relay.forget("att-1")
        await asyncio.to_thread(post_metaserver, url, {**KV_PARAMS, "token_ids": []})
        assert state.total_requests == 1

    run(body)


def test_connector_callbacks_share_one_kept_alive_connection():
    """The engine core posts each request's callback; on one poster thread they reuse one
    connection instead of opening (and closing) one each."""
    from serve_app.kv.scheduler_side import KeptAliveConnections

    poster = KeptAliveConnections()
    thread = ThreadPoolExecutor(max_workers=1)  # asyncio.to_thread could pick another thread each time

    async def body(relay: MetaserverRelay):
        state = relay._server._server.server_state
        for i in range(3):
            future, url = relay.expect(f"att-{i}")
            data = json.dumps({**KV_PARAMS, "request_id": f"att-{i}"}).encode()
            await asyncio.get_running_loop().run_in_executor(thread, poster.post, url, data)
            assert (await asyncio.wait_for(future, TIMEOUT_S))["request_id"] == f"att-{i}"
        assert state.total_requests == 3
        assert len(state.connections) == 1  # still open, kept alive

    try:
        run(body)
    finally:
        thread.shutdown()


def test_a_connection_the_server_closed_is_replaced_at_once():
    """The relay closes idle connections (uvicorn's keep-alive): the next callback on that
    connection fails to be read, and goes out again on a fresh one within the same call."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from serve_app.kv.scheduler_side import KeptAliveConnections
    from serve_app.runtime.http_server import InReplicaServer, listening_socket

    received: list[dict] = []

    async def receive(request):
        received.append(await request.json())
        return JSONResponse({"status": "ok"})

    async def main():
        server = InReplicaServer(
            Starlette(routes=[Route("/cb", receive, methods=["POST"])]), listening_socket("127.0.0.1", 0), keep_alive_s=0.1
        )
        url = f"http://127.0.0.1:{server.address[1]}/cb"
        poster = KeptAliveConnections(max_idle_s=60.0)  # would reuse it: the server closes it first
        thread = ThreadPoolExecutor(max_workers=1)  # one poster thread, so one connection

        async def post(target: str, data: bytes) -> None:
            await asyncio.get_running_loop().run_in_executor(thread, poster.post, target, data)

        try:
            await post(url, b'{"n": 1}')
            for _ in range(100):  # the server closes it after 0.1 s idle
                if not server._server.server_state.connections:
                    break
                await asyncio.sleep(0.05)
            assert not server._server.server_state.connections
            await post(url, b'{"n": 2}')
            with pytest.raises(RuntimeError, match="HTTP 404"):
                await post(url + "/elsewhere", b"{}")
        finally:
            thread.shutdown()
            await server.stop()
        assert received == [{"n": 1}, {"n": 2}]

    asyncio.run(main())


def test_stop_ends_the_server():
    async def main():
        relay = MetaserverRelay()
        await relay.start()
        status, _ = await asyncio.to_thread(post_json, relay.url + "/t", KV_PARAMS)
        assert status == 404  # it serves
        await relay.stop()
        assert relay._server is not None and relay._server._task.done()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(post_json, relay.url + "/t", KV_PARAMS)

    asyncio.run(main())


def test_stop_before_start_is_a_no_op():
    """Stopping a relay that never started leaves it as it was: no server, and it starts and
    serves afterwards."""

    async def main():
        relay = MetaserverRelay()
        await relay.stop()
        assert relay._server is None and relay.url == "" and relay.pending == 0
        await relay.start()
        try:
            future, url = relay.expect("att-1")
            status, _ = await asyncio.to_thread(post_json, url, KV_PARAMS)
            assert status == 200 and await future == KV_PARAMS
        finally:
            await relay.stop()

    asyncio.run(main())


def test_with_relay_adds_metaserver():
    params = {"do_remote_prefill": True, "do_remote_decode": False, "request_id": "att-1"}
    out = with_relay(params, "http://127.0.0.1:1/v1/metaserver")
    assert out == {**params, "metaserver": "http://127.0.0.1:1/v1/metaserver"}
    assert "metaserver" not in params
