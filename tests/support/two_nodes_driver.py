"""The two-node story, driven from inside the namespaces tests/integration/test_two_nodes.py
creates (node 1: 198.18.0.1, the Ray head; node 2: 198.18.0.2, a Ray worker in a network
namespace of its own). Prints ``[two-nodes] ...`` lines and exits non-zero on the first failure.

Placement by Ray custom resources, as a user would set it: node 1 offers ``pd_node1`` and node 2
none of it; each node offers one ``pd_decode``. So prefill-0 and the router sit on node 1, and
the two decode engines one per node: the one on node 2 receives its KV across the veth pair,
the one on node 1 survives node 2's loss.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import psutil
import requests

sys.path.insert(0, os.getcwd())

NODE2 = "198.18.0.2"
MODEL = "tiny-llama"


def say(message: str) -> None:
    print(f"[two-nodes] {message}", flush=True)


def fail(message: str) -> None:
    say(f"FAILED: {message}")
    sys.exit(1)


# The routers' ports, fixed: this runs in network namespaces of its own, and ports below the
# kernel's ephemeral range are never handed out by bind(0) or connect() (vLLM, Ray and Serve bind
# theirs that way while the apps start; a port picked with bind(0) beforehand can be taken).
SERVE_PORT, PD_PORT = 28000, 28001
# /pd/engines shows engines' addresses (kv_endpoint, call_endpoint) and records to the operator only.
OPERATOR_TOKEN = "two-nodes-operator-token"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


# Where the test leaves the colocated reference (its session's baseline app, outside the
# namespaces): {"prompts": [output token ids of PROMPTS], "load": [... of LOAD]}.
REFERENCE_ENV = "PD_TWO_NODES_REFERENCE"


def token_pattern(length: int, seed: int) -> list[int]:
    return [10 + (seed * 131 + i * 17 + (i * i) % 13) % 1000 for i in range(length)]


# Greedy completions: (prompt, max_tokens). Prompts of every size class the router treats apart,
# then long streams to be mid-stream when node 2 goes.
PROMPTS = [(token_pattern(n, seed), 24) for seed, n in enumerate((40, 128, 129, 300, 700, 1000))]
LOAD = [(token_pattern(200 + 50 * i, 40 + i), 1200) for i in range(6)]


def app_args(port: int) -> dict[str, Any]:
    timeouts = {"kv_ready_s": 20, "prefill_s": 30, "first_token_s": 60, "request_s": 180}
    router = {
        "num_cpus": 0.05,
        "resources": {"pd_node1": 0.01},
        "timeouts": timeouts,
        "http": {"host": "127.0.0.1", "port": port},
        "operator_token": OPERATOR_TOKEN,
    }
    return {
        "served_model_name": MODEL,
        "kv_port_base": 36000,
        "prefill": {"num_replicas": 1, "num_cpus": 0.1, "resources": {"pd_node1": 0.01}},
        "decode": {"num_replicas": 2, "num_cpus": 0.1, "resources": {"pd_decode": 1}},
        # By load, tied engines take turns: the six prompts below alternate between the
        # nodes (by prefix, each prompt's engine is its hash's).
        "router": {**router, "mode": "disaggregated", "max_attempts": 6, "balancer": "load"},
    }


def wait_healthy(base: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(base + "/health", timeout=5).status_code == 200:
                engines = requests.get(base + "/pd/engines", headers=OPERATOR, timeout=10).json()["engines"]
                if all(e["healthy"] for e in engines.values()):
                    return
        except requests.RequestException:
            pass
        time.sleep(2)
    fail(f"{base} not healthy within {timeout_s}s")


def complete(base: str, prompt: list[int], max_tokens: int) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = requests.post(base + "/v1/completions", json=body, timeout=300)
    return response.status_code, response.json()


def tokens(base: str, prompt: list[int], max_tokens: int) -> tuple[str, list[int]]:
    status, data = complete(base, prompt, max_tokens)
    if status != 200:
        fail(f"{base}: {status} {data}")
    return data["id"], data["choices"][0]["token_ids"]


def node2_raylet() -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "raylet" in cmdline.split(" ")[0] and f"--node_ip_address={NODE2}" in cmdline:
            return proc
    fail("node 2's raylet not found")
    raise AssertionError


def main() -> None:
    import ray
    from ray import serve

    from serve_app.app import build_app

    ray.init(address=os.environ["RAY_ADDRESS"], namespace="serve", log_to_driver=False)
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    if sorted(nodes) != ["198.18.0.1", NODE2]:
        fail(f"expected two nodes, Ray has {nodes}")
    serve.start(proxy_location="Disabled", http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    serve.run(build_app(app_args(PD_PORT)), name="pd", route_prefix="/pd", blocking=False)
    pd = f"http://127.0.0.1:{PD_PORT}"
    with open(os.environ[REFERENCE_ENV]) as f:
        reference = json.load(f)
    wait_healthy(pd)
    engines = requests.get(pd + "/pd/engines", headers=OPERATOR, timeout=10).json()["engines"]
    hosts = {name: e["kv_endpoint"]["host"] for name, e in engines.items() if name.startswith("decode")}
    remote = [name for name, host in hosts.items() if host == NODE2]
    local = [name for name, host in hosts.items() if host != NODE2]
    if len(remote) != 1 or len(local) != 1:
        fail(f"decode engines' KV endpoints: {hosts} (one per node expected)")
    # The router's calls reach each engine at its own node's address (router.engine_transport: http).
    calls = {name: e["call_endpoint"] for name, e in engines.items()}
    for name, host in hosts.items():
        if not (calls[name] or "").startswith(f"http://{host}:"):
            fail(f"{name}: call endpoint {calls[name]!r} is not on its node {host}")
    say(f"two nodes up; decode side channels {hosts}; call endpoints {calls}")

    # 1. Greedy output token-exact against colocated, KV pushed across the nodes.
    crossed = 0
    prefill = serve.get_deployment_handle("prefill", "pd")  # one replica: every call reaches it
    for (prompt, max_tokens), want in zip(PROMPTS, reference["prompts"], strict=True):
        response_id, got = tokens(pd, prompt, max_tokens)
        if got != want:
            fail(f"prompt of {len(prompt)} tokens: disaggregated {got} != colocated {want}")
        attempt = response_id + "-1"
        record = prefill.inspect.remote([attempt]).result()["transfers"].get(attempt) or {}
        if record.get("outcome") != "done":
            fail(f"prompt of {len(prompt)} tokens: prefill's transfer record {record}")
        crossed += record["pushed_to"].startswith(NODE2 + ":")
    if crossed == 0:
        fail("no KV transfer went to node 2")
    say(f"{len(PROMPTS)} prompts token-exact; {crossed} KV transfers crossed to node 2")

    # 2. Node 2 lost under load.
    expected = reference["load"]
    results: list[Any] = [None] * len(LOAD)

    def run(i: int) -> None:
        try:
            results[i] = complete(pd, *LOAD[i])
        except Exception as exc:  # a hang would be a requests timeout: reported as such
            results[i] = (None, repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(LOAD))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    busy = 0
    while busy == 0 and time.monotonic() < deadline:  # wait until node 2's engine is streaming
        time.sleep(0.5)
        engine = requests.get(pd + "/pd/engines", headers=OPERATOR, timeout=10).json()["engines"][remote[0]]
        busy = engine["router_inflight"] if (engine["engine_running"] or 0) > 0 else 0
    if busy == 0:
        fail(f"no request reached {remote[0]} on node 2")
    raylet = node2_raylet()
    say(f"killing node 2's raylet (pid {raylet.pid}) with {busy} request(s) on {remote[0]}")
    raylet.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=400)
    if any(t.is_alive() for t in threads):
        fail("a request never ended after node 2 was lost")
    completed = errors = 0
    for i, (status, data) in enumerate(results):
        if status == 200:
            if data["choices"][0]["token_ids"] != expected[i]:
                fail(f"request {i} completed with other tokens than colocated")
            completed += 1
        elif status is not None and isinstance(data, dict) and data.get("error", {}).get("message"):
            errors += 1
            say(f"request {i}: {status} {data['error']['message']}")
        else:
            fail(f"request {i} ended without an answer or a clear error: {status} {data}")
    say(f"after node 2's loss: {completed} completed token-exact, {errors} clear errors")
    if completed == 0:
        fail("no request survived on node 1's engines")

    # 3. Nothing held: the router's counters are back to zero.
    deadline = time.monotonic() + 60
    while True:
        snap = requests.get(pd + "/pd/engines", headers=OPERATOR, timeout=10).json()
        held = {n: e["router_inflight"] for n, e in snap["engines"].items() if e["router_inflight"]}
        if snap["router"]["inflight"] == 0 and not held:
            break
        if time.monotonic() > deadline:
            fail(f"router counters not back to zero: {json.dumps(snap)[:2000]}")
        time.sleep(1)
    say("OK")


if __name__ == "__main__":
    main()
