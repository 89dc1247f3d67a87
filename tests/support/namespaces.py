"""Running a test's whole story in namespaces of its own (``unshare``: PID, network, mount):
there ``ray stop --force`` sees only what the test started, ports and addresses are the test's
own, and everything started ends with the namespace. Used by test_process_hygiene.py and
test_two_nodes.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.cluster import REPO_ROOT

UNSHARE = ["unshare", "--pid", "--fork", "--net", "--mount-proc"]

#: Bash that gives the script a ``/run/netns`` of its own (a tmpfs in its private mount namespace),
#: so ``ip netns add`` names nothing on the host: a run killed before its cleanup (SIGKILL, a
#: session's end) leaves no stale ``/run/netns/<name>`` to fail the next run, and two runs at once
#: do not collide.
PRIVATE_NETNS_DIR = "mkdir -p /run/netns && mount -t tmpfs pd-netns /run/netns"


def unavailable(probe: str = "true") -> str | None:
    """Why this machine cannot run a script in such namespaces (None: it can); ``probe`` is run
    inside them as the check."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "unshare or ip (iproute2) is not installed"
    done = subprocess.run([*UNSHARE, "bash", "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"this machine cannot create PID and network namespaces: {done.stderr.strip()}"
    return None


def run_script(script: str, prefix: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``script`` (bash) in fresh namespaces, with ``$REPO`` the checkout and ``$WORK`` a
    scratch folder of its own (short: Ray's socket paths are limited), removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        env = {**os.environ, "REPO": str(REPO_ROOT), "WORK": str(work)}
        env.pop("RAY_ADDRESS", None)
        return subprocess.run([*UNSHARE, "bash", "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
