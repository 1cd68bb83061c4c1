"""The rate sweep's numbers: one summary per (policy, rate), the rate each policy sustains under a
latency bound, the CSV files and the printed table. Plain functions, no I/O but the CSV files.

Normalized latency is the paper's (Kwon et al., 2023, §6): the mean over requests of end-to-end
latency divided by output length, in s/token. Throughput comes two ways: over the whole run (first
arrival to last token, the usual benchmark figure, which a single long request finishing alone
can stretch), and over the span in which requests arrive (tokens that came in that span / its
length: what the server kept up with while offered that rate; at overload, its capacity). A run with a failed or unfinished request counts as
above any bound (its latency is infinite): a policy does not "sustain" a rate it cannot serve.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from loadtest.sweep.load import HealthSample, RequestRecord


@dataclass
class RateSummary:
    policy: str
    rate_req_s: float
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float  # first arrival to last token
    normalized_latency_s_per_token: float  # inf when a request failed
    mean_latency_s: float
    throughput_req_s: float
    throughput_output_tokens_s: float  # all output tokens / duration_s
    arriving_output_tokens_s: float  # output tokens that came while requests arrived / that span
    queued_output_tokens_s: float  # output tokens that came while requests waited / that time (NaN: too little)
    ttft_p50_s: float
    ttft_p90_s: float
    mean_running: float  # from the /health samples while requests were in flight
    max_running: int
    mean_kv_slot_utilization: float  # slots holding tokens / slots in the running sequences' blocks
    mean_kv_block_usage: float  # blocks in use / blocks in the pool
    num_preemptions: int
    max_send_lag_s: float  # latest a request was sent after its Poisson arrival time (the client's own delay)
    load_avg_1m: float  # the machine's 1-minute load average as the run ended (its own server included)


def summarize(policy: str, rate_req_s: float, records: list[RequestRecord],
              samples: list[HealthSample], load_avg_1m: float = math.nan) -> RateSummary:
    """One row from a run's request records and ``/health`` samples."""
    done = [r for r in records if r.ok]
    end_s = max((r.done_s for r in done), default=0.0)
    duration_s = end_s - min((r.arrival_s for r in records), default=0.0)
    arriving_s = max((r.arrival_s for r in records), default=0.0)
    normalized = float(np.mean([r.e2e_s / r.num_output_tokens for r in done])) if done else math.inf
    ttfts = [r.ttft_s for r in done]
    busy = [s for s in samples if s.num_running]  # the server held work
    utils = [s.num_slots_used / s.num_slots_allocated for s in busy if s.num_slots_allocated]
    usage = [s.num_blocks_used / s.num_blocks_total for s in busy if s.num_blocks_total and s.num_blocks_used is not None]
    preemptions = [s.num_preemptions for s in samples if s.num_preemptions is not None]
    return RateSummary(
        policy=policy, rate_req_s=rate_req_s, num_requests=len(records), num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration_s,
        normalized_latency_s_per_token=normalized if len(done) == len(records) else math.inf,
        mean_latency_s=float(np.mean([r.e2e_s for r in done])) if done else math.nan,
        throughput_req_s=len(done) / duration_s if duration_s > 0 else math.nan,
        throughput_output_tokens_s=sum(r.num_output_tokens for r in done) / duration_s if duration_s > 0 else math.nan,
        arriving_output_tokens_s=(sum(t <= arriving_s for r in records for t in r.token_times_s) / arriving_s
                                  if arriving_s > 0 else math.nan),
        queued_output_tokens_s=queued_output_tokens_s(records, samples),
        ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts else math.nan,
        ttft_p90_s=float(np.percentile(ttfts, 90)) if ttfts else math.nan,
        mean_running=float(np.mean([s.num_running for s in busy])) if busy else 0.0,
        max_running=max((s.num_running for s in busy), default=0),
        mean_kv_slot_utilization=float(np.mean(utils)) if utils else math.nan,
        mean_kv_block_usage=float(np.mean(usage)) if usage else math.nan,
        num_preemptions=preemptions[-1] - preemptions[0] if preemptions else 0,
        max_send_lag_s=max((r.sent_s - r.arrival_s for r in records if r.sent_s is not None), default=math.nan),
        load_avg_1m=load_avg_1m,
    )


MIN_QUEUED_S = 2.0  # less time with requests waiting says nothing about a full pool's rate


