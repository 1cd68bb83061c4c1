"""Time to first token of requests that arrive one at a time at a busy server.

    python -m loadtest.bench.arrivals [--background 32] [--arrivals 30] [--gap-ms 150] [--rounds 2]
        [--variants "--plan-ahead-at 0.75" "--plan-ahead-at 0"] [--server-flags "..."]

``loadtest.bench.throughput`` sends a burst; a served model more often sees requests arrive while others
decode, and what such a request waits for is the step in flight and whatever was planned before
it came. Here ``--background`` streamed completions decode (64-token prompts, ``ignore_eos``, long
outputs); once all of them stream, ``--arrivals`` requests (32-token prompts, one output token, so
their latency is their TTFT) arrive one after another, ``--gap-ms`` apart on average (uniform in
0.5-1.5 times it, the same gaps for a seed), each sent when the one before is answered and its gap
has passed. It prints their TTFT (median, mean, p90) and the background's output tokens/s while
they arrived, so that a change that admits arrivals sooner shows whether decoding paid for it.

Each ``--variants`` entry is a set of extra server flags; one ``pagedserve serve`` (SmolLM2 unless
``--server-flags`` says otherwise) runs per variant, all kept up, and every round measures each
variant once, in alternating order, once the machine is quiet (``machine_state.wait_for_quiet``),
then prints the medians over rounds and each variant's ratio to the first. Traffic goes to
127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass

from loadtest.common.machine_state import wait_for_quiet
from loadtest.common.stream_timing import StreamTimes
from loadtest.bench.servers import _get_json, start_server
from loadtest.bench.throughput import completion_chunks
from loadtest.common.machine_state import print_cpu

BACKGROUND_PROMPT, ARRIVAL_PROMPT, BACKGROUND_TOKENS = 64, 32, 1500


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def arrival_gaps(num: int, mean_gap_s: float, seed: int) -> list[float]:
    """Seconds before each arrival: uniform in [0.5, 1.5] x the mean, the same for a seed."""
    rng = random.Random(seed)
    return [mean_gap_s * rng.uniform(0.5, 1.5) for _ in range(num)]


def run_order(num_variants: int, rounds: int) -> list[list[int]]:
    """Variant indices per round: forwards in even rounds, backwards in odd ones."""
    order = list(range(num_variants))
    return [order if r % 2 == 0 else order[::-1] for r in range(rounds)]


@dataclass
class Run:
    ttfts_s: list[float]
    background_tok_s: float  # the background's output tokens/s while the arrivals came

    def summary(self) -> dict[str, float]:
        ttfts = sorted(self.ttfts_s)
        return {"TTFT median (ms)": 1000 * statistics.median(ttfts),
                "TTFT mean (ms)": 1000 * statistics.fmean(ttfts),
                "TTFT p90 (ms)": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                "background tok/s": self.background_tok_s}


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(length)]


async def _stream(session, url: str, body: dict, times: StreamTimes) -> StreamTimes:
    """POST a streamed completion, noting each text chunk's arrival in ``times``."""
    async for chunk in completion_chunks(session, url, body):
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error']}")
        if any(c.get("text") for c in chunk.get("choices") or ()):
            times.token_times_s.append(time.perf_counter())
    times.end_s = time.perf_counter()
    return times


