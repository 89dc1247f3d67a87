"""pd-serve against vLLM's own OpenAI server, in one run, with vLLM's own benchmark client.

Usage: ``.venv/bin/python scripts/bench_serving.py [--targets vllm,colocated,disaggregated,colocated-grpc,...]
[--quick] [--rounds N] [--repeat N] [--out bench.json]`` (after ``make run`` or ``make test`` set up the venv
and the tiny model; stop ``make run`` first: every target here is started and stopped by this
script, one at a time, on free ports).

Targets, each started as a user would start it:

* ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` with the engine arguments (and CPU
  thread binding) pd-serve gives its decode engine, one engine;
* ``colocated``: ``serve run`` of configs/serve.yaml with no prefill engine, router.mode colocated;
* ``disaggregated``: ``serve run`` of configs/serve.yaml as it is (one prefill, one decode);
* ``mock``: configs/serve.yaml on the mock engine (``backend: mock``): the router and the
  decode-first handoff, with engines that cost (almost) nothing;
* ``mock-colocated``: the same, colocated on one mock decode engine: the router alone;
* ``colocated-grpc``, ``disaggregated-grpc``: ``colocated`` and ``disaggregated`` with the router's
  engine calls over Serve handles (``router.engine_transport: grpc``, pinned to the replica the
  schedule chose) instead of the engines' own HTTP endpoints.

Each is driven by ``vllm.benchmarks.serve`` (random dataset, ``--ignore-eos``, temperature 0) at
concurrency 1, 8 and 32 after a short warm-up that is not recorded. Targets take turns: each round
starts every target once and runs each workload ``--repeat`` times on it (default 3 rounds of 1), so
that a slow spell of the shared host, which lasts minutes to hours, is less likely to fall on one
target only (one start after another, the first target's runs could all meet it). The script prints
one table with ratios to vLLM's server (of the run with the median throughput among all rounds,
every run's listed beside it), the ratios round by round, the CPU seconds of each kind of process
during the median run (router, HTTP proxy, engine replica or API server, engine core, worker, Ray's
own), the router's CPU microseconds per output token, and for the mocks: the TTFT the router adds
over a direct streaming call to the same mock decode engine (colocated: the router's own share;
disaggregated: with the KVReady callback and the prefill call).
Timings compare targets within one run on one machine; they are not claims about other hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import requests
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from serve_app.runtime.ports import free_port  # noqa: E402  (importable once the repo's root is on the path)

VENV_BIN = Path(sys.executable).parent
SERVE_YAML = REPO_ROOT / "configs" / "serve.yaml"
OVERRIDES: dict[str, Any] = {}  # --set KEY=JSON: app args for every pd-serve target (dotted keys nest)
# What every target of this benchmark's own runs gets (vLLM's server too: it takes the decode
# engine's arguments), before --set: no prefix cache. vLLM's random dataset builds each prompt as
# a run of consecutive token ids from a seeded start, so the tiny model's 828 ordinary tokens allow
# only 828 prompts of a length, and 40% of c=32's repeat an earlier one; whole-prompt cache hits
# would measure no prefill and, disaggregated, no push.
RUN_DEFAULTS: dict[str, Any] = {"engine_kwargs.enable_prefix_caching": False}
# The mock engine's costs: small enough that a mock engine outpaces one router replica, so what
# the mock targets measure is the router. Their runs are longer (MOCK_PROMPTS_FACTOR x the
# prompts): at these speeds the vLLM workloads' prompts take well under a second.
MOCK_DECODE_STEP_S = 0.0005
MOCK_PREFILL_S_PER_TOKEN = 0.000001
MOCK_PROMPTS_FACTOR = 2
# The operator's token the benchmark's pd-serve apps get: /pd/engines in full, for each engine's
# count of the prompt tokens it was given (handed_off_share).
OPERATOR_TOKEN = "pd-bench-operator"
# A disaggregated run in which a prefill engine computed less of the prompt tokens than this is
# flagged: the rest were prefilled by decode engines (handed_off_share).
HANDED_OFF_MIN = 0.99


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    input_len: int
    output_len: int
    prompts: int
    # vLLM's random dataset draws each prompt's start from the seed: a workload of its own, so no
    # workload repeats the warm-up's or another's prompts (whole-prompt prefix-cache hits).
    seed: int = 0


# Enough prompts that each run lasts several seconds even on vLLM's server: shorter runs swing
# with Ray's periodic background work (its dashboard agent, metrics export) on a 2-core host.
WORKLOADS = [
    Workload("c=1", 1, 32, 16, 64, seed=1),
    Workload("c=8", 8, 256, 64, 256, seed=2),
    Workload("c=32", 32, 256, 64, 384, seed=3),
]
# Run on each target before the measured workloads, not recorded: the first requests after a
# start meet cold paths (connections, handles, kernels for new shapes) in every target alike.
WARM_UP = [Workload("warm-up c=1", 1, 32, 16, 8, seed=101), Workload("warm-up c=8", 8, 256, 64, 16, seed=102)]
QUICK = [Workload("c=1", 1, 32, 16, 12, seed=1), Workload("c=8", 8, 256, 64, 32, seed=2), Workload("c=32", 32, 256, 64, 64, seed=3)]


def base_env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }


# ---------------------------------------------------------------------------- processes
def kind_of(proc: psutil.Process) -> str | None:
    """Which part of the system a process is, from its title or command line."""
    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except psutil.Error:
        return None
    if cmd.startswith("VLLM::EngineCore") or name.startswith("VLLM::EngineCor"):
        return "engine core"
    if cmd.startswith("VLLM::Worker") or name.startswith("VLLM::Worker"):
        return "worker"
    if ":router" in cmd and "ServeReplica" in cmd:
        return "router"
    if "ProxyActor" in cmd:
        return "http proxy"
    if "ServeReplica" in cmd and (":decode" in cmd or ":prefill" in cmd):
        return "engine replica"
    if "vllm.entrypoints.openai.api_server" in cmd:
        return "api server"
    if any(k in cmd for k in ("raylet", "gcs_server", "ray::", "ray/dashboard", "log_monitor", "serve run", "ray/_private")):
        return "ray"
    return None


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    out = {}
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        kind = kind_of(proc)
        if kind is None:
            continue
        try:
            t = proc.cpu_times()
            out[proc.pid] = (kind, t.user + t.system)
        except psutil.Error:
            pass
    return out


def cpu_by_kind(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        spent = seconds - before.get(pid, (kind, 0.0))[1]
        totals[kind] = totals.get(kind, 0.0) + max(0.0, spent)
    return totals


def log_tail(log: Path, lines: int = 40) -> str:
    """The end of a start's log, for the error: the log's folder is removed when the run ends."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


