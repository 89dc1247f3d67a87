"""Cache-aware routing, measured: router.balancer prefix vs load vs random, in one run.

Usage: ``.venv/bin/python scripts/bench_prefix.py [--policies prefix,load,random] [--quick]
[--routing-cost-only] [--out prefix.json]`` (after ``make run`` or ``make test`` set up the venv and
the tiny model; stop ``make run`` first: every app here is started and stopped by this script).

Each policy runs the app of configs/serve.yaml with 2 prefill and 2 decode engines (disaggregated),
started as a user would (``serve run``), and then a ``single`` app with 1 prefill and 1 decode
engine: one engine of each role sees every request, the cache hit rate no routing can beat. Two
workloads, each on a fresh app (empty caches):

* ``prefix_repetition``: vLLM's own benchmark client and dataset (``vllm.benchmarks.serve``,
  ``--dataset-name prefix_repetition``): prompts that share one of a few long prefixes;
* ``multi-turn``: a chat replay: conversations whose every turn sends the whole history so far
  (shared system prompts, earlier turns, the engine's own answers) plus a new user turn, several
  conversations at once.

Per policy and workload it prints: the prefix-cache hit rate of the prefill and of the decode
engines (prompt tokens their cache held, from vLLM's per-request ``num_cached_tokens``, as the
engines count them: ``/pd/engines``), as a share of the single-engine ideal; prompt tokens the
prefill engines computed; KV bytes pushed; TTFT p50/p90; output tokens/s; and the imbalance
between engines of a role (the most prompt tokens one was given over the mean). Then the
router's own cost per request of choosing by prefix with 100 engines and 10k prefixes in its
index (no engines: the pure choice, as the router runs it). docs/performance.md, "Cache-aware
routing", has the method and the latest result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from bench_serving import (  # noqa: E402
    HANDED_OFF_MIN,
    REPO_ROOT,
    VENV_BIN,
    base_env,
    handed_off_share,
    host_speed,
    pd_engines,
    short_outputs,
    sse_events,
    started,
    vllm_client,
)

from serve_app.runtime.ports import free_port  # noqa: E402

SERVED_NAME = "tiny-llama"
OPERATOR_TOKEN = "bench-prefix-operator-token"
GOALS = {"hit_share": 0.9, "imbalance": 1.3}
PREFIX_REPETITION_OUTPUT_LEN = 32


# ---------------------------------------------------------------------------- apps
def app_config(policy: str, port: int) -> dict[str, Any]:
    config = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    (app,) = config["applications"]
    args = app["args"]
    engines = 1 if policy == "single" else 2
    args["prefill"] = {**args["prefill"], "num_replicas": engines, "num_cpus": 0.2}
    args["decode"] = {**args["decode"], "num_replicas": engines, "num_cpus": 0.2}
    args["router"] = {
        **args["router"],
        "balancer": "load" if policy == "single" else policy,
        "operator_token": OPERATOR_TOKEN,
        "http": {**args["router"]["http"], "port": port},
    }
    config["http_options"] = {**config.get("http_options", {}), "port": port}
    return config


def engine_counts(port: int) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "role": e["role"],
            "replica": e.get("replica"),
            "healthy": e.get("healthy"),
            "prompt": e["prompt_tokens_total"] or 0,
            "hits": e["prefix_hit_tokens_total"] or 0,
            "pushed": e["kv_bytes_pushed_total"] or 0,
        }
        for name, e in pd_engines(port, OPERATOR_TOKEN).items()
    }


def engines_changed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """Why the counts of a run cannot be compared (empty: they can): the engines after the run
    must be the ones before it (the same names and Serve replicas, all healthy), since a
    replacement of an engine comes back under its name with its counts at zero, and one that
    left drops out of the sums; and every prompt a decode engine was given must have been
    computed by a prefill engine (the router prefills on the decode engine while no prefill
    engine is healthy, which would make the hit rates a colocated app's)."""
    problems = []
    if {n: e.get("replica") for n, e in before.items()} != {n: e.get("replica") for n, e in after.items()}:
        problems.append(f"the engines changed during the run: {sorted(before)} -> {sorted(after)}")
    problems += [f"{n} is not healthy after the run" for n, e in after.items() if not e.get("healthy")]
    counts = {
        moment: {role: sum(e["prompt"] for e in engines.values() if e["role"] == role) for role in ("prefill", "decode")}
        for moment, engines in (("before", before), ("after", after))
    }
    share = handed_off_share(counts["before"], counts["after"])
    if any(e["role"] == "prefill" for e in after.values()) and share is not None and share < HANDED_OFF_MIN:
        problems.append(f"a prefill engine computed only {share:.1%} of the prompt tokens (the rest fell back to the decode engines)")
    return problems


def summarize_engines(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        given = {n: after[n]["prompt"] - before.get(n, {}).get("prompt", 0) for n in after if after[n]["role"] == role}
        hits = sum(after[n]["hits"] - before.get(n, {}).get("hits", 0) for n in given)
        total = sum(given.values())
        mean = total / len(given) if given else 0.0
        out[role] = {
            "prompt_tokens": total,
            "hit_tokens": hits,
            "hit_rate": hits / total if total else 0.0,
            "computed_tokens": total - hits,
            "imbalance": max(given.values()) / mean if mean else 1.0,
            "per_engine": given,
        }
    out["kv_bytes_pushed"] = sum(after[n]["pushed"] - before.get(n, {}).get("pushed", 0) for n in after)
    return out


# ---------------------------------------------------------------------------- workloads
def prefix_repetition(port: int, quick: bool) -> dict[str, Any]:
    """vLLM's own client and shared-prefix dataset."""
    result = vllm_client(
        port,
        SERVED_NAME,
        str(REPO_ROOT / ".cache" / "tiny-llama"),
        [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", "512",
            "--prefix-repetition-suffix-len", "64",
            "--prefix-repetition-num-prefixes", "32",
            "--prefix-repetition-output-len", str(PREFIX_REPETITION_OUTPUT_LEN),
            "--num-prompts", "64" if quick else "192",
            "--max-concurrency", "8",
            "--ignore-eos",
            "--temperature", "0",
            "--seed", "0",
            "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,90",
            "--save-detailed",  # the output lengths: a stream cut off counts as failed (short_outputs)
        ],
    )  # fmt: skip
    return {
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "output_tokens_per_s": result["output_throughput"],
        "completed": result["completed"],
        "failed": int(result.get("failed") or 0) + short_outputs(result, PREFIX_REPETITION_OUTPUT_LEN),
    }


def multi_turn(port: int, quick: bool, seed: int = 0) -> dict[str, Any]:
    """Conversations of several turns, each turn the whole history plus a new user turn."""
    import aiohttp

    rng = random.Random(seed)
    systems = [[rng.randrange(20, 1000) for _ in range(128)] for _ in range(8)]  # 8 applications' system prompts
    conversations = 16 if quick else 32
    turns, user_len, answer_len, concurrency = 6, 96, 48, 8
    ttfts: list[float] = []
    outputs = 0
    failures = 0

    async def conversation(session: aiohttp.ClientSession, index: int, slots: asyncio.Semaphore) -> None:
        """Every turn; a turn that fails counts with every turn after it (they need its answer)."""
        nonlocal failures
        async with slots:
            done = 0
            try:
                done = await turns_of(session, index)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                pass
            failures += turns - done

    async def turns_of(session: aiohttp.ClientSession, index: int) -> int:
        """The turns that completed, up to the first that did not."""
        nonlocal outputs
        # Each conversation's own draws: the same user turns whichever order the conversations run in.
        user = random.Random(f"{seed}/{index}")
        history = list(systems[index % len(systems)])
        for turn in range(turns):
            history += [user.randrange(20, 1000) for _ in range(user_len)]
            body = {
                "model": SERVED_NAME,
                "prompt": history,
                "max_tokens": answer_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            sent = time.perf_counter()
            first = None
            answer: list[int] = []
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                if response.status != 200:
                    return turn
                async for chunk in sse_events(response):
                    ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - sent
                    answer += ids
            if first is None or len(answer) != answer_len:
                return turn
            ttfts.append(first)
            outputs += len(answer)
            history += answer  # the next turn carries the engine's own answer
        return turns

    async def run() -> float:
        slots = asyncio.Semaphore(concurrency)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            start = time.perf_counter()
            await asyncio.gather(*(conversation(session, i, slots) for i in range(conversations)))
            return time.perf_counter() - start

    wall = asyncio.run(run())
    ttfts.sort()
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan"),
        "output_tokens_per_s": outputs / wall,
        "completed": len(ttfts),
        "failed": failures,
    }


WORKLOADS = {"prefix_repetition": prefix_repetition, "multi-turn": multi_turn}


def run_policy(policy: str, workload: str, quick: bool, workdir: Path) -> dict[str, Any]:
    port = free_port()
    path = workdir / f"{policy}-{workload}.yaml"
    path.write_text(yaml.safe_dump(app_config(policy, port)))
    print(f"== {policy} / {workload}: starting", file=sys.stderr)
    with started([str(VENV_BIN / "serve"), "run", str(path)], base_env(), workdir / f"{policy}-{workload}.log",
                 f"http://127.0.0.1:{port}/health", REPO_ROOT):  # fmt: skip
        deadline = time.monotonic() + 300
        while not all(e["healthy"] for e in pd_engines(port, OPERATOR_TOKEN).values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{policy}: engines not healthy")
            time.sleep(1)
        before = engine_counts(port)
        client = WORKLOADS[workload](port, quick)
        time.sleep(1.5)  # the router's next stats poll carries the engines' last counts
        after = engine_counts(port)
    problems = engines_changed(before, after)
    for problem in problems:
        print(f"== {policy} / {workload}: {problem}", file=sys.stderr)
    return {**client, **summarize_engines(before, after), "host_speed": host_speed(), "problems": problems}


# ---------------------------------------------------------------------------- the router's own cost
def routing_cost(engines_n: int = 100, prefixes: int = 10_000, requests_n: int = 5000, prompt_len: int = 1024) -> dict[str, float]:
    """Microseconds per request of the router's choice by prefix as its pool makes it (the
    prompt's keys, the bound over every engine's load, the choice, the record), with
    ``engines_n`` engines under random load and ``prefixes`` in the index."""
    from serve_app.router.balancer import EngineLoad
    from serve_app.router.pool import EnginePool, PrefixRouting

    rng = random.Random(0)
    pool = EnginePool({}, prefix=PrefixRouting(block_tokens=128, max_imbalance=1.3))
    for i in range(engines_n):
        pool.loads[f"decode-{i}"] = EngineLoad(name=f"decode-{i}", role="decode", healthy=True)
    heads = [[rng.randrange(32000) for _ in range(512)] for _ in range(prefixes)]
    for head in heads:
        pool.pick("decode", prefix_keys=pool.prefix_keys(head), request_load=600)
    for load in pool.loads.values():
        load.reserved_tokens = rng.randrange(5000)
    prompts = [rng.choice(heads) + [rng.randrange(32000) for _ in range(prompt_len - 512)] for _ in range(requests_n)]
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for tokens in prompts:
            pool.pick("decode", prefix_keys=pool.prefix_keys(tokens), request_load=600)
        samples.append(1e6 * (time.perf_counter() - start) / requests_n)
    return {"us_per_request": min(samples), "engines": engines_n, "prefixes": prefixes, "prompt_tokens": prompt_len}


# ---------------------------------------------------------------------------- the report
def report(results: dict[str, dict[str, Any]], cost: dict[str, float]) -> str:
    lines = []
    for workload, by_policy in results.items():
        ideal = by_policy.get("single")
        lines.append(f"\n{workload} (2 prefill + 2 decode engines; 'single': 1 + 1, the hit-rate ideal)")
        lines.append(
            f"{'policy':8} {'prefill hit':>11} {'of ideal':>8} {'decode hit':>10} {'of ideal':>8} {'prefill computed':>16} "
            f"{'KV pushed MB':>12} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>7} {'imbal P':>7} {'imbal D':>7} {'failed':>6}"
        )
        for policy, r in by_policy.items():
            share = {
                role: (r[role]["hit_rate"] / ideal[role]["hit_rate"] if ideal and ideal[role]["hit_rate"] else float("nan"))
                for role in ("prefill", "decode")
            }
            lines.append(
                f"{policy:8} {r['prefill']['hit_rate']:11.1%} {share['prefill']:8.2f} {r['decode']['hit_rate']:10.1%} "
                f"{share['decode']:8.2f} {r['prefill']['computed_tokens']:16d} {r['kv_bytes_pushed'] / 1e6:12.1f} "
                f"{r['ttft_p50_ms']:8.0f}ms {r['ttft_p90_ms']:8.0f}ms {r['output_tokens_per_s']:7.0f} "
                f"{r['prefill']['imbalance']:7.2f} {r['decode']['imbalance']:7.2f} {r['failed']:6d}"
            )
        if "prefix" in by_policy and ideal:
            r = by_policy["prefix"]
            met = r["prefill"]["hit_rate"] >= GOALS["hit_share"] * ideal["prefill"]["hit_rate"] and max(
                r["prefill"]["imbalance"], r["decode"]["imbalance"]
            ) <= GOALS["imbalance"]
            lines.append(
                f"goal (prefix: prefill hit rate >= {GOALS['hit_share']:.0%} of the ideal, imbalance <= {GOALS['imbalance']}x): "
                + ("met" if met else "NOT met")
            )
        # A decode-side hit shortens the push: what is pushed is about the KV of the prompt
        # tokens the decode engine did not hold (in whole blocks), whatever the policy.
        per_token = {p: r["kv_bytes_pushed"] / max(1, r["decode"]["computed_tokens"]) for p, r in by_policy.items()}
        lines.append("KV bytes pushed per prompt token not held by decode: " + ", ".join(f"{p} {v:.0f}" for p, v in per_token.items()))
        for other in ("load", "random"):
            if other in by_policy and "prefix" in by_policy and by_policy[other]["kv_bytes_pushed"]:
                ratio = by_policy["prefix"]["kv_bytes_pushed"] / by_policy[other]["kv_bytes_pushed"]
                lines.append(f"KV pushed, prefix / {other}: {ratio:.2f}x")
    lines.append(
        f"\nrouting cost (prefix, {cost['engines']} engines, {cost['prefixes']} prefixes indexed, "
        f"{cost['prompt_tokens']}-token prompts): {cost['us_per_request']:.1f} us per request"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-from", type=Path, help="print the report of an earlier run's --out file, run nothing")
    parser.add_argument("--policies", default="prefix,load,random")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--routing-cost-only", action="store_true")
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args(argv)
    if opts.report_from:
        saved = json.loads(opts.report_from.read_text())
        print(report(saved["results"], saved["routing_cost"]))
        return 0
    cost = routing_cost()
    results: dict[str, dict[str, Any]] = {}
    if not opts.routing_cost_only:
        policies = [p for p in opts.policies.split(",") if p] + ["single"]
        with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
            try:
                for workload in opts.workloads.split(","):
                    results[workload] = {}
                    for p in policies:
                        results[workload][p] = run_policy(p, workload, opts.quick, Path(tmp))
            except Exception as exc:  # an app that did not start: keep what the others measured
                print(f"== stopped: {exc!r}", file=sys.stderr)
                if opts.out:
                    opts.out.write_text(json.dumps({"results": results, "routing_cost": cost, "error": repr(exc)}, indent=2, default=str))
                return 2
    text = report(results, cost)
    print(text)
    if opts.out:
        opts.out.write_text(json.dumps({"results": results, "routing_cost": cost}, indent=2))
    failed = sum(r.get("failed", 0) for per_policy in results.values() for r in per_policy.values())
    if failed:
        print(f"{failed} requests failed: the figures above are not a clean run", file=sys.stderr)
    problems = [(p, w, problem) for w, per_policy in results.items() for p, r in per_policy.items() for problem in r.get("problems") or ()]
    for policy, workload, problem in problems:
        print(f"{policy} / {workload}: {problem}: its figures are not comparable", file=sys.stderr)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
