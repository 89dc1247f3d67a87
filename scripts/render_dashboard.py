"""Render the panels of configs/grafana/pd-serve.json from a real run, through a real Prometheus.

Usage (after ``make setup``; needs the ``prometheus`` binary, e.g. Debian's ``apt-get install
prometheus``, and matplotlib: ``.venv/bin/pip install -e '.[docs]'``)::

    .venv/bin/python scripts/render_dashboard.py [--minutes 4] [--out docs/dashboard.png]

It starts ``serve run`` of configs/serve.yaml (its decode engine's KV cache cut to 16 blocks, so
that the recompute panels have something to show), a Prometheus scraping Ray's metrics endpoints
every 5 s (found through the service-discovery file Ray writes for Prometheus), drives the app
with concurrent streamed and non-streamed completions, some sharing a prefix, then asks
Prometheus's query API for every panel's queries over the run (``$__rate_interval`` read as 30 s)
and draws them in the dashboard's order. Grafana itself is not packaged where this project is
developed; the queries are the dashboard's own, unchanged otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
VENV_BIN = Path(sys.executable).parent
DASHBOARD = REPO_ROOT / "configs" / "grafana" / "pd-serve.json"
RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
BLOCK_BYTES = 128 * 2 * 2 * 2 * 32 * 4  # the tiny model: tokens/block * layers * (K,V) * kv heads * head_dim * fp32
SCRAPE_S = 5
RATE_WINDOW = "30s"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def process(cmd: list[str], log: Path, env: dict[str, str] | None = None):
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or base_env(), cwd=REPO_ROOT, start_new_session=True)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def serve_config(port: int, workdir: Path) -> Path:
    config = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    (app,) = config["applications"]
    args = app["args"]
    args["router"] = {**args["router"], "http": {**args["router"]["http"], "port": port}}
    args["decode"] = {**args["decode"], "engine_kwargs": {"kv_cache_memory_bytes": 17 * BLOCK_BYTES}}
    args["router"]["max_attempts"] = 24
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("serve run exited before the app was healthy")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy within {timeout_s}s")


async def traffic(base_url: str, seconds: float, concurrency: int = 6) -> int:
    import httpx

    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(200)]  # the tiny model's vocabulary is 1024
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(i: int, client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            prompt = shared[: rng.randrange(120, 200)] if rng.random() < 0.3 else [rng.randrange(10, 1000) for _ in range(256)]
            body = {"prompt": prompt, "max_tokens": rng.randrange(64, 220), "temperature": 0, "ignore_eos": True}
            if i % 2:
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    response.raise_for_status()
                    async for _ in response.aiter_lines():
                        pass
            else:
                (await client.post("/v1/completions", json=body)).raise_for_status()
            done += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
    return done


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    response = requests.get(f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": SCRAPE_S}, timeout=30)
    response.raise_for_status()
    return response.json()["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prom: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    plt.style.use("dark_background")
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 2.9 * rows))
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel["title"], fontsize=10, loc="left")
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(prom, target["expr"], start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, linewidth=1.2, label=legend(target.get("legendFormat", ""), series["metric"]))
                    drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds into the run", fontsize=7)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if unit and unit != "short":
            ax.set_ylabel(unit, fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{dashboard['title']}: configs/grafana/pd-serve.json, fed by Prometheus scraping a real run", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pd-dashboard-") as tmp:
        workdir = Path(tmp)
        http_port, prom_port = free_port(), free_port()
        prom_config = workdir / "prometheus.yml"
        prom_config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                    "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [RAY_SD_FILE], "refresh_interval": "5s"}]}],
                }
            )
        )
        prom_cmd = [
            "prometheus",
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        prom = f"http://127.0.0.1:{prom_port}"
        serve_cmd = [str(VENV_BIN / "serve"), "run", str(serve_config(http_port, workdir))]
        with process(serve_cmd, workdir / "serve.log") as serve_proc:
            wait_healthy(f"http://127.0.0.1:{http_port}/health", serve_proc)
            with process(prom_cmd, workdir / "prometheus.log"):
                time.sleep(3 * SCRAPE_S)  # Prometheus finds Ray's endpoints and takes a first sample
                start = time.time()
                done = asyncio.run(traffic(f"http://127.0.0.1:{http_port}", args.minutes * 60))
                time.sleep(3 * SCRAPE_S)
                end = time.time()
                print(f"{done} requests in {end - start:.0f}s; rendering", file=sys.stderr)
                render(prom, start, end, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
