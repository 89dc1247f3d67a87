"""Where disaggregation pays: goodput under latency SLOs on a model whose prefill costs something.

Usage: ``.venv/bin/python scripts/bench_goodput.py [--rates 1,2,4,6] [--requests 60] [--quick]
[--out goodput.json] [--plot docs/goodput.png]`` (``make bench-goodput`` sets everything up and
runs it; stop ``make run`` first: every target is started and stopped here, on free ports).

The model is the ``medium`` recipe of ``scripts/make_tiny_model.py`` (built on demand, cached in
``.cache/medium-llama``): a 2,048-token prefill takes about 130 ms on one core of the development
machine, a decode step for a batch of 8 about 2 ms. With one engine, every long prompt's prefill
stalls every running request's next token; with prefill and decode apart, decode keeps its pace.
That is what this benchmark measures (DistServe's goodput; Splitwise and Mooncake make the same
case).

Targets, on the same two cores, 0 and 1 (on a larger host the benchmark holds itself, and so
every process it starts, to those two):

* ``vllm``: vLLM's own OpenAI server, one engine whose threads use both cores, chunked prefill
  on with a step budget of ``--chunk`` tokens (smaller steps bound how long a prefill stalls
  decoding requests; that is vLLM's own answer to this problem);
* ``colocated``: pd-serve with one decode engine on both cores, the same engine arguments;
* ``disaggregated``: pd-serve 1P1D, the prefill engine on the first core, the decode engine on
  the last (its prefill takes the whole prompt in one step: there is no decode to protect);
* ``conditional``: the same 1P1D app with ``router.local_prefill_max_tokens`` at
  ``LOCAL_PREFILL_MAX_TOKENS``: a prompt that short is prefilled by the decode engine itself
  (Dynamo's conditional disaggregation), the prefill engine gets the long ones.

Workload: one sequence of Poisson arrivals, drawn once and scaled to each rate of ``--rates``
(requests per second) so that its span is exactly ``--requests / rate``: every rate offers what
its label says, and the rates differ in pace only, not in the luck of the draw. A fixed mix,
``LONG_SHARE`` of the requests long prompts of ``LONG_IN`` tokens at the same places in the
sequence, the rest chat-sized ``SHORT_IN`` in, every request ``OUT`` output tokens, greedy,
``ignore_eos``. Prompts are random token ids from a seed per rate (a rate's prompts are not in
the cache from the one before; every target gets the same requests). Per rate: TTFT p90, ITL p99
per token, TPOT p90, output tokens/s, SLO attainment and goodput; for the 1P1D targets, the share
of the prompt tokens the prefill engine computed (the router prefills a prompt on its decode
engine where ``local_prefill_max_tokens`` says so, and falls back to that while no prefill engine
is healthy: a disaggregated run below 99% is flagged, its figures partly a colocated app's); and
how late the client sent requests (it shares the cores: a late send lowers the offered rate).

ITL is counted per token, as a reader sees it: a chunk of k tokens after a gap of g is one wait of
g and k - 1 of none. vLLM's server sends a token per chunk and pd-serve several (its stream
pacing), so gaps between chunks alone would weigh each of pd-serve's stalls several times more;
the p99 of chunk gaps is kept in the JSON (``itl_chunk_p99_s``).

SLOs, fixed before any run (never tuned to a result): TTFT at most ``TTFT_SLO_S`` (several times
a long prompt's prefill on one core, DistServe's headroom for queueing) and TPOT at most
``TPOT_SLO_S`` (a fast reader's pace; about a dozen decode steps of a batch of 8). Goodput at a
rate is the number of requests that met both, per second of the span over which they arrived. DistServe's summary is the
highest rate at which at least ``ATTAINMENT`` of the requests met both; the report gives the highest
rate tried that did and the rate where attainment crosses ``ATTAINMENT``, interpolated linearly
between that rate and the next one tried (the grid is coarse).

Also, ``ALONE`` long prompts one at a time: their TTFT on the disaggregated target against the
prefill engine's own prefill time, measured as vLLM's server on the prefill engine's core with its
arguments, started right before the disaggregated target so that both see the host in the same
state (its speed drifts over a run). With the push overlapped with the forward, TTFT should be
barely more.

Every figure compares targets within one run on one machine; they are not claims about others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from bench_serving import (  # noqa: E402
    HANDED_OFF_MIN,
    OPERATOR_TOKEN,
    REPO_ROOT,
    VENV_BIN,
    base_env,
    handed_off_share,
    host_speed,
    parse_sets,
    prompt_tokens_by_role,
    set_arg,
    sse_events,
    started,
    vllm_server_command,
)

from serve_app.runtime.ports import free_port  # noqa: E402

MODEL_DIR = REPO_ROOT / ".cache" / "medium-llama"
SERVED_NAME = "medium-llama"
MAX_MODEL_LEN = 4096
LONG_SHARE = 0.2
LONG_IN = 2048
SHORT_IN = 128
OUT = 128
TTFT_SLO_S = 1.0
TPOT_SLO_S = 0.025
ATTAINMENT = 0.9
# Fine where the knees fall on a 2-core host (4-6/s on a slow day, 11-16/s on a calm one).
DEFAULT_RATES = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 20.0)
DEFAULT_CHUNK = 512
TARGETS = ("vllm", "colocated", "disaggregated", "conditional")
DISAGGREGATED = ("disaggregated", "conditional")
# The conditional target's local prefill bound, fixed before any run: a prompt whose prefill on
# the decode engine's core (about 16 ms for 256 tokens) fits in one TPOT SLO's budget.
LOCAL_PREFILL_MAX_TOKENS = 256
ALONE = 8  # long prompts one at a time, per measurement of a prompt alone
OVERRIDES: dict[str, Any] = {}  # --set KEY=JSON: app args of the pd-serve targets (dotted keys nest)
VOCAB_LOW, VOCAB_HIGH = 10, 1000  # ordinary tokens of the recipe's tokenizer (no special ids)
ARRIVAL_SEED = 1  # the one arrival sequence and mix, fixed before any run
CORES = {0, 1}  # every target's (the engines' cpu_bind below names them)
LATE_WARNING_S = 0.01  # a send this late past its arrival time is reported


# ---------------------------------------------------------------------------- the workload (pure)
@dataclass(frozen=True)
class Request:
    at_s: float  # arrival, from the run's start
    prompt: list[int]
    long: bool


def workload(rate: float, count: int, seed: int) -> list[Request]:
    """``count`` requests at ``rate``; the same for every target.

    The arrivals and which requests are long come from ``ARRIVAL_SEED`` alone: one Poisson
    sequence, scaled so that the last arrival is at ``count / rate`` (the offered rate is the
    nominal one), with exactly ``round(LONG_SHARE * count)`` long prompts. ``seed`` draws the
    prompts' tokens."""
    arrivals = random.Random(ARRIVAL_SEED)
    times = list(itertools.accumulate(arrivals.expovariate(1.0) for _ in range(count)))
    scale = count / rate / times[-1] if times else 0.0
    longs = set(arrivals.sample(range(count), round(LONG_SHARE * count)))
    tokens = random.Random(seed)
    return [
        Request(at * scale, [tokens.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(LONG_IN if i in longs else SHORT_IN)], i in longs)
        for i, at in enumerate(times)
    ]