@contextlib.contextmanager
def started(cmd: list[str], env: dict[str, str], log: Path, health_url: str, repo: Path, timeout_s: float = 300) -> Iterator[None]:
    """A server process started in its own session from ``repo``, healthy before the body runs,
    stopped by SIGTERM (and SIGKILL of its group if it lingers) after, also when the benchmark
    itself is stopped by SIGTERM (its own session would otherwise outlive it, holding ports)."""
    env = {**env, "PYTHONPATH": str(repo)} if repo != REPO_ROOT else env
    expected = engines_expected(cmd)
    base_url = health_url.rsplit("/", 1)[0]
    others = serving_pids()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=repo, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if threading.current_thread() is threading.main_thread() else None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; its log ends:\n{log_tail(log)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(health_url, timeout=2).status_code == 200 and engines_joined(base_url, expected):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(cmd)} not healthy within {timeout_s}s; its log ends:\n{log_tail(log)}")
            time.sleep(1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        wait_for_no_engines(others)


def engines_expected(cmd: list[str]) -> dict[str, int]:
    """The engines per role a ``serve run CONFIG.yaml`` command starts with (empty for any other
    command): the router answers /health once one decode engine is in, and the others join as
    Serve lists them; until a prefill engine has, a disaggregated app serves colocated."""
    from serve_app.config.settings import load_config

    if len(cmd) < 3 or cmd[-2] != "run" or not cmd[-1].endswith(".yaml"):
        return {}
    (app,) = yaml.safe_load(Path(cmd[-1]).read_text())["applications"]
    config = load_config(app.get("args") or {})
    return {"prefill": config.prefill.initial_replicas if config.has_prefill() else 0, "decode": config.decode.initial_replicas}


def engines_joined(base_url: str, expected: dict[str, int]) -> bool:
    """Whether the router at ``base_url`` lists at least ``expected`` healthy engines per role
    (``/pd/engines``, the view any client has)."""
    if not any(expected.values()):
        return True
    try:
        engines = requests.get(f"{base_url}/pd/engines", timeout=5).json()["engines"]
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return False
    healthy = [engine["role"] for engine in engines.values() if engine.get("healthy")]
    return all(healthy.count(role) >= count for role, count in expected.items())


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


SERVING_KINDS = ("engine core", "worker", "router", "engine replica", "api server")


def serving_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter() if kind_of(p) in SERVING_KINDS}


