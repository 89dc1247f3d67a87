"""pd-serve across two Ray nodes on one machine: prefill and the router on node 1, a decode
engine on each node, KV pushed across a veth pair, and node 2 lost under load.

The test makes the two nodes itself, in namespaces of its own (``unshare``: PID, network and
mount; nothing outside them is touched, not even the host's /run/netns): node 1 is the test's
network namespace (198.18.0.1, the Ray head), node 2 a named network namespace inside it
(198.18.0.2, a Ray worker node), joined by a veth pair in the benchmarking range 198.18.0.0/15.
tests/support/two_nodes_driver.py then deploys the app and checks: greedy output token-exact
against colocated (the session's baseline app, asked here beforehand); KV transfers that really
went to node 2 (prefill's transfer records name node 2's side channel); after node 2's raylet is
killed under load every in-flight request ends, completed token-exact on node 1's engines or
with a clear error; the router's counters return to zero. Everything started ends with the PID
namespace.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import namespaces
from tests.support import two_nodes_driver as driver
from tests.support.cluster import completion_ids

pytestmark = pytest.mark.engine

SCRIPT = r"""
set -u
cd "$REPO"
say() { echo "[two-nodes] $*"; }
ip link set lo up
{ PRIVATE_NETNS_DIR; } || { say "cannot mount a private /run/netns"; exit 3; }
ip netns add pdnode2 || { say "cannot create a network namespace"; exit 3; }
trap 'ip netns delete pdnode2 2>/dev/null' EXIT
ip link add pdv1 type veth peer name pdv2
ip link set pdv2 netns pdnode2
ip addr add 198.18.0.1/30 dev pdv1
ip link set pdv1 up
ip netns exec pdnode2 ip link set lo up
ip netns exec pdnode2 ip addr add 198.18.0.2/30 dev pdv2
ip netns exec pdnode2 ip link set pdv2 up

export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1
RAY_TMPDIR="$WORK/n1" .venv/bin/ray start --head --node-ip-address 198.18.0.1 --port 6379 --num-cpus 2 \
  --resources '{"pd_node1": 10, "pd_decode": 1}' --include-dashboard false >"$WORK/node1.log" 2>&1 \
  || { cat "$WORK/node1.log"; say "node 1 did not start"; exit 1; }
ip netns exec pdnode2 env RAY_TMPDIR="$WORK/n2" .venv/bin/ray start --address 198.18.0.1:6379 \
  --node-ip-address 198.18.0.2 --num-cpus 2 --resources '{"pd_decode": 1}' >"$WORK/node2.log" 2>&1 \
  || { cat "$WORK/node2.log"; say "node 2 did not join"; exit 1; }
say "Ray head on 198.18.0.1, worker on 198.18.0.2"
RAY_TMPDIR="$WORK/n1" RAY_ADDRESS=198.18.0.1:6379 .venv/bin/python tests/support/two_nodes_driver.py
rc=$?
if [ $rc -ne 0 ]; then
  for f in "$WORK"/n1/session_latest/logs/serve/*.log; do echo "== $f"; tail -n 30 "$f"; done
fi
exit $rc
""".replace("PRIVATE_NETNS_DIR", namespaces.PRIVATE_NETNS_DIR)


def test_two_nodes_token_exact_kv_across_nodes_and_a_node_lost_under_load(baseline_app, tmp_path, monkeypatch):
    reason = namespaces.unavailable(f"{namespaces.PRIVATE_NETNS_DIR} && ip netns add pdprobe && ip netns delete pdprobe")
    if reason:
        pytest.skip(reason)
    # The colocated reference, from the session's baseline app (the namespaces' cluster then
    # starts no engine of its own for it).
    with ThreadPoolExecutor(6) as pool:
        reference = {
            part: list(pool.map(lambda case: completion_ids(baseline_app, case[0], case[1])[1], cases))
            for part, cases in (("prompts", driver.PROMPTS), ("load", driver.LOAD))
        }
    path = tmp_path / "reference.json"
    path.write_text(json.dumps(reference))
    monkeypatch.setenv(driver.REFERENCE_ENV, str(path))
    result = namespaces.run_script(SCRIPT, prefix="pd2n-", timeout_s=900)
    out = result.stdout[-8000:] + result.stderr[-3000:]
    assert result.returncode == 0, out
    assert "[two-nodes] OK" in result.stdout, out