@dataclass
class Outcome:
    long: bool
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks that bring tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each of those chunks brought
    first_chunk_tokens: int = 1
    e2e_s: float | None = None
    late_s: float = 0.0  # how long after its arrival time the request was sent (a busy client)
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # only when asked for (return_token_ids)

    @property
    def token_gaps_s(self) -> list[float]:
        """Each token's wait after the one before it reached the client (a chunk of k tokens: one
        wait and k - 1 of none); as many as the tokens after the first, as vLLM's server gives."""
        gaps = [0.0] * (self.first_chunk_tokens - 1)
        for gap, k in zip(self.chunk_gaps_s, self.chunk_tokens, strict=True):
            gaps += [gap] + [0.0] * (k - 1)
        return gaps

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        tpot = self.tpot_s
        return self.ok and self.ttft_s is not None and self.ttft_s <= ttft_slo_s and tpot is not None and tpot <= tpot_slo_s


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(outcomes: list[Outcome], wall_s: float, span_s: float) -> dict[str, float]:
    """``wall_s``: from the first send to the last token (for tokens/s); ``span_s``: from the
    run's start to the last arrival, the time over which the rate was offered (for goodput, so a
    run's drain at the end does not count against it)."""
    done = [o for o in outcomes if o.ok]
    met = sum(o.meets(TTFT_SLO_S, TPOT_SLO_S) for o in outcomes)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "ttft_p90_s": percentile([o.ttft_s for o in done if o.ttft_s is not None], 90),
        "itl_p99_s": percentile([g for o in done for g in o.token_gaps_s], 99),
        "itl_chunk_p99_s": percentile([g for o in done for g in o.chunk_gaps_s], 99),
        "tpot_p90_s": percentile([t for o in done if (t := o.tpot_s) is not None], 90),
        "short_ttft_p90_s": percentile([o.ttft_s for o in done if not o.long and o.ttft_s is not None], 90),
        "tokens_per_s": sum(o.tokens for o in done) / wall_s if wall_s > 0 else math.nan,
        "attainment": met / len(outcomes) if outcomes else math.nan,
        "goodput_rps": met / span_s if span_s > 0 else math.nan,
        "send_late_max_s": max((o.late_s for o in outcomes), default=0.0),
    }