def wait_for_no_engines(others: set[int], timeout_s: float = 60) -> None:
    """Until the serving processes a target started are gone (their ports and cores free for the
    next target); ``others``, those that ran before it (another app, a test's cluster), are not
    waited for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not serving_pids() - others:
            return
        time.sleep(1)


# ---------------------------------------------------------------------------- targets
def serve_yaml() -> dict[str, Any]:
    return yaml.safe_load(SERVE_YAML.read_text())


def app_args(target: str) -> dict[str, Any]:
    (app,) = serve_yaml()["applications"]
    args = dict(app["args"])
    if target.endswith("-grpc"):
        target = target.removesuffix("-grpc")
        args["router"] = {**args["router"], "engine_transport": "grpc"}
    if target in ("colocated", "mock-colocated"):
        args["prefill"] = {**args["prefill"], "num_replicas": 0}
        args["router"] = {**args["router"], "mode": "colocated"}
    for key, value in OVERRIDES.items():
        set_arg(args, key, value)
    if target.startswith("mock"):
        # Fast enough that the router, not the engine, is what is measured.
        args["backend"] = "mock"
        args["mock"] = {"decode_step_s": MOCK_DECODE_STEP_S, "prefill_s_per_token": MOCK_PREFILL_S_PER_TOKEN}
    args["router"] = {**args["router"], "operator_token": OPERATOR_TOKEN}
    return args


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=JSON`` options as {dotted key: value}."""
    overrides = {}
    for item in items:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    return overrides


def set_arg(args: dict[str, Any], dotted: str, value: Any) -> None:
    """Set one app arg; a dotted key (``decode.env.NAME``) changes only that field of the nested
    dicts, so overriding one setting of a group keeps the group's others (and the target's own,
    e.g. colocated's ``prefill.num_replicas: 0``)."""
    *parents, leaf = dotted.split(".")
    node = args
    for part in parents:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[leaf] = value


