"""An unclean stop leaves no engine behind, and the next start on the default ports is healthy.

`ray stop --force` kills every Ray process on a machine, so the test runs the whole story in its
own PID and network namespaces (`unshare`): there `ray stop --force` sees only the app the test
started, and `serve run configs/serve.yaml` uses the file's default ports (HTTP 8000, KV 36000+)
without touching anything outside. The namespaces and everything in them end with the test.
"""

from __future__ import annotations

import pytest

from tests.support import namespaces

pytestmark = pytest.mark.engine

SCRIPT = r"""
set -u
ip link set lo up
cd "$REPO"
export RAY_TMPDIR="$WORK" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1

say() { echo "[hygiene] $* (${SECONDS} s)"; }
engines() { ps -eo stat=,args= | awk '$1 !~ /^Z/ && $2 ~ /^VLLM::/' ; }
healthy() {
  for _ in $(seq 1 180); do
    if curl -sf -m 2 localhost:8000/health >/dev/null; then return 0; fi
    sleep 1
  done
  return 1
}
fail() { say "FAILED: $*"; ps -eo pid,ppid,stat,args; for f in "$WORK"/run*.log; do echo "== $f"; tail -n 40 "$f"; done; exit 1; }

.venv/bin/serve run configs/serve.yaml >"$WORK/run1.log" 2>&1 &
first=$!
healthy || fail "the first start never became healthy"
curl -sf -m 60 localhost:8000/v1/completions -H 'content-type: application/json' \
  -d '{"prompt": "The river", "max_tokens": 8}' >/dev/null || fail "the first start did not answer"
[ -n "$(engines)" ] || fail "no VLLM engine process found while the app runs"
say "app healthy with $(engines | wc -l) engine processes; ray stop --force"

# With --force, the grace period only bounds ray stop's wait for what it killed, which stays a
# zombie until its parent (`serve run`, killed next) goes: 16 s of waiting by default.
.venv/bin/ray stop --force --grace-period 1 >"$WORK/stop.log" 2>&1
kill -9 "$first" 2>/dev/null
for i in $(seq 1 30); do
  [ -z "$(engines)" ] && break
  sleep 1
done
[ -z "$(engines)" ] || fail "VLLM processes still alive 30 s after ray stop --force"
say "no engine process left after ${i} s"

.venv/bin/serve run configs/serve.yaml >"$WORK/run2.log" 2>&1 &
second=$!
healthy || fail "the second start on the default ports never became healthy"
curl -sf -m 60 localhost:8000/v1/completions -H 'content-type: application/json' \
  -d '{"prompt": "The river", "max_tokens": 8}' >/dev/null || fail "the second start did not answer"
say "second start healthy; stopping it"
kill -TERM "$second"
wait "$second"
say "OK"
"""


def test_ray_stop_force_leaves_no_engine_and_the_next_start_is_healthy():
    reason = namespaces.unavailable()
    if reason:
        pytest.skip(reason)
    result = namespaces.run_script(SCRIPT, prefix="pdh-", timeout_s=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "[hygiene] OK" in result.stdout

