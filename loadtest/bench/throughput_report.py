"""``loadtest.bench.throughput``'s figures: one run's summary (tokens per second, time to first token,
time per output token, latency), the medians over rounds, and the tables it prints (each server's
column with its ratio to the first; per round, ours over the peer's).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.bench.throughput import Result


def say(msg: str) -> None:
    """A line of the benchmark's output, at once (a person waits on it)."""
    print(msg, flush=True)


def summarize(results: list[Result], elapsed: float) -> dict[str, float]:
    ttfts = sorted(r.ttft_s for r in results)
    tpots = [(r.latency_s - r.ttft_s) / (r.num_output_tokens - 1) for r in results if r.num_output_tokens > 1]
    return {
        "output tokens/s": sum(r.num_output_tokens for r in results) / elapsed,
        "mean TTFT (s)": statistics.mean(ttfts),
        "median TTFT (s)": statistics.median(ttfts),
        "median TPOT (ms)": 1000 * statistics.median(tpots) if tpots else float("nan"),
        "mean latency (s)": statistics.mean(r.latency_s for r in results),
        "elapsed (s)": elapsed,
    }


def print_table(rows: list[tuple[str, dict[str, float]]]) -> None:
    """One column per server, and each other column's ratio to the first."""
    say("")
    say(f"{'':24}" + "".join(f"{name:>22}" for name, _ in rows)
        + "".join(f"{'ratio ' + str(i + 2) + '/1':>12}" for i in range(len(rows) - 1)))
    first = rows[0][1]
    for key in first:
        line = f"{key:24}" + "".join(f"{s[key]:>22.3f}" for _, s in rows)
        line += "".join(f"{(s[key] / first[key] if first[key] else float('nan')):>12.2f}" for _, s in rows[1:])
        say(line)
    for name, s in rows[1:]:
        say(f"throughput pagedserve / {name}: {first['output tokens/s'] / s['output tokens/s']:.2f}x;  "
            f"median TTFT pagedserve / {name}: {first['median TTFT (s)'] / s['median TTFT (s)']:.2f}x")


def median_summary(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over rounds (a summary itself with one round)."""
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


def print_round_ratios(rounds: list[dict[str, dict[str, float]]], ours: str, peer: str) -> None:
    """Per round, ours over the peer's throughput and TTFT p50, and their medians."""
    tput = [r[ours]["output tokens/s"] / r[peer]["output tokens/s"] for r in rounds]
    ttft = [r[ours]["median TTFT (s)"] / r[peer]["median TTFT (s)"] for r in rounds]
    say(f"per round, throughput {ours} / {peer}: " + " ".join(f"{x:.2f}x" for x in tput)
        + f" (median {statistics.median(tput):.2f}x)")
    say(f"per round, median TTFT {ours} / {peer}: " + " ".join(f"{x:.2f}x" for x in ttft)
        + f" (median {statistics.median(ttft):.2f}x)")