def vllm_server_command(port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server with the engine arguments and thread binding of pd-serve's colocated
    decode engine (minus pd-serve's own connector, scheduler and logits processor)."""
    from serve_app.config.backends import CPU, engine_specs
    from serve_app.config.settings import load_config
    from serve_app.vllm_plugins.processes import ENGINE_CHILD_ENV

    (spec,) = [s for s in engine_specs(load_config(app_args("colocated"))) if s.role == "decode"]
    kwargs = {k: v for k, v in spec.engine_kwargs.items() if k not in ("kv_transfer_config", "scheduler_cls")}
    processors = [p for p in kwargs.pop("logits_processors", None) or () if p != CPU.resume_logits_processor]
    if processors:
        kwargs["logits_processors"] = processors
    # The engine's own environment (thread binding, offline hub, the idle-spin bounds and the
    # engine core's placement on its worker's cores, which vLLM's server on a small shared host
    # gets as pd-serve's engines do), not the marker of pd-serve's engine children (the parent
    # watchdog, the quick exit).
    env = {k: v for k, v in spec.env.items() if k != ENGINE_CHILD_ENV}
    cmd = [str(VENV_BIN / "python"), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:  # vLLM's boolean arguments take --no-<name>
            cmd.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            cmd += [flag, *map(str, value)]
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd, {**base_env(), **env}


def serve_command(target: str, port: int, workdir: Path) -> list[str]:
    config = serve_yaml()
    config["http_options"] = {**config.get("http_options", {}), "port": port}
    (app,) = config["applications"]
    app["args"] = app_args(target)
    if app["args"].get("router", {}).get("http"):  # the router serves HTTP itself (configs/serve.yaml)
        app["args"]["router"] = {**app["args"]["router"], "http": {**app["args"]["router"]["http"], "port": port}}
    path = workdir / f"{target}.yaml"
    path.write_text(yaml.safe_dump(config))
    return [str(VENV_BIN / "serve"), "run", str(path)]


def pd_engines(port: int, operator_token: str, timeout_s: float = 30) -> dict[str, dict[str, Any]]:
    """The router's ``/pd/engines``, in full (the operator's view: the app must set ``router.operator_token``)."""
    response = requests.get(f"http://127.0.0.1:{port}/pd/engines", headers={"authorization": f"Bearer {operator_token}"}, timeout=timeout_s)
    response.raise_for_status()
    return response.json()["engines"]


def prompt_tokens_by_role(port: int) -> dict[str, int] | None:
    """The prompt tokens every engine of each role has been given so far (its own count); None
    where the router did not answer (the run's own figures still stand)."""
    counts = {"prefill": 0, "decode": 0}
    try:
        engines = pd_engines(port, OPERATOR_TOKEN)
    except (requests.RequestException, ValueError, KeyError) as exc:
        print(f"== /pd/engines did not answer ({exc!r}): no prefill share for this run", file=sys.stderr)
        return None
    for engine in engines.values():
        counts[engine["role"]] = counts.get(engine["role"], 0) + int(engine.get("prompt_tokens_total") or 0)
    return counts


def handed_off_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """Of the prompt tokens decode engines were given between two counts, the share a prefill
    engine computed: 1.0 where every prompt took the P/D hand-off; less where some were prefilled
    by their decode engine (``router.local_prefill_*``, or the router falling back to colocated
    with no healthy prefill engine, which would make a disaggregated figure a colocated one).
    None where decode engines were given none, or a count is missing."""
    if before is None or after is None:
        return None
    decode = after.get("decode", 0) - before.get("decode", 0)
    return None if decode <= 0 else (after.get("prefill", 0) - before.get("prefill", 0)) / decode


def short_outputs(result: dict[str, Any], output_len: int) -> int:
    """Requests vLLM's client counted as completed whose output is shorter than asked (every run
    here ignores EOS): its client counts a stream as a success once any chunk came, so a stream
    cut off midway would otherwise pass as a complete one."""
    return sum(1 for n in result.get("output_lens") or () if 0 < n < output_len)


# ---------------------------------------------------------------------------- the client
async def sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """Each JSON event of an OpenAI streaming response (an aiohttp response): the one reader of
    ``data:`` lines for every benchmark client here, so that they all skip the same things (other
    lines, ``[DONE]``) and count a stream's events alike."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload and payload != b"[DONE]":
            yield json.loads(payload)


def vllm_client(port: int, served_name: str, tokenizer: str, argv: list[str]) -> dict[str, Any]:
    """vLLM's own benchmark client (``vllm bench serve``) against the completions route on
    ``port``, with ``argv`` choosing the dataset and load; its report on stderr."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    target = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions"]
    args = parser.parse_args([*target, "--model", served_name, "--tokenizer", tokenizer, *argv])
    with contextlib.redirect_stdout(sys.stderr):
        return asyncio.run(main_async(args))


def bench(port: int, workload: Workload, tokenizer: str, served_name: str) -> dict[str, Any]:
    """One run of vLLM's client; of its per-request lists (``--save-detailed``) only the output
    lengths are kept (``short_outputs``), and its distinct errors."""
    result = vllm_client(
        port,
        served_name,
        tokenizer,
        [
            "--dataset-name", "random",
            "--random-input-len", str(workload.input_len),
            "--random-output-len", str(workload.output_len),
            "--num-prompts", str(workload.prompts),
            "--max-concurrency", str(workload.concurrency),
            "--ignore-eos",
            "--temperature", "0",
            "--num-warmups", "2",
            "--seed", str(workload.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-detailed",
        ],
    )  # fmt: skip
    for key in ("input_lens", "start_times", "ttfts", "itls", "generated_texts"):
        result.pop(key, None)
    result["errors"] = sorted({error for error in result.get("errors") or () if error})[:5]
    return result


def representative(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median output throughput (the lower middle one of an even count),
    with every repetition's throughput and failures beside it. Back-to-back runs of one workload
    on one started target differ by up to a tenth on a 2-core host; the median run is the one to
    compare, and a failed request in any repetition still counts."""
    ordered = sorted(runs, key=lambda run: run["result"].get("output_throughput") or 0.0)
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["result"] = {**chosen["result"], "failed": sum(int(run["result"].get("failed") or 0) for run in runs)}
    chosen["repetitions"] = [run["result"].get("output_throughput") for run in runs]
    shares = [run["handed_off"] for run in runs if run.get("handed_off") is not None]
    chosen["handed_off"] = min(shares) if shares else None  # the least of any repetition
    return chosen


def fallback_warnings(results: dict[str, dict[str, Any]], workloads: list[Workload]) -> list[str]:
    """Where a target that disaggregates had prompts prefilled by their decode engine instead
    (the router falls back to colocated while no prefill engine is healthy): its figures are then
    partly a colocated app's."""
    out = []
    for target, result in results.items():
        if "colocated" in target or target == "vllm":
            continue
        for w in workloads:
            share = (result.get(w.name) or {}).get("handed_off")
            if share is not None and share < HANDED_OFF_MIN:
                out.append(
                    f"WARNING: {target} {w.name}: a prefill engine computed only {share:.1%} of the prompt tokens in its least "
                    "run; the rest were prefilled by their decode engine (router.local_prefill_*, or no healthy prefill "
                    "engine): not a disaggregated figure"
                )
    return out


def merge_rounds(rounds: list[dict[str, dict[str, Any]]], workloads: list[Workload]) -> dict[str, dict[str, Any]]:
    """One result per target from its starts in every round (``run_target``'s): each workload's
    median run among all of them, the host speed around every start, and, for the mocks, the
    median router-added TTFT. ``paired`` keeps each round's median throughput and ``paired_ttft``
    that run's TTFT p50, so that a ratio can be taken between targets run minutes apart rather
    than between whole runs (the median runs of two targets may come from different rounds)."""
    merged: dict[str, dict[str, Any]] = {}
    for target in rounds[0]:
        starts = [r[target] for r in rounds]
        result: dict[str, Any] = {"host_speed": [speed for start in starts for speed in start["host_speed"]]}
        for w in workloads:
            result[w.name] = representative([run for start in starts for run in start[w.name]])
            chosen = [representative(start[w.name])["result"] for start in starts]
            result[w.name]["paired"] = [run.get("output_throughput") for run in chosen]
            result[w.name]["paired_ttft"] = [run.get("median_ttft_ms") for run in chosen]
        added = [start["router_added_ttft"] for start in starts if "router_added_ttft" in start]
        if added:
            result["router_added_ttft"] = {k: statistics.median(a[k] for a in added) for k in added[0]}
        merged[target] = result
    return merged


def paired_ratios(results: dict[str, dict[str, Any]], target: str, workload: str, key: str = "paired") -> list[float]:
    """Round by round, ``target``'s output throughput (``key="paired_ttft"``: TTFT p50) over
    vLLM's server's in the same round."""
    ours = results[target][workload].get(key) or []
    theirs = results["vllm"][workload].get(key) or []
    return [a / b for a, b in zip(ours, theirs) if a and b]


def host_speed() -> dict[str, float]:
    """The idle host's speed, timed before and after each target: the development host drifts
    (other machines share its physical cores), and a target measured in a slow spell reads worse
    than the others, so a table whose targets met different spells should say so. Two probes:
    a fixed pure-Python loop (ms), and a one-byte ping-pong between two processes on two
    different cores (µs per round trip), which is what a request's many hops between processes
    pay and what the slow spells seen here slowed most (the loop read 36-66 ms through a run in
    which vLLM's own server served c=1 at a quarter of its usual rate; the ping-pong read
    35-126 µs then, against 7.5 µs with both ends on one core)."""
    return {"loop_ms": loop_ms(), "wakeup_us": cross_core_round_trip_us()}


def loop_ms(loops: int = 1_000_000, samples: int = 3) -> float:
    times = []
    for _ in range(samples):
        begin = time.perf_counter()
        total = 0
        for i in range(loops):
            total += i * i
        times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times)


def cross_core_round_trip_us(rounds: int = 2000, samples: int = 5) -> float:
    """Median µs per round trip of one byte between this process and a child on another core
    (on one core where the host has only one)."""
    cores = sorted(os.sched_getaffinity(0))
    own = set(cores)
    times = []
    for _ in range(samples):
        ping_r, ping_w = os.pipe()
        pong_r, pong_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child only echoes, then leaves without running any cleanup
            try:
                os.close(ping_w)
                os.close(pong_r)
                os.sched_setaffinity(0, {cores[-1]})
                for _ in range(rounds):
                    os.read(ping_r, 1)
                    os.write(pong_w, b"x")
            finally:
                os._exit(0)
        os.close(ping_r)  # the child's ends: a child that ends early reads as EOF, not a hang
        os.close(pong_w)
        try:
            os.sched_setaffinity(0, {cores[0]})
            begin = time.perf_counter()
            for _ in range(rounds):
                os.write(ping_w, b"x")
                if not os.read(pong_r, 1):
                    raise RuntimeError("the echoing process ended early")
            times.append((time.perf_counter() - begin) / rounds * 1e6)
        finally:
            os.sched_setaffinity(0, own)
            os.close(ping_w)
            os.close(pong_r)
            os.waitpid(pid, 0)
    return statistics.median(times)


def run_target(target: str, workloads: list[Workload], workdir: Path, repo: Path, repeat: int = 1) -> dict[str, Any]:
    """One start of ``target``: the warm-up, then each workload ``repeat`` times in a row; every
    run kept (``merge_rounds`` picks the one to show)."""
    from serve_app.config.settings import load_config

    port = free_port()
    config = load_config(app_args("colocated"))
    tokenizer, served = config.model, config.model_name
    if target == "vllm":
        cmd, env = vllm_server_command(port)
        health = f"http://127.0.0.1:{port}/health"
    else:
        cmd, env = serve_command(target, port, workdir), base_env()
        health = f"http://127.0.0.1:{port}/health"
    results: dict[str, Any] = {"host_speed": [host_speed()]}
    print(f"== {target}: starting", file=sys.stderr)
    with started(cmd, env, workdir / f"{target}.log", health, repo):
        for workload in WARM_UP:  # not recorded: every target's first requests meet cold paths
            bench(port, workload, tokenizer, served)
        for workload in workloads:
            if target.startswith("mock"):
                workload = dataclasses.replace(workload, prompts=workload.prompts * MOCK_PROMPTS_FACTOR)
            runs = []
            for _ in range(repeat):
                prompts_before = prompt_tokens_by_role(port) if target != "vllm" else None
                before = cpu_snapshot()
                started_at = time.monotonic()
                result = bench(port, workload, tokenizer, served)
                wall = time.monotonic() - started_at
                run = {"result": result, "cpu": cpu_by_kind(before, cpu_snapshot()), "wall_s": wall}
                short = short_outputs(result, workload.output_len)
                if short:  # failed, not completed (vLLM's client took them for complete)
                    result["failed"] = int(result.get("failed") or 0) + short
                    result["short_outputs"] = short
                if prompts_before is not None:
                    run["handed_off"] = handed_off_share(prompts_before, prompt_tokens_by_role(port))
                runs.append(run)
                share = run.get("handed_off")
                print(
                    f"== {target} {workload.name}: {result.get('output_throughput', 0):.0f} tok/s, failed {result.get('failed')}"
                    + (f", prompt tokens prefilled by a prefill engine {share:.1%}" if share is not None else ""),
                    file=sys.stderr,
                )
            results[workload.name] = runs
        if target.startswith("mock"):
            results["router_added_ttft"] = router_added_ttft_in_child(port)
    results["host_speed"].append(host_speed())
    return results


def router_added_ttft_in_child(port: int) -> dict[str, float]:
    """In a process of its own: Serve's handles cache the cluster they first met, and every
    target runs on a cluster of its own."""
    done = subprocess.run(
        [sys.executable, __file__, "--router-added-ttft", str(port)], capture_output=True, text=True, timeout=300, env=base_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"router-added TTFT measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def router_added_ttft(port: int, samples: int = 100) -> dict[str, float]:
    """TTFT through the router's handle API minus TTFT of a direct streaming call to the same
    mock decode engine, colocated-style (no prefill), for the same prompt: the router's own share."""
    import ray
    from ray import serve

    from serve_app.wire.protocol import EngineRequest, TokenDelta
    from serve_app.wire.sampling import encode_sampling

    ray.init(address="auto", log_to_driver=False, namespace="serve")
    try:
        router = serve.get_app_handle("pd")
        decode = serve.get_deployment_handle("decode", "pd")  # its one replica
        prompt = list(range(20, 52))
        via_router, direct = [], []
        from vllm import SamplingParams

        params = encode_sampling(SamplingParams(max_tokens=4, temperature=0.0))
        for i in range(samples):
            t = time.perf_counter()
            stream = router.options(stream=True).generate.remote({"prompt": prompt, "max_tokens": 4, "temperature": 0})
            for event in stream:
                if event.get("choices"):
                    via_router.append(time.perf_counter() - t)
                    break
            stream.cancel()
            t = time.perf_counter()
            stream = decode.options(stream=True).generate.remote(EngineRequest(f"bench-direct-{i}", prompt, params, None))
            for item in stream:
                if isinstance(item, TokenDelta) and item.token_ids:
                    direct.append(time.perf_counter() - t)
                    break
            stream.cancel()
        via, dr = statistics.median(via_router[10:]), statistics.median(direct[10:])
        return {"router_ttft_p50_ms": via * 1000, "direct_ttft_p50_ms": dr * 1000, "router_added_ttft_p50_ms": (via - dr) * 1000}
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- the report
ROWS = [
    ("output tok/s", "output_throughput", 1.0),
    ("TTFT p50 (ms)", "median_ttft_ms", 1.0),
    ("TPOT p50 (ms)", "median_tpot_ms", 1.0),
    ("ITL p50 (ms)", "median_itl_ms", 1.0),
    ("failed", "failed", 1.0),
]
ALL_TARGETS = ("vllm", "colocated", "disaggregated", "colocated-grpc", "disaggregated-grpc", "mock", "mock-colocated")
CPU_KINDS = ["router", "http proxy", "engine replica", "api server", "engine core", "worker", "ray"]


def report(results: dict[str, dict[str, Any]], workloads: list[Workload]) -> str:
    lines = []
    targets = [t for t in ALL_TARGETS if t in results]
    head = f"{'workload':<7}{'metric':<15}" + "".join(f"{t:>22}" for t in targets)
    lines += [head, "-" * len(head)]
    for w in workloads:
        for label, key, _ in ROWS:
            cells = []
            base = results.get("vllm", {}).get(w.name, {}).get("result", {}).get(key)
            for t in targets:
                value = results[t].get(w.name, {}).get("result", {}).get(key)
                if value is None:
                    cells.append(f"{'-':>22}")
                elif t != "vllm" and base and key != "failed":
                    cells.append(f"{value:>13.1f} ({value / base:4.2f}x)")
                else:
                    cells.append(f"{value:>22.1f}")
            lines.append(f"{w.name:<7}{label:<15}" + "".join(cells))
        lines.append("")
    spread = [
        f"  {t:<15}{w.name:<8}" + " ".join(f"{v:.0f}" for v in results[t][w.name]["repetitions"])
        for t in targets
        for w in workloads
        if len(results[t].get(w.name, {}).get("repetitions", [])) > 1
    ]
    if spread:
        lines += ["Output tok/s of each repetition, in the order run (the table shows the median one):", *spread, ""]
    rounds = max((len(results[t][w.name].get("paired") or []) for t in targets for w in workloads if w.name in results[t]), default=0)
    if "vllm" in results and rounds > 1:
        for key, what in (("paired", "Output tok/s"), ("paired_ttft", "TTFT p50")):
            lines.append(
                f"{what} ratios to vLLM's server round by round (each target started once a round, {rounds} rounds; median first):"
            )
            for t in targets:
                for w in workloads:
                    ratios = paired_ratios(results, t, w.name, key) if t != "vllm" else []
                    if ratios:
                        each = " ".join(f"{r:.2f}x" for r in ratios)
                        lines.append(f"  {t:<15}{w.name:<8}{statistics.median(ratios):.2f}x   ({each})")
            lines.append("")
    lines.append("CPU seconds per process kind during the median run (router µs per output token in the last column)")
    head = f"{'target':<15}{'workload':<8}" + "".join(f"{k:>15}" for k in CPU_KINDS) + f"{'router µs/tok':>15}"
    lines += [head, "-" * len(head)]
    for t in targets:
        for w in workloads:
            run = results[t].get(w.name)
            if not run:
                continue
            cpu = run["cpu"]
            tokens = run["result"].get("total_output_tokens") or 0
            per_token = cpu.get("router", 0.0) / tokens * 1e6 if tokens and "router" in cpu else float("nan")
            lines.append(f"{t:<15}{w.name:<8}" + "".join(f"{cpu.get(k, 0.0):>15.2f}" for k in CPU_KINDS) + f"{per_token:>15.0f}")
    probed = [t for t in targets if results[t].get("host_speed")]

    def host_line(key: str) -> str:
        return ", ".join(f"{t} {' / '.join(f'{v[key]:.0f}' for v in results[t]['host_speed'])}" for t in probed)

    if probed:
        lines += [
            "",
            "The idle host before / after each target (targets that met different spells are not comparable):",
            "  cross-core wake-up round trip, µs: " + host_line("wakeup_us"),
            "  fixed Python loop, ms: " + host_line("loop_ms"),
        ]
    for t, what in (("mock-colocated", "the router alone"), ("mock", "the router and the decode-first handoff")):
        mock = results.get(t, {}).get("router_added_ttft")
        if mock:
            lines.append("")
            lines.append(
                f"{t}: TTFT via the router's handle {mock['router_ttft_p50_ms']:.2f} ms, direct to the decode engine "
                f"{mock['direct_ttft_p50_ms']:.2f} ms: {what} adds {mock['router_added_ttft_p50_ms']:.2f} ms (p50)"
            )
    shares = [(t, w.name, results[t].get(w.name, {}).get("handed_off")) for t in targets for w in workloads]
    shares = [(t, w, share) for t, w, share in shares if share is not None]
    if shares:
        lines += ["", "Prompt tokens a prefill engine computed (the least of any run; the rest, their decode engine's):"]
        lines += [f"  {t:<20}{w:<8}{share:.1%}" for t, w, share in shares]
    warnings = fallback_warnings(results, workloads)
    if warnings:
        lines += ["", *warnings]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(ALL_TARGETS))
    parser.add_argument("--quick", action="store_true", help="fewer prompts per workload (a smoke run)")
    parser.add_argument("--out", type=Path, help="write every number as JSON here too")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each workload in a row on each start of a target (default 1); the table shows the median run of all rounds",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override an app arg for pd-serve targets (e.g. stream_items_per_s=200, decode.env.NAME='\"0\"')",
    )
    parser.add_argument(
        "--repo",
        type=Path,
        default=REPO_ROOT,
        help="the pd-serve checkout whose app is served (default: this one; e.g. a worktree of an older commit)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="start every target once per round, round after round, so that a slow spell of the host is less "
        "likely to fall on one target only (default 3; ratios are also shown round by round)",
    )
    parser.add_argument("--router-added-ttft", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.router_added_ttft:  # the child of router_added_ttft_in_child
        with contextlib.redirect_stdout(sys.stderr):
            measured = router_added_ttft(args.router_added_ttft)
        print(json.dumps(measured))
        return 0
    workloads = QUICK if args.quick else WORKLOADS
    OVERRIDES.update({**RUN_DEFAULTS, **parse_sets(args.set)})
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="pdbench-") as tmp:
        workdir = Path(tmp)
        try:
            for number in range(1, args.rounds + 1):
                print(f"== round {number} of {args.rounds}", file=sys.stderr)
                rounds.append({})
                for target in args.targets.split(","):
                    rounds[-1][target] = run_target(target, workloads, workdir, args.repo.resolve(), args.repeat)
        except Exception as exc:  # a target that did not start: keep what the others measured
            print(f"== stopped: {exc!r}", file=sys.stderr)
            if args.out:
                args.out.write_text(json.dumps({"rounds": rounds, "error": repr(exc)}, indent=2, default=str))
            return 2
        results = merge_rounds(rounds, workloads)
        table = report(results, workloads)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "table": table}, indent=2, default=str))
    failed = sum(
        int(run["result"].get("failed") or 0) for r in results.values() for k, run in r.items() if isinstance(run, dict) and "result" in run
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