def max_rate_meeting(per_rate: dict[float, dict[str, float]], attainment: float = ATTAINMENT) -> float:
    """DistServe's goodput: the highest rate tried at which enough requests met both SLOs (0 if none)."""
    return max((rate for rate, s in per_rate.items() if s["attainment"] >= attainment), default=0.0)


def knee_rate(per_rate: dict[float, dict[str, float]], attainment: float = ATTAINMENT) -> tuple[float, bool]:
    """Where attainment falls through ``attainment``: linear between the highest rate tried that
    met it and the next rate tried (the grid is too coarse to compare knees by). (rate, exact):
    ``exact`` is False when no higher rate was tried (the knee is at least that) or none met it."""
    best = max_rate_meeting(per_rate, attainment)
    above = sorted(r for r in per_rate if r > best)
    if not best or not above:
        return best, False
    low, high = per_rate[best]["attainment"], per_rate[above[0]]["attainment"]
    return best + (low - attainment) / (low - high) * (above[0] - best), True


# ---------------------------------------------------------------------------- the client
async def one_request(
    session: Any, url: str, request: Request, start: float, model: str = SERVED_NAME, max_tokens: int = OUT, token_ids: bool = False
) -> Outcome:
    """One streamed greedy completion sent at its arrival time; ``token_ids``: keep the output's
    ids (pd-serve's and vLLM's ``return_token_ids``)."""
    outcome = Outcome(long=request.long)
    await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # how many tokens each chunk brings (per-token ITL)
    }
    sent = time.perf_counter()
    outcome.late_s = max(0.0, sent - (start + request.at_s))
    last, pending = None, 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for event in sse_events(response):
                if event.get("usage"):
                    outcome.tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    pending += len(ids)
                    if token_ids:
                        outcome.token_ids += ids
                if not any(choice.get("text") or choice.get("token_ids") for choice in event.get("choices") or []):
                    continue  # (the usage event) a chunk that brings tokens counts, with text or not, as vLLM's client counts it
                now, brought, pending = time.perf_counter(), max(1, pending), 0
                if last is None:
                    outcome.ttft_s, outcome.first_chunk_tokens = now - sent, brought
                else:
                    outcome.chunk_gaps_s.append(now - last)
                    outcome.chunk_tokens.append(brought)
                last = now
        outcome.e2e_s = time.perf_counter() - sent
        outcome.ok = outcome.tokens == max_tokens
        if not outcome.ok:
            outcome.error = f"{outcome.tokens} tokens, not {max_tokens}"
    except Exception as exc:  # a failed request counts against the target, it does not end the run
        outcome.error = repr(exc)[:200]
    return outcome