async def measure(url: str, model: str, num_background: int, gaps_s: list[float], seed: int) -> Run:
    """One run: the background streams, then the arrivals, one at a time."""
    import aiohttp

    rng = random.Random(seed)
    base = {"model": model, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        background = [StreamTimes(time.perf_counter()) for _ in range(num_background)]
        tasks = [asyncio.create_task(_stream(session, url, {**base, "prompt": _prompt(rng, BACKGROUND_PROMPT),
                                                            "max_tokens": BACKGROUND_TOKENS, "ignore_eos": True}, t))
                 for t in background]
        try:
            while not all(t.token_times_s for t in background):  # every background stream decodes
                if any(task.done() for task in tasks):
                    for task in tasks:
                        if task.done():
                            task.result()  # its error
                    raise RuntimeError("a background stream ended before the arrivals")
                await asyncio.sleep(0.05)
            window_start = time.perf_counter()
            ttfts = []
            for gap in gaps_s:
                await asyncio.sleep(gap)
                arrival = await _stream(session, url, {**base, "prompt": _prompt(rng, ARRIVAL_PROMPT), "max_tokens": 1},
                                        StreamTimes(time.perf_counter()))
                if arrival.ttft_s is None:
                    raise RuntimeError("an arrival streamed no token")
                ttfts.append(arrival.ttft_s)
            window_end = time.perf_counter()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    tokens = sum(window_start <= t <= window_end for s in background for t in s.token_times_s)
    return Run(ttfts, tokens / (window_end - window_start))


def print_results(variants: list[str], runs: list[list[Run]]) -> None:
    """Each run, then the medians over rounds and the ratios to the first variant."""
    names = [v or "(no extra flags)" for v in variants]
    for r, per_variant in enumerate(zip(*runs)):
        print(f"round {r + 1}: " + "; ".join(
            f"{name}: TTFT median {run.summary()['TTFT median (ms)']:.0f} ms, background "
            f"{run.background_tok_s:.0f} tok/s" for name, run in zip(names, per_variant)))
    medians = [{k: statistics.median(run.summary()[k] for run in variant_runs) for k in variant_runs[0].summary()}
               for variant_runs in runs]
    width = max(24, *(len(n) + 2 for n in names))
    print(f"\nmedians of {len(runs[0])} round(s)\n")
    print(f"{'':22}" + "".join(f"{n:>{width}}" for n in names))
    for key in medians[0]:
        row = "".join(f"{m[key]:>{width}.1f}" for m in medians)
        ratios = "  ".join(f"{m[key] / medians[0][key]:.2f}x" for m in medians[1:] if medians[0][key])
        print(f"{key:22}{row}   {ratios}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--background", type=int, default=32, help="requests decoding meanwhile (default 32)")
    ap.add_argument("--arrivals", type=int, default=30, help="requests that arrive one at a time (default 30)")
    ap.add_argument("--gap-ms", type=float, default=150.0, help="mean gap between arrivals (default 150)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=["--plan-ahead-at 0.75", "--plan-ahead-at 0"],
                    help="server flags per variant (default: the step planned late, and at once)")
    ap.add_argument("--server-flags", default="", help="flags for every server")
    args = ap.parse_args()
    print_cpu()
    if args.background < 1 or args.arrivals < 1 or args.rounds < 1 or not args.gap_ms > 0:
        ap.error("--background, --arrivals and --rounds must be at least 1, --gap-ms positive")
    servers = []
    try:
        for i, variant in enumerate(args.variants):
            say(f"starting server {i + 1}/{len(args.variants)}: {variant or '(no extra flags)'}")
            flags = ["--max-num-seqs", str(max(64, args.background + 1)), *args.server_flags.split(), *variant.split()]
            servers.append(start_server(flags, f"/tmp/pagedserve-arrivals-{i}.log"))
        model = _get_json(f"{servers[0][1]}/v1/models")["data"][0]["id"]
        runs: list[list[Run]] = [[] for _ in args.variants]
        for r, order in enumerate(run_order(len(args.variants), args.rounds)):
            gaps = arrival_gaps(args.arrivals, args.gap_ms / 1000, args.seed + r)
            for i in order:
                wait_for_quiet()
                say(f"round {r + 1}/{args.rounds}, {args.variants[i] or '(no extra flags)'}: "
                    f"{args.background} decoding, {args.arrivals} arriving")
                runs[i].append(asyncio.run(measure(servers[i][1], model, args.background, gaps, args.seed + r)))
        print_results(args.variants, runs)
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers:
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
