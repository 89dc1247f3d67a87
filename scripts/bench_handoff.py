"""Where a disaggregated request's time to first token goes, hop by hop.

Usage: ``.venv/bin/python scripts/bench_handoff.py [--medium] [--requests N] [--concurrency C]
[--prompt-len P] [--max-tokens M] [--set KEY=JSON]`` (after ``make run`` or ``make test`` set up
the venv and the tiny model; stop ``make run`` first: the app is started here, at ``log_level:
DEBUG``, on a free port, and stopped after).

It starts the disaggregated app (configs/serve.yaml; with ``--medium``, bench_goodput.py's 1P1D
app on the medium model), sends N streamed completions (32-token prompts, 16 tokens out; 2,048
with ``--medium``), one at a time with a pause between them or, with ``--concurrency C``, from C
clients that each send their next request as the last one ends (as vLLM's benchmark client does
at that concurrency: bench_serving.py's c=8 is ``--concurrency 8 --prompt-len 256 --max-tokens
64``), and splits each one's TTFT, as the client saw it, with the two DEBUG lines the
engines log per push: the prefill engine's push timeline (when its call arrived and each layer
left; ``engines/records.push_timeline``) and the decode engine's receive timeline (when its
receive was armed, the transfer settled and the first token reached its replica;
``receive_timeline``). Both give wall-clock times on the same host, so the segments are:

1. the client's send to the decode engine's receive being armed (the router, the decode call,
   the engine's admission and block allocation);
2. to the prefill call's arrival (the KV parameters' way to the router through the metaserver
   relay and the decode stream, the router's choice, the prefill call);
3. to the last layer's push (the prefill engine's admission and forward up to its last layer);
4. to the transfer settling on the decode engine (the last frame and the done frame written);
5. to the first token in the decode replica (the decode engine's next steps and its output);
6. to the client (the decode replica, the router, the stream): its first chunk with a choice,
   whether or not the token's text is complete yet, as vLLM's benchmark client times TTFT.

It prints each segment's median and spread. The lines are read from Ray's log folder of the
session it started (``/tmp/ray/session_latest/logs/serve``). Timings describe this host only, and
DEBUG logging slows every hop a little.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
import bench_serving  # noqa: E402
from bench_goodput import percentile  # noqa: E402
from bench_serving import REPO_ROOT, base_env, parse_sets, started  # noqa: E402

from serve_app.runtime.ports import free_port  # noqa: E402

SERVE_LOGS = "/tmp/ray/session_latest/logs/serve/replica_*.log"
SEGMENTS = (
    "client send -> decode receive armed",
    "armed -> prefill call arrives",
    "arrival -> last layer pushed",
    "last layer -> transfer settled",
    "settled -> first token in decode replica",
    "decode replica -> client",
)
WALL = r"\(at ([\d.]+), wall clock\)"


@dataclass(frozen=True)
class Sent:
    request_id: str  # the router's response id; its first attempt is ``<id>-1``
    sent_at: float  # wall clock
    first_token_at: float | None


def split_ttft(sent: Sent, log_text: str) -> dict[str, float] | None:
    """The request's TTFT split into ``SEGMENTS`` (ms), from its first attempt's two DEBUG lines;
    None when either is missing (a retried attempt, a lost line) or no token came."""
    attempt = re.escape(f"{sent.request_id}-1")
    push = re.search(rf"transfer {attempt}: .*?layers sent at \[([^\]]*)\] ms.*?{WALL}", log_text)
    receive = re.search(rf"transfer {attempt}: .*?settled \+([\d.]+) ms, first token in the replica \+([\d.]+) ms.*?{WALL}", log_text)
    if push is None or receive is None or sent.first_token_at is None or not push.group(1).split():
        return None
    arrival = float(push.group(2))
    last_layer = arrival + float(push.group(1).split()[-1].lstrip("+")) / 1000
    armed = float(receive.group(3))
    settled = armed + float(receive.group(1)) / 1000
    token = armed + float(receive.group(2)) / 1000
    points = (sent.sent_at, armed, arrival, last_layer, settled, token, sent.first_token_at)
    split = {name: (b - a) * 1000 for name, a, b in zip(SEGMENTS, points, points[1:])}
    split["TTFT"] = (sent.first_token_at - sent.sent_at) * 1000
    return split


def summary(splits: list[dict[str, float]]) -> str:
    lines = []
    for name in (*SEGMENTS, "TTFT"):
        values = [s[name] for s in splits]
        p10, p90 = percentile(values, 10), percentile(values, 90)
        lines.append(f"{name:42s} median {statistics.median(values):7.1f} ms   (p10 {p10:.1f}, p90 {p90:.1f})")
    return "\n".join(lines)


async def send_all(
    url: str, model: str, prompt_len: int, count: int, gap_s: float, concurrency: int = 1, max_tokens: int = 16
) -> list[Sent]:
    """``count`` streamed completions to ``url``/v1/completions after three that warm the cold
    paths up; one at a time, ``gap_s`` apart, or from ``concurrency`` clients back to back."""
    import aiohttp

    rng = random.Random(5)

    async def one(session: aiohttp.ClientSession) -> Sent:
        prompt = [rng.randrange(10, 1000) for _ in range(prompt_len)]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        sent_at, first, rid = time.time(), None, ""
        async with session.post(f"{url}/v1/completions", json=body) as response:
            async for event in bench_serving.sse_events(response):
                rid = rid or event.get("id", "")
                if first is None and event.get("choices"):
                    first = time.time()
        return Sent(rid, sent_at, first)

    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # cold paths: not recorded
            await one(session)
        sent: list[Sent] = []

        async def client(requests: int) -> None:
            for _ in range(requests):
                sent.append(await one(session))
                if concurrency == 1:
                    await asyncio.sleep(gap_s)  # the engines idle between requests, as at c=1

        await asyncio.gather(*(client(count // concurrency + (i < count % concurrency)) for i in range(concurrency)))
        return sent


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--medium", action="store_true", help="bench_goodput's 1P1D app on the medium model, 2,048-token prompts")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=1, help="clients sending back to back (default 1: one at a time)")
    parser.add_argument("--prompt-len", type=int, default=0, help="prompt tokens (default 32; 2,048 with --medium)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override an app arg (dotted keys nest)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be at least 1")
    overrides = parse_sets(args.set)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdhandoff-") as tmp:
        workdir = Path(tmp)
        if args.medium:
            import bench_goodput

            bench_goodput.ensure_model()
            bench_goodput.OVERRIDES.update({**overrides, "log_level": "DEBUG"})
            cmd, env = bench_goodput.command("disaggregated", port, workdir, bench_goodput.DEFAULT_CHUNK)
            model, prompt_len, gap_s = bench_goodput.SERVED_NAME, bench_goodput.LONG_IN, 0.5
        else:
            bench_serving.OVERRIDES.update({**overrides, "log_level": "DEBUG"})
            cmd, env = bench_serving.serve_command("disaggregated", port, workdir), base_env()
            model, prompt_len, gap_s = bench_serving.app_args("disaggregated")["served_model_name"], 32, 0.05
        with started(cmd, env, workdir / "serve.log", f"http://127.0.0.1:{port}/health", REPO_ROOT):
            prompt_len = args.prompt_len or prompt_len
            url = f"http://127.0.0.1:{port}"
            sent = asyncio.run(send_all(url, model, prompt_len, args.requests, gap_s, args.concurrency, args.max_tokens))
            time.sleep(6)  # the receive records ride with the engine's stats, a few times a second
            log_text = "\n".join(Path(f).read_text(errors="replace") for f in glob.glob(SERVE_LOGS))
    splits = [s for s in (split_ttft(one, log_text) for one in sent) if s is not None]
    if not splits:
        print("no request had both DEBUG lines: was the log level applied?", file=sys.stderr)
        return 1
    pace = "one at a time" if args.concurrency == 1 else f"{args.concurrency} clients back to back"
    print(f"{len(splits)} of {len(sent)} requests, {prompt_len}-token prompts, {args.max_tokens} tokens out, {pace}:")
    print(summary(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