def queued_output_tokens_s(records: list[RequestRecord], samples: list[HealthSample]) -> float:
    """Output tokens per second over the time requests waited (from each ``/health`` sample that saw
    one waiting to the next sample): what the server delivers once it cannot admit more, its KV pool
    full (or the step's token budget). NaN with less than ``MIN_QUEUED_S`` of waiting."""
    spans = [(a.t_s, b.t_s) for a, b in zip(samples, samples[1:]) if a.num_waiting]
    waited_s = sum(end - start for start, end in spans)
    if waited_s < MIN_QUEUED_S:
        return math.nan
    times = sorted(t for r in records for t in r.token_times_s)
    return sum(bisect.bisect_left(times, end) - bisect.bisect_left(times, start) for start, end in spans) / waited_s


@dataclass(frozen=True)
class Sustained:
    """The highest swept rate whose normalized latency, and every lower rate's, is within the bound
    (None: not even the lowest), and where the latency curve crosses the bound, interpolated
    linearly between that rate and the next (None when no higher rate crossed it: then the policy
    sustains at least ``rate_req_s``, and ``beyond_sweep`` is True)."""

    rate_req_s: float | None
    crossing_req_s: float | None
    beyond_sweep: bool

    @property
    def best_estimate(self) -> float | None:
        return self.crossing_req_s if self.crossing_req_s is not None else self.rate_req_s


def sustained_rate(points: list[tuple[float, float]], bound_s_per_token: float) -> Sustained:
    """``points``: (rate, normalized latency) pairs in any order."""
    under: tuple[float, float] | None = None
    for rate, latency in sorted(points):
        if latency > bound_s_per_token:
            if under is None:
                return Sustained(None, None, False)
            if math.isinf(latency):
                return Sustained(under[0], under[0], False)
            r0, y0 = under
            return Sustained(r0, r0 + (bound_s_per_token - y0) * (rate - r0) / (latency - y0), False)
        under = (rate, latency)
    return Sustained(under[0] if under else None, None, under is not None)


def latency_bound(summaries: list[RateSummary], reference_policy: str, factor: float) -> float:
    """``factor`` times the reference policy's normalized latency at its lowest swept rate."""
    rows = [s for s in summaries if s.policy == reference_policy and math.isfinite(s.normalized_latency_s_per_token)]
    if not rows:
        raise SystemExit(f"no run of {reference_policy} finished every request, so there is no latency bound to "
                         f"derive: give --latency-bound")
    return factor * min(rows, key=lambda s: s.rate_req_s).normalized_latency_s_per_token


# ---------------------------------------------------------------- CSV


