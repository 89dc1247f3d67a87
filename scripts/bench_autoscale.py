"""Elastic pools under a step load: a static 1P1D app against the autoscaled one, in one run.

Usage: ``.venv/bin/python scripts/bench_autoscale.py [--quick] [--out autoscale.json]`` (after
``make run`` or ``make test`` set up the venv and the tiny model; stop ``make run`` first: each app
is started here with ``serve run``, on a free port, and stopped after).

Two apps, both disaggregated on the tiny model, as shipped (only the port and an operator token for
``/pd/engines`` are changed):

* ``static``: configs/serve.yaml, 1 prefill and 1 decode engine;
* ``autoscaled``: configs/serve-autoscale.yaml, the README's "Scaling" example: prefill and decode
  each with Serve's ``autoscaling_config`` (min 1, max 2) and pd-serve's load policies (decode
  scales on running + waiting requests, prefill on prompt tokens queued or computing).

Both get the same requests: Poisson arrivals in three phases, ``low`` / ``high`` / ``low`` (``PHASES``),
each request a random prompt of ``PROMPT`` tokens and ``OUT`` greedy output tokens
(``ignore_eos``), streamed. Per app and phase (a request belongs to the phase it arrived in): the
requests, those lost (an error, or not all ``OUT`` tokens), TTFT p90 and ITL p90 (the gaps between
streamed chunks), and the engines each pool had (the router's own view, ``/pd/engines``, polled
every ``POLL_S``). For the autoscaled app: the seconds from the high phase's start to a second
decode (and prefill) engine taking requests, and from the high phase's end to the pool back at
one. Every autoscaled output is compared with the static app's for the same prompt, token for
token: a request that moved off an engine Serve stopped must read as if nothing happened.

The host has 2 cores: the autoscaled app's second engines share them with the first ones, so
what a second engine adds here is mostly its own share of the per-engine pacing
(``stream_items_per_s``) and batch, not compute. The table says how fast the pools follow the
load and that nothing is lost; on a host with a core (or an accelerator) per engine the latencies
of the high phase would fall further. docs/performance.md, "Elastic pools", has the latest run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from bench_goodput import Outcome, Request, percentile  # noqa: E402
from bench_goodput import drive as goodput_drive  # noqa: E402
from bench_serving import REPO_ROOT, VENV_BIN, base_env, pd_engines, started  # noqa: E402

from serve_app.runtime.ports import free_port  # noqa: E402

SERVED_NAME = "tiny-llama"
OPERATOR_TOKEN = "bench-autoscale-operator-token"
PROMPT = 256
OUT = 128
VOCAB_LOW, VOCAB_HIGH = 10, 1000
POLL_S = 0.5
DASHBOARD = "http://127.0.0.1:8265"  # Ray's dashboard, where `serve run` starts it


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # requests per second
    duration_s: float


PHASES = (Phase("low", 2.0, 40.0), Phase("high", 16.0, 120.0), Phase("low again", 2.0, 120.0))
QUICK = (Phase("low", 2.0, 15.0), Phase("high", 16.0, 40.0), Phase("low again", 2.0, 60.0))

CONFIGS = {"static": REPO_ROOT / "configs" / "serve.yaml", "autoscaled": REPO_ROOT / "configs" / "serve-autoscale.yaml"}


# ---------------------------------------------------------------------------- the load (pure)
def step_load(phases: tuple[Phase, ...], seed: int = 0) -> list[tuple[str, Request]]:
    """Every request with its phase, arrivals Poisson within each phase; the same for every app."""
    rng = random.Random(seed)
    out: list[tuple[str, Request]] = []
    begin = 0.0
    for phase in phases:
        at = begin
        while True:
            at += rng.expovariate(phase.rate)
            if at >= begin + phase.duration_s:
                break
            out.append((phase.name, Request(at, [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(PROMPT)], False)))
        begin += phase.duration_s
    return out


def phase_bounds(phases: tuple[Phase, ...]) -> dict[str, tuple[float, float]]:
    bounds, begin = {}, 0.0
    for phase in phases:
        bounds[phase.name] = (begin, begin + phase.duration_s)
        begin += phase.duration_s
    return bounds


def first_time(timeline: list[tuple[float, dict[str, int]]], key: str, since: float | None, test: Any) -> float | None:
    """The first time, at or after ``since``, at which ``key`` of the timeline passed ``test`` (None: never)."""
    if since is None:
        return None
    for at, counts in timeline:
        if at >= since and key in counts and test(counts[key]):
            return at
    return None


def after(at: float | None, since: float) -> float | None:
    return None if at is None else at - since


def summarize(
    results: list[tuple[str, Outcome]], timeline: list[tuple[float, dict[str, int]]], phases: tuple[Phase, ...]
) -> dict[str, Any]:
    bounds = phase_bounds(phases)
    out: dict[str, Any] = {}
    for phase in phases:
        outcomes = [o for name, o in results if name == phase.name]
        done = [o for o in outcomes if o.ok]
        lo, hi = bounds[phase.name]
        seen = [counts for at, counts in timeline if lo <= at < hi]
        out[phase.name] = {
            "requests": len(outcomes),
            "lost": len(outcomes) - len(done),
            "ttft_p90_s": percentile([o.ttft_s for o in done if o.ttft_s is not None], 90),
            "itl_p90_s": percentile([g for o in done for g in o.chunk_gaps_s], 90),
            "engines": {
                role: (min(c.get(role, 0) for c in seen), max(c.get(role, 0) for c in seen)) if seen else (0, 0)
                for role in ("prefill", "decode")
            },
            "errors": sorted({o.error for o in outcomes if o.error})[:3],
        }
    high_lo, high_hi = bounds[phases[1].name]
    out["scaling"] = {}
    for role in ("prefill", "decode"):
        # Up: Serve's target, its replica RUNNING, the router's pool (each from the high phase's
        # start). Down: the router's pool back at one (looked for from the high phase's end or
        # the scale-up, whichever came later), timed from the high phase's end.
        joined = first_time(timeline, role, high_lo, lambda n: n >= 2)
        out["scaling"][role] = {
            "decided_after_s": after(first_time(timeline, f"{role}.target", high_lo, lambda n: n >= 2), high_lo),
            "running_after_s": after(first_time(timeline, f"{role}.running", high_lo, lambda n: n >= 2), high_lo),
            "up_after_s": after(joined, high_lo),
            "down_after_s": after(first_time(timeline, role, None if joined is None else max(joined, high_hi), lambda n: n <= 1), high_hi),
        }
    return out


# ---------------------------------------------------------------------------- apps
def app_config(target: str, port: int) -> dict[str, Any]:
    """The target's shipped config file, on ``port``, with an operator token for ``/pd/engines``."""
    config = yaml.safe_load(CONFIGS[target].read_text())
    (app,) = config["applications"]
    args = app["args"]
    args["router"] = {**args["router"], "operator_token": OPERATOR_TOKEN, "http": {**args["router"]["http"], "port": port}}
    config["http_options"] = {**config.get("http_options", {}), "port": port}
    return config