async def drive(
    port: int, requests: list[Request], start: float | None = None, timeout_s: float = 600, **options: Any
) -> tuple[list[Outcome], float]:
    """Every request at its arrival time from ``start`` (default: now); ``options`` go to
    ``one_request``. (outcomes in order, seconds from ``start`` to the last one's end)"""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter() if start is None else start
        outcomes = await asyncio.gather(*(one_request(session, url, r, start, **options) for r in requests))
        return list(outcomes), time.perf_counter() - start


# ---------------------------------------------------------------------------- targets
def ensure_model() -> None:
    if not (MODEL_DIR / "config.json").exists():
        import make_tiny_model

        make_tiny_model.build(MODEL_DIR, "medium")


def app_args(target: str, chunk: int) -> dict[str, Any]:
    (app,) = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())["applications"]
    args = dict(app["args"])
    args.update(model=str(MODEL_DIR), served_model_name=SERVED_NAME, max_model_len=MAX_MODEL_LEN)
    step = {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True}
    args["router"] = {**args["router"], "operator_token": OPERATOR_TOKEN}  # /pd/engines in full: prompt tokens per engine
    if target == "colocated":
        args["prefill"] = {**args["prefill"], "num_replicas": 0}
        args["decode"] = {**args["decode"], "cpu_bind": ["0-1"], "engine_kwargs": step}
        args["router"] = {**args["router"], "mode": "colocated"}
    else:
        # The prefill engine takes a whole long prompt in one step: no decode runs there to protect.
        args["prefill"] = {**args["prefill"], "cpu_bind": ["0"], "engine_kwargs": {"max_num_batched_tokens": MAX_MODEL_LEN}}
        args["decode"] = {**args["decode"], "cpu_bind": ["1"], "engine_kwargs": step}
        if target == "conditional":
            args["router"] = {**args["router"], "local_prefill_max_tokens": LOCAL_PREFILL_MAX_TOKENS}
    for key, value in OVERRIDES.items():
        set_arg(args, key, value)
    return args


def command(target: str, port: int, workdir: Path, chunk: int) -> tuple[list[str], dict[str, str]]:
    if target == "vllm":
        import bench_serving

        bench_serving.OVERRIDES.update(
            {"model": str(MODEL_DIR), "served_model_name": SERVED_NAME, "max_model_len": MAX_MODEL_LEN, "decode.cpu_bind": ["0-1"]}
        )
        cmd, env = vllm_server_command(port)
        cmd += ["--max-num-batched-tokens", str(chunk), "--enable-chunked-prefill"]
        return cmd, env
    config = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    (app,) = config["applications"]
    app["args"] = app_args(target, chunk)
    app["args"]["router"] = {**app["args"]["router"], "http": {**app["args"]["router"]["http"], "port": port}}
    path = workdir / f"{target}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [str(VENV_BIN / "serve"), "run", str(path)], base_env()