def write_summaries(path: str, summaries: list[RateSummary]) -> None:
    names = [f.name for f in dataclasses.fields(RateSummary)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for s in summaries:
            writer.writerow(dataclasses.asdict(s))


def read_summaries(path: str) -> list[RateSummary]:
    """The rows ``write_summaries`` wrote; a float column that an older sweep did not write reads as NaN."""
    kinds = {f.name: f.type for f in dataclasses.fields(RateSummary)}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row.update({k: "nan" for k, kind in kinds.items() if kind == "float" and k not in row})
    return [RateSummary(**{k: (v if kinds[k] == "str" else int(v) if kinds[k] == "int" else float(v))
                           for k, v in row.items() if k in kinds}) for row in rows]


TIMELINE_FIELDS = ["policy", "rate_req_s", *[f.name for f in dataclasses.fields(HealthSample)]]


def write_timeline(path: str, rows: list[tuple[str, float, HealthSample]]) -> None:
    """One row per ``/health`` sample: (policy, rate, sample)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(TIMELINE_FIELDS)
        for policy, rate, sample in rows:
            writer.writerow([policy, rate, *("" if v is None else v for v in dataclasses.astuple(sample))])


def read_timeline(path: str) -> list[tuple[str, float, HealthSample]]:
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = [None if row[n] == "" else (float(row[n]) if n == "t_s" else int(row[n]))
                      for n in TIMELINE_FIELDS[2:]]
            rows.append((row["policy"], float(row["rate_req_s"]), HealthSample(*values)))
    return rows


# ---------------------------------------------------------------- printed table


def format_table(summaries: list[RateSummary], bound_s_per_token: float) -> str:
    head = (f"{'policy':26}{'rate':>7}{'done':>9}{'norm. lat.':>11}{'req/s':>7}{'tok/s':>9}{'tok/s':>8}"
            f"{'TTFT p50':>9}{'p90':>8}{'running':>8}{'KV util':>8}{'preempt':>8}")
    units = (f"{'':26}{'req/s':>7}{'':>9}{'s/token':>11}{'':>7}{'arriving':>9}{'queued':>8}{'s':>9}{'s':>8}"
             f"{'mean':>8}{'mean':>8}{'':>8}")
    lines = [head, units]
    for s in summaries:
        flag = "*" if s.normalized_latency_s_per_token > bound_s_per_token else " "
        lines.append(
            f"{s.policy:26}{s.rate_req_s:>7.3g}{f'{s.num_completed}/{s.num_requests}':>9}"
            f"{s.normalized_latency_s_per_token:>10.3f}{flag}{s.throughput_req_s:>7.2f}"
            f"{s.arriving_output_tokens_s:>9.1f}{s.queued_output_tokens_s:>8.1f}{s.ttft_p50_s:>9.2f}{s.ttft_p90_s:>8.2f}{s.mean_running:>8.1f}"
            f"{s.mean_kv_slot_utilization:>8.0%}{s.num_preemptions:>8}")
    lines.append(f"* above the latency bound of {bound_s_per_token:.3f} s/token; tok/s arriving: output tokens/s "
                 f"while requests arrived; queued: while requests waited")
    return "\n".join(lines)


def format_full_pool(summaries: list[RateSummary], labels: dict[str, str],
                     expected: dict[str, tuple[float, float]]) -> str:
    """Each policy's output tokens/s while requests waited at its highest swept rate (its KV pool
    full), and the first policy's ratio to each other's: the capacity ratio the model predicts."""
    names = list(dict.fromkeys(s.policy for s in summaries))
    top = {n: max((s for s in summaries if s.policy == n), key=lambda s: s.rate_req_s) for n in names}
    lines = ["output tokens/s while requests waited (the KV pool full), at each policy's highest swept rate:"]
    for n in names:
        rate = top[n].queued_output_tokens_s
        held = f"{rate:6.1f} tok/s" if not math.isnan(rate) else f"(requests waited under {MIN_QUEUED_S:g} s)"
        lines.append(f"  {n:26}{held} at {top[n].rate_req_s:g} req/s")
    first = top[names[0]].queued_output_tokens_s
    for other in names[1:]:
        ratio = first / top[other].queued_output_tokens_s
        if math.isnan(ratio):
            continue
        model = "; KV memory alone predicts {0:.2f}x".format(expected[other][0]) if other in expected else ""
        lines.append(f"{names[0]} / {labels.get(other, other)}: {ratio:.2f}x{model}")
    return "\n".join(lines)


def format_sustained(sustained: dict[str, Sustained], bound_s_per_token: float, labels: dict[str, str] | None = None,
                     expected: dict[str, tuple[float, float]] | None = None) -> str:
    """Each policy's sustained rate, and the first policy's ratio to every other's, each named by
    its label (which Orca reservation it is) and, where ``expected`` has it, beside the capacity
    model's ratio (replayed, perfect packing; ``loadtest/sweep/capacity.py``)."""
    labels, expected = labels or {}, expected or {}
    lines = [f"highest rate sustained at normalized latency <= {bound_s_per_token:.3f} s/token "
             f"(swept rate; crossing of the bound, interpolated):"]
    for policy, s in sustained.items():
        swept = "none of the rates" if s.rate_req_s is None else f"{s.rate_req_s:.3g} req/s"
        if s.beyond_sweep:
            swept = f"at least {swept} (never crossed the bound)"
        cross = f"; crosses at {s.crossing_req_s:.3g} req/s" if s.crossing_req_s is not None else ""
        lines.append(f"  {policy:26}{swept}{cross}")
    names = list(sustained)
    for other in names[1:]:
        model = ""
        if other in expected:
            model = "; KV memory alone predicts {0:.2f}x (perfect packing: {1:.2f}x)".format(*expected[other])
        lines.append(f"{names[0]} / {labels.get(other, other)}: {_ratio(sustained[names[0]], sustained[other])}{model}")
    return "\n".join(lines)


def _ratio(first: Sustained, other: Sustained) -> str:
    """``first``'s sustained rate over ``other``'s, saying which way it is bounded when a policy
    never crossed the bound within the sweep."""
    a, b = first.best_estimate, other.best_estimate
    if a is None or b is None:
        return "no ratio (a policy sustained none of the swept rates)"
    if first.beyond_sweep and other.beyond_sweep:
        return "no ratio (both sustained every swept rate: sweep higher rates)"
    if first.beyond_sweep:
        return f"at least {a / b:.2f}x ({a:.3g} / {b:.3g} req/s; the first never crossed the bound)"
    if other.beyond_sweep:
        return f"at most {a / b:.2f}x ({a:.3g} / {b:.3g} req/s; the second never crossed the bound)"
    return f"{a / b:.2f}x ({a:.3g} / {b:.3g} req/s)"
