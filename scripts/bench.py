"""Disaggregated vs colocated, measured in the same run on the same machine.

Starts a local Ray cluster with two apps built from configs/serve.yaml's args: ``pd``
(disaggregated, as in the file) and ``colocated`` (the same engines' settings, router.mode
colocated, no prefill engine). Sends the same workload to each (``--requests`` greedy completions,
``--concurrency`` at a time, prompts of ``--prompt-tokens`` tokens, ``--max-tokens`` each) and
prints per-mode TTFT and time-per-output-token percentiles, throughput, and the ratios
disaggregated / colocated. Timings are for comparison within one run, not absolute claims: on a
2-core CPU host both modes share the same two cores.

Usage: ``.venv/bin/python scripts/bench.py [--requests 32] [--concurrency 8] ...``
(after ``make run`` or ``make test`` has set up the venv and the tiny model; stop ``make run``
first, this starts its own cluster on free ports).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from serve_app.runtime.ports import free_port  # noqa: E402  (importable once the repo's root is on the path)


def one_request(url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    with requests.post(url + "/v1/completions", json={**body, "return_token_ids": True}, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if n:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += n
    assert first is not None and last is not None and tokens == max_tokens
    return {"ttft": first - started, "tpot": (last - first) / max(tokens - 1, 1), "end": last}


def run_load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, Any]:
    results: list[dict[str, float]] = []
    queue = list(prompts)
    lock = threading.Lock()
    started = time.perf_counter()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            result = one_request(url, prompt, max_tokens)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(r["end"] for r in results) - started
    ttft = sorted(r["ttft"] for r in results)
    tpot = sorted(r["tpot"] for r in results)
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "tpot_p50": statistics.median(tpot),
        "tokens_per_s": len(results) * max_tokens / elapsed,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from serve_app.app import build_app

    (app,) = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())["applications"]
    disaggregated = {**app["args"], "router": {**app["args"]["router"], "mode": "disaggregated"}}
    colocated = {
        **app["args"],
        "prefill": {**app["args"]["prefill"], "num_replicas": 0},
        "router": {**app["args"]["router"], "mode": "colocated"},
        "kv_port_base": 37000,
    }
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        base = f"http://127.0.0.1:{port}"
        urls = {}
        for name, config in (("disaggregated", disaggregated), ("colocated", colocated)):
            serve.run(build_app(config), name=name, route_prefix=f"/{name}")
            urls[name] = f"{base}/{name}"
        # Distinct prompts (no prefix-cache hits); the first two only warm each app up.
        prompts = [[(k * 131 + i * 17) % 900 + 20 for i in range(args.prompt_tokens)] for k in range(args.requests + 2)]
        report = {}
        for name, url in urls.items():
            run_load(url, prompts[-2:], 4, 2)
            report[name] = run_load(url, prompts[:-2], args.max_tokens, args.concurrency)
        print(
            f"{args.requests} requests, concurrency {args.concurrency}, {args.prompt_tokens} prompt tokens, {args.max_tokens} output tokens"
        )
        print(f"{'metric':<14}{'disaggregated':>15}{'colocated':>12}{'ratio':>9}")
        for metric in ("ttft_p50", "ttft_p90", "tpot_p50", "tokens_per_s"):
            d, c = report["disaggregated"][metric], report["colocated"][metric]
            print(f"{metric:<14}{d:>15.4f}{c:>12.4f}{d / c:>9.2f}")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