def run_target(target: str, rates: list[float], count: int, chunk: int, workdir: Path) -> dict[str, Any]:
    port = free_port()
    cmd, env = command(target, port, workdir, chunk)
    result: dict[str, Any] = {"host_speed": [host_speed()], "rates": {}}
    print(f"== {target}: starting", file=sys.stderr)
    with started(cmd, env, workdir / f"{target}.log", f"http://127.0.0.1:{port}/health", REPO_ROOT):
        warm = workload(2.0, 6, seed=99)  # not recorded: cold paths and kernels for new shapes
        asyncio.run(drive(port, warm))
        result["long_alone_ttft_s"] = [alone_ttft(port, r) for r in long_prompts_alone()]
        for rate in rates:
            requests = workload(rate, count, seed=int(rate * 1000))
            prompts_before = prompt_tokens_by_role(port) if target in DISAGGREGATED else None
            outcomes, wall = asyncio.run(drive(port, requests))
            summary = summarize(outcomes, wall, span_s=requests[-1].at_s)
            errors = sorted({o.error for o in outcomes if o.error})[:3]
            result["rates"][rate] = {**summary, "errors": errors}
            if prompts_before is not None:
                result["rates"][rate]["handed_off"] = handed_off_share(prompts_before, prompt_tokens_by_role(port))
            print(
                f"== {target} rate {rate}: goodput {summary['goodput_rps']:.2f}/s, attainment {summary['attainment']:.0%}, "
                f"TTFT p90 {summary['ttft_p90_s'] * 1000:.0f} ms, ITL p99 {summary['itl_p99_s'] * 1000:.0f} ms, failed {summary['failed']}",
                file=sys.stderr,
            )
    result["host_speed"].append(host_speed())
    return result


# ---------------------------------------------------------------------------- report
def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs and not math.isnan(theirs) and not math.isnan(ours) else "n/a"


def timing(values: list[float]) -> str:
    """A few timings' median, and their range (how far apart the host put them), in ms."""
    median = f"{statistics.median(values) * 1000:.0f} ms"
    return f"{median} ({min(values) * 1000:.0f}-{max(values) * 1000:.0f} ms)" if len(values) > 1 else median