def downscale_delay_s(config: dict[str, Any]) -> float:
    (app,) = config["applications"]
    return max(float((app["args"][role].get("autoscaling_config") or {}).get("downscale_delay_s", 0)) for role in ("prefill", "decode"))


def engine_counts(port: int) -> dict[str, int]:
    """Engines of each role the router can choose now (joined, not leaving)."""
    counts: dict[str, int] = {}
    for e in pd_engines(port, OPERATOR_TOKEN, timeout_s=5).values():
        if not e.get("draining"):
            counts[e["role"]] = counts.get(e["role"], 0) + 1
    return counts


def serve_counts(dashboard: str, app: str = "pd") -> dict[str, int]:
    """Serve's own view through its REST API: each pool's target and RUNNING replicas (``decode.target``, ``decode.running``)."""
    response = requests.get(f"{dashboard}/api/serve/applications/", timeout=5)
    response.raise_for_status()
    deployments = response.json()["applications"][app]["deployments"]
    counts: dict[str, int] = {}
    for role in ("prefill", "decode"):
        d = deployments.get(role) or {}
        counts[f"{role}.target"] = int(d.get("target_num_replicas") or 0)
        counts[f"{role}.running"] = sum(1 for r in d.get("replicas") or [] if r.get("state") == "RUNNING")
    return counts