def report(results: dict[str, dict[str, Any]], rates: list[float], prefill_alone_s: list[float]) -> str:
    targets = [t for t in TARGETS if t in results]
    lines = [
        f"SLOs: TTFT <= {TTFT_SLO_S * 1000:.0f} ms and TPOT <= {TPOT_SLO_S * 1000:.0f} ms; workload {LONG_SHARE:.0%} x {LONG_IN} in, "
        f"the rest {SHORT_IN} in, {OUT} out each, Poisson arrivals (one sequence scaled to each rate: the rates are the offered ones); "
        "ITL per token (a chunk of k tokens is one wait and k - 1 of none)",
        "",
    ]
    columns = (("goodput/s", 10), ("attain", 8), ("TTFT p90", 10), ("ITL p99", 9), ("TPOT p90", 10), ("tok/s", 8), ("failed", 7))
    head = f"{'rate/s':>7} {'target':<14}" + "".join(f"{name:>{width}}" for name, width in columns)
    lines += [head, "-" * len(head)]
    for rate in rates:
        for t in targets:
            s = results[t]["rates"][rate]
            lines.append(
                f"{rate:>7.1f} {t:<14}{s['goodput_rps']:>10.2f}{s['attainment']:>8.0%}{s['ttft_p90_s'] * 1000:>8.0f}ms"
                f"{s['itl_p99_s'] * 1000:>7.0f}ms{s['tpot_p90_s'] * 1000:>8.1f}ms{s['tokens_per_s']:>8.0f}{s['failed']:>7}"
            )
        lines.append("")
    best = {t: max_rate_meeting(results[t]["rates"]) for t in targets}
    pairs = [(t, "vllm", "vLLM's server (goals: ITL p99 <= 0.5x, goodput >= 1.3x; TPOT p90 for decode's pace)") for t in DISAGGREGATED]
    # The same serving path with and without P/D: the effect of disaggregation alone.
    pairs.append(("disaggregated", "colocated", "pd-serve colocated (the same serving path: what disaggregation alone changes)"))
    for target, against, label in ((t, a, lab) for t, a, lab in pairs if t in results and a in results):
        base, ours = results[against]["rates"], results[target]["rates"]
        lines.append(f"{target.capitalize()} against {label}:")
        for rate in rates:
            lines.append(
                f"  rate {rate:>4.1f}: ITL p99 {ratio(ours[rate]['itl_p99_s'], base[rate]['itl_p99_s'])}, "
                f"goodput {ratio(ours[rate]['goodput_rps'], base[rate]['goodput_rps'])}, "
                f"TPOT p90 {ratio(ours[rate]['tpot_p90_s'], base[rate]['tpot_p90_s'])}"
            )
        lines.append("")
    if "vllm" in best and len(best) > 1:
        lines.append(
            f"Highest rate tried with >= {ATTAINMENT:.0%} within both SLOs: "
            + ", ".join(f"{t} {r:.1f}/s" for t, r in best.items())
            + " ("
            + ", ".join(f"{t} {ratio(best[t], best['vllm'])}" for t in targets if t != "vllm")
            + " of vLLM's server)"
        )
        knees = {t: knee_rate(results[t]["rates"]) for t in targets}
        lines.append(
            f"Where attainment crosses {ATTAINMENT:.0%}, interpolated between the rates tried: "
            + ", ".join(knee_text(t, r, exact, min(rates)) for t, (r, exact) in knees.items())
            + " ("
            + ", ".join(f"{t} {knee_ratio(knees[t], knees['vllm'])}" for t in targets if t != "vllm")
            + " of vLLM's server; goal >= 1.30x)"
        )
    lines += handoff_lines(results, rates) + lateness_lines(results, rates)
    all_dis = results.get("disaggregated", {}).get("long_alone_ttft_s") or []
    dis = [t for t in all_dis if t is not None]
    alone = [t for t in prefill_alone_s if t is not None]
    if dis and alone:
        ratio_alone = ratio(statistics.median(dis), statistics.median(alone))
        lines += [
            "",
            f"A {LONG_IN}-token prompt alone ({len(dis)} one at a time, medians and ranges): disaggregated TTFT {timing(dis)}, "
            f"the prefill engine's own prefill {timing(alone)} on the same core: {ratio_alone} (goal <= 1.10x)",
        ]
    lost = (len(all_dis) - len(dis), len(prefill_alone_s) - len(alone))
    if any(lost):
        lines.append(f"  failed, left out of those medians: {lost[0]} disaggregated, {lost[1]} of the prefill engine's own")
    lines += ["", "The idle host before / after each target (wake-up round trip µs, Python loop ms):"]
    for t in targets:
        lines.append("  " + t + ": " + " / ".join(f"{h['wakeup_us']:.0f} µs, {h['loop_ms']:.0f} ms" for h in results[t]["host_speed"]))
    return "\n".join(lines)


def handoff_lines(results: dict[str, dict[str, Any]], rates: list[float]) -> list[str]:
    """The share of prompt tokens the 1P1D targets' prefill engine computed, rate by rate, and a
    warning where the disaggregated target's fell below 99% (prompts prefilled by the decode
    engine while no prefill engine was healthy: not a disaggregated figure)."""
    lines = []
    for t in DISAGGREGATED:
        shares = [(rate, results[t]["rates"][rate].get("handed_off")) for rate in rates if t in results]
        if not any(share is not None for _, share in shares):
            continue
        if not lines:
            lines += ["", "Prompt tokens the prefill engine computed (the rest, the decode engine's):"]
        lines.append(f"  {t}: " + ", ".join(f"{rate:g}/s {share:.0%}" for rate, share in shares if share is not None))
        low = [rate for rate, share in shares if t == "disaggregated" and share is not None and share < HANDED_OFF_MIN]
        if low:
            where = ", ".join(f"{r:g}/s" for r in low)
            lines.append(f"  WARNING: {t} at {where}: prompts fell back to the decode engine; not disaggregated figures")
    return lines


def lateness_lines(results: dict[str, dict[str, Any]], rates: list[float]) -> list[str]:
    """Where the client sent a request more than ``LATE_WARNING_S`` after its arrival time (it
    shares the cores with the target: the rate it offered was then lower than its label)."""
    late = [
        (t, rate, s["send_late_max_s"])
        for t in results
        for rate in rates
        if (s := results[t]["rates"].get(rate)) and s.get("send_late_max_s", 0.0) > LATE_WARNING_S
    ]
    if not late:
        return []
    return ["", "Sends later than their arrival time by more than 10 ms (the most late, per run):"] + [
        f"  {t} {rate:g}/s: {seconds * 1000:.0f} ms" for t, rate, seconds in late
    ]


def knee_ratio(ours: tuple[float, bool], theirs: tuple[float, bool]) -> str:
    """The ratio of two knees (``knee_rate``), marked as the bound it is where a knee is one: a
    knee past the highest rate tried is at least that rate, so over an exact knee the ratio is at
    least the figure, and an exact knee over it at most; "n/a" where both are bounds or one is
    below the lowest rate tried."""
    (rate, exact), (other, other_exact) = ours, theirs
    if not rate or not other or not (exact or other_exact):
        return "n/a"
    figure = ratio(rate, other)
    return figure if exact and other_exact else (">= " if other_exact else "<= ") + figure


def knee_text(target: str, rate: float, exact: bool, lowest: float) -> str:
    if not rate:
        return f"{target} below {lowest:.1f}/s"
    return f"{target} {'' if exact else '>= '}{rate:.1f}/s"


def plot(results: dict[str, dict[str, Any]], rates: list[float], path: Path) -> None:
    """Goodput and ITL p99 against rate, as DistServe draws them, and TPOT p90 (decode's pace)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    for t in (t for t in TARGETS if t in results):
        per = results[t]["rates"]
        left.plot(rates, [per[r]["goodput_rps"] for r in rates], marker="o", label=t)
        middle.plot(rates, [per[r]["itl_p99_s"] * 1000 for r in rates], marker="o", label=t)
        right.plot(rates, [per[r]["tpot_p90_s"] * 1000 for r in rates], marker="o", label=t)
    left.plot(rates, rates, linestyle=":", color="grey", label="offered")
    left.set(xlabel="request rate (req/s)", ylabel="goodput (req/s within both SLOs)", title="Goodput")
    middle.set(xlabel="request rate (req/s)", ylabel="ITL p99 (ms)", title="Inter-token latency p99, per token", yscale="log")
    right.axhline(TPOT_SLO_S * 1000, linestyle=":", color="grey", label="TPOT SLO")
    right.set(xlabel="request rate (req/s)", ylabel="TPOT p90 (ms)", title="Time per output token p90")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend()
    mix = f"{LONG_SHARE:.0%} x {LONG_IN}-token prompts, {SHORT_IN} otherwise, {OUT} out"
    fig.suptitle(f"{mix}; TTFT <= {TTFT_SLO_S}s, TPOT <= {TPOT_SLO_S * 1000:.0f}ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def prefill_time_alone(chunk: int, workdir: Path) -> list[float | None]:
    """The prefill engine's own time for a long prompt: vLLM's server on the prefill engine's
    core with the prefill engine's arguments, TTFT of each long prompt alone."""
    import bench_serving

    port = free_port()
    bench_serving.OVERRIDES.update(
        {"model": str(MODEL_DIR), "served_model_name": SERVED_NAME, "max_model_len": MAX_MODEL_LEN, "decode.cpu_bind": ["0"]}
    )
    cmd, env = vllm_server_command(port)
    cmd += ["--max-num-batched-tokens", str(MAX_MODEL_LEN)]
    print("== the prefill engine's own prefill time: starting", file=sys.stderr)
    with started(cmd, env, workdir / "prefill-alone.log", f"http://127.0.0.1:{port}/health", REPO_ROOT):
        asyncio.run(drive(port, workload(2.0, 4, seed=99)))
        return [alone_ttft(port, r) for r in long_prompts_alone()]  # None: failed (counted in the report)