class Watcher(threading.Thread):
    """Polls the router's view of the pools (and Serve's, when its dashboard answers), from the load's start."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.start_at = time.perf_counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                counts = engine_counts(self.port)
            except requests.RequestException:
                continue
            with contextlib.suppress(requests.RequestException, KeyError, ValueError):
                counts.update(serve_counts(DASHBOARD))
            self.timeline.append((time.perf_counter() - self.start_at, counts))


def drive(port: int, load: list[tuple[str, Request]], start: float) -> list[tuple[str, Outcome]]:
    outcomes, _ = asyncio.run(
        goodput_drive(port, [r for _, r in load], start=start, timeout_s=900, model=SERVED_NAME, max_tokens=OUT, token_ids=True)
    )
    return [(name, o) for (name, _), o in zip(load, outcomes)]


def decode_engines(port: int) -> int:
    """The decode engines the router lists; a poll that timed out counts as more than one (the
    wait for the pool's way down goes on), as the watcher lets one pass."""
    try:
        return engine_counts(port).get("decode", 0)
    except (requests.RequestException, ValueError, KeyError):
        return 2


def run_target(target: str, phases: tuple[Phase, ...], workdir: Path) -> dict[str, Any]:
    port = free_port()
    config = app_config(target, port)
    path = workdir / f"{target}.yaml"
    path.write_text(yaml.safe_dump(config))
    print(f"== {target}: starting", file=sys.stderr)
    with started(
        [str(VENV_BIN / "serve"), "run", str(path)], base_env(), workdir / f"{target}.log", f"http://127.0.0.1:{port}/health", REPO_ROOT
    ):
        warm = [("warm", Request(0.1 * i, [11 + i] * PROMPT, False)) for i in range(4)]  # cold paths; not recorded
        drive(port, warm, time.perf_counter())
        total_s = sum(p.duration_s for p in phases)
        # After the load: the pools' way back down is part of what is measured.
        tail_s = downscale_delay_s(config) + 30
        watcher = Watcher(port)
        watcher.start()
        results = drive(port, step_load(phases), watcher.start_at)
        while time.perf_counter() - watcher.start_at < total_s + tail_s and decode_engines(port) > 1:
            time.sleep(POLL_S)
        watcher.stop.set()
        watcher.join()
    summary = summarize(results, watcher.timeline, phases)
    summary["token_ids"] = [o.token_ids for _, o in results]
    for phase in phases:
        s = summary[phase.name]
        print(
            f"== {target} {phase.name}: {s['requests']} requests, lost {s['lost']}, TTFT p90 {s['ttft_p90_s'] * 1000:.0f} ms, "
            f"ITL p90 {s['itl_p90_s'] * 1000:.1f} ms, engines {s['engines']}",
            file=sys.stderr,
        )
    return summary


# ---------------------------------------------------------------------------- report
def verdict(results: dict[str, dict[str, Any]], phases: tuple[Phase, ...]) -> tuple[int, int | None]:
    """(requests lost in every app, autoscaled outputs missing or unequal to the static app's;
    None: not both ran)."""
    lost = sum(r[p.name]["lost"] for r in results.values() for p in phases)
    if not {"static", "autoscaled"} <= set(results):
        return lost, None
    return lost, sum(1 for a, b in zip(results["autoscaled"]["token_ids"], results["static"]["token_ids"]) if not a or a != b)


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def report(results: dict[str, dict[str, Any]], phases: tuple[Phase, ...]) -> str:
    head = f"{'app':<11} {'phase':<10} {'rate/s':>6} {'requests':>8} {'lost':>5} {'TTFT p90':>9} {'ITL p90':>8}  prefill  decode"
    lines = [
        f"Step load: {PROMPT} tokens in, {OUT} out, Poisson arrivals; engines: the fewest-most the router saw",
        "",
        head,
        "-" * len(head),
    ]
    for target, r in results.items():
        for phase in phases:
            s = r[phase.name]
            (p_lo, p_hi), (d_lo, d_hi) = s["engines"]["prefill"], s["engines"]["decode"]
            lines.append(
                f"{target:<11} {phase.name:<10} {phase.rate:>6.1f} {s['requests']:>8} {s['lost']:>5} {s['ttft_p90_s'] * 1000:>7.0f}ms"
                f"{s['itl_p90_s'] * 1000:>6.1f}ms  {p_lo}-{p_hi:<6} {d_lo}-{d_hi}"
            )
    if "autoscaled" in results:
        scaling = results["autoscaled"]["scaling"]
        lines.append("")
        for role in ("decode", "prefill"):
            s = scaling[role]
            lines.append(
                f"autoscaled {role}, from the high phase's start: Serve asked for 2 at {seconds(s['decided_after_s'])}, "
                f"the second RUNNING at {seconds(s['running_after_s'])}, in the router's pool at {seconds(s['up_after_s'])}; "
                f"back to one {seconds(s['down_after_s'])} after the high phase ended"
            )
    lost, differ = verdict(results, phases)
    if differ is not None:
        total = len(results["static"]["token_ids"])
        lines.append(f"autoscaled outputs equal to the static app's, token for token: {total - differ}/{total}")
    lines.append(f"requests lost: {lost} (must be 0)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (a smoke run)")
    parser.add_argument("--targets", default="static,autoscaled")
    parser.add_argument("--out", type=Path, help="write every number as JSON here too")
    args = parser.parse_args(argv)
    phases = QUICK if args.quick else PHASES
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdautoscale-") as tmp:
        try:
            for target in args.targets.split(","):
                results[target] = run_target(target, phases, Path(tmp))
        except Exception as exc:  # an app that did not start: keep what the others measured
            print(f"== stopped: {exc!r}", file=sys.stderr)
            if args.out:
                args.out.write_text(json.dumps({"results": results, "error": repr(exc)}, indent=2, default=str))
            return 2
    table = report(results, phases)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "table": table}, indent=2, default=str))
    lost, differ = verdict(results, phases)
    unscaled = never_scaled(results)
    for line in unscaled:
        print(line, file=sys.stderr)
    return 1 if lost or differ or unscaled else 0


def never_scaled(results: dict[str, dict[str, Any]]) -> list[str]:
    """The autoscaled app's decode pool must have grown and shrunk: else nothing moved, and
    "nothing lost while scaling" was never put to the test."""
    scaling = (results.get("autoscaled") or {}).get("scaling", {}).get("decode")
    if scaling is None:
        return []
    return [
        f"the autoscaled decode pool {what} within the run: scaling was not tested"
        for key, what in (("up_after_s", "never took a second engine"), ("down_after_s", "never went back to one"))
        if scaling.get(key) is None
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