def alone_ttft(port: int, request: Request) -> float | None:
    """One request's TTFT, sent alone; None where it failed (a stream cut after its first token
    has a TTFT too, but it is not a prefill to compare)."""
    (outcome,), _ = asyncio.run(drive(port, [request]))
    return outcome.ttft_s if outcome.ok else None


def long_prompts_alone() -> list[Request]:
    """The same ``ALONE`` long prompts for the prefill alone and the disaggregated target."""
    return [Request(0.0, r.prompt, True) for r in workload(1.0, 20 * ALONE, seed=7) if r.long][:ALONE]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(str(r) for r in DEFAULT_RATES), help="requests per second, comma-separated")
    parser.add_argument("--requests", type=int, default=100, help="requests per rate and target")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="max_num_batched_tokens of every engine that decodes")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--quick", action="store_true", help="two rates, few requests (a smoke run)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override an app arg of the pd-serve targets (e.g. stream_items_per_s=0)",
    )
    parser.add_argument("--out", type=Path, help="write every number as JSON here too")
    parser.add_argument("--plot", type=Path, help="draw goodput and ITL p99 against rate into this PNG")
    parser.add_argument("--report", type=Path, metavar="JSON", help="print the report of a run saved with --out (and plot it), run nothing")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        results = {t: {**r, "rates": {float(k): v for k, v in r["rates"].items()}} for t, r in saved["results"].items()}
        rates = sorted(next(iter(results.values()))["rates"])
        # Runs saved before the prompt alone was measured ALONE times kept only the median.
        alone = saved.get("prefill_alone_runs_s") or ([saved["prefill_alone_s"]] if saved.get("prefill_alone_s") else [])
        print(report(results, rates, alone))
        if args.plot:
            plot(results, rates, args.plot)
        return 0
    rates = [1.0, 3.0] if args.quick else [float(r) for r in args.rates.split(",")]
    count = 12 if args.quick else args.requests
    OVERRIDES.update(parse_sets(args.set))
    hold_to_cores()
    ensure_model()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdgoodput-") as tmp:
        workdir = Path(tmp)
        prefill_alone: list[float | None] = []
        try:
            for target in args.targets.split(","):
                if target == "disaggregated":  # right before it: the host as the target will see it
                    prefill_alone = prefill_time_alone(args.chunk, workdir)
                results[target] = run_target(target, rates, count, args.chunk, workdir)
        except Exception as exc:  # a target that did not start: keep what the others measured
            print(f"== stopped: {exc!r}", file=sys.stderr)
            if args.out:
                saved = {"results": results, "prefill_alone_runs_s": prefill_alone, "error": repr(exc)}
                args.out.write_text(json.dumps(saved, indent=2, default=str))
            return 2
    table = report(results, rates, prefill_alone)
    print(table)
    if args.out:
        saved = {"results": results, "prefill_alone_runs_s": prefill_alone, "table": table}
        args.out.write_text(json.dumps(saved, indent=2, default=str))
    if args.plot:
        with contextlib.suppress(ImportError):
            plot(results, rates, args.plot)
    failed = sum(s["failed"] for r in results.values() for s in r["rates"].values())
    failed += sum(t is None for t in prefill_alone) + sum(t is None for r in results.values() for t in r.get("long_alone_ttft_s") or [])
    return 1 if failed else 0


def hold_to_cores() -> None:
    """Every target on the same two cores: this process, and so every process it starts (the
    targets' servers, Ray, the engines; pd-serve places its replicas within the cores it is
    given), is held to ``CORES``. The engines' binding names those cores."""
    usable = os.sched_getaffinity(0)
    if not CORES <= usable:
        raise SystemExit(f"bench_goodput needs cores {sorted(CORES)}; this process may use {sorted(usable)}")
    if usable != CORES:
        os.sched_setaffinity(0, CORES)
        print(f"== every target on cores {sorted(CORES)} of the {len(usable)} this host gives", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
