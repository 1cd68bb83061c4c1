"""Rate sweep, the PagedAttention paper's Fig. 12 on our engine: normalized latency against request
rate, per KV policy, under Poisson arrivals.

    python -m loadtest.sweep [--rates 1,2,3,4,5,6,8,10] [--duration-s 12] [--scale-lengths 0.25]
        [--policies paged,contiguous,contiguous-pow2,contiguous-max,paged-no-prefix-caching]
        [--dataset sharegpt] [--out sweep-out]

One fresh ``pagedserve serve`` (SmolLM2 unless ``--model``) per distinct set of server flags, all
with the same ``--num-kv-blocks``, ``--max-num-seqs`` and ``--max-model-len`` (the contiguous
policies share one), each warmed up (the kernels compile on first use). Then one timed run per
rate and policy, rates lowest first and interleaved (every policy at one rate, then the next rate),
so that other load on the machine falls on all policies alike: requests arrive as a Poisson
process (``loadtest/sweep/load.py``: the same requests at every rate and for every policy, prompt
ids fresh per rate), each a streamed ``/v1/completions`` with token ids and ``ignore_eos``, while
``/health`` is sampled every ``--sample-interval-s``.

Policies: ``paged``, ``paged-no-prefix-caching``, ``contiguous`` (reserves prompt + the exact
output length: the paper's Orca (Oracle)), ``contiguous-pow2`` (prompt + the next power of two:
Orca (Pow2)) and ``contiguous-max`` (the whole context: Orca (Max)); the last two ask for that many
``max_tokens`` and close the stream at the drawn length.

Lengths: drawn from ``--dataset`` for the model's ``--max-model-len`` (2,048 for SmolLM2), then
prompt, output and context all multiplied by ``--scale-lengths`` (the server gets the scaled
context as its ``--max-model-len``), so a slow CPU can run the same shape smaller.

The defaults make KV memory, not the CPU, what limits every policy: a pool of two scaled contexts
(``POOL_CONTEXTS``) holds about 8 paged sequences and 4 Oracle reservations, few enough that a step
costs about the same at either batch on two cores, and the rates go past every policy's capacity.
Before the runs it prints what memory alone predicts (``loadtest/sweep/capacity.py``).

Writes to ``--out``: ``summary.csv`` (one row per policy and rate), ``timeline.csv`` (every
``/health`` sample), ``latency_vs_rate.png`` and ``timeline.png`` (each policy at its highest swept
rate, or all at ``--timeline-rate``), and prints the table, the highest rate each policy sustains
under the latency bound (``--latency-bound`` s/token, or ``--latency-bound-factor`` times the first
policy's normalized latency at the lowest rate) with the first policy's ratio to each other's, and
each policy's output tokens/s while requests waited (its pool full) with the same ratios. A
policy's higher rates are skipped once one rate is above the bound (``--run-all-rates`` runs them
all). ``--plot-only`` redraws from the CSV files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from loadtest.sweep.capacity import NUM_REPLAY_REQUESTS, capacities, expected_ratio, format_capacities
from loadtest.sweep.load import build_workload, scaled_context
from loadtest.sweep.plots import plot_latency_vs_rate, plot_timeline
from loadtest.sweep.report import RateSummary, format_full_pool, format_sustained, format_table, latency_bound, \
    read_summaries, read_timeline, sustained_rate
from loadtest.sweep.run import POLICIES, num_requests_at, run_sweep
from loadtest.bench.throughput import say
from loadtest.common.workloads import DATASETS
from loadtest.common.machine_state import print_cpu

# The default pool holds two whole (scaled) contexts: small enough that memory, not the CPU, limits
# how many sequences run (the paper's setting), large enough for the longest request.
POOL_CONTEXTS = 2
BLOCK_SIZE = 16  # the servers' default, which the sweep keeps
DEFAULT_POLICIES = ("paged", "contiguous", "contiguous-pow2", "contiguous-max", "paged-no-prefix-caching")
DEFAULT_RATES = "1,2,3,4,5,6,8,10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"comma-separated, run in this order; the first is the reference (of {', '.join(POLICIES)})")
    ap.add_argument("--rates", default=DEFAULT_RATES, help=f"requests/s, comma-separated (default {DEFAULT_RATES})")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--duration-s", type=float, default=12.0,
                      help="seconds of arrivals per rate: rate x duration requests, at least --min-requests (default 12)")
    load.add_argument("--num-requests", type=int, default=None, help="requests per rate instead of --duration-s")
    ap.add_argument("--min-requests", type=int, default=8, help="fewest requests per rate (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", choices=sorted(DATASETS), default="sharegpt")
    ap.add_argument("--scale-lengths", type=float, default=0.25, metavar="F",
                    help="multiply prompt, output and context lengths by F (default 0.25)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="the model's context, before scaling (default 2048)")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV pool of every server, in 16-token blocks (default: two scaled contexts, 64 at x 0.25)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step of every server (default 256)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="ids every prompt starts with (what prefix caching can reuse; default 0)")
    ap.add_argument("--latency-bound", type=float, default=None, metavar="S_PER_TOKEN",
                    help="normalized latency a sustained rate stays within (default: see --latency-bound-factor)")
    ap.add_argument("--latency-bound-factor", type=float, default=5.0,
                    help="bound = this x the first policy's normalized latency at the lowest rate (default 5)")
    ap.add_argument("--run-all-rates", action="store_true", help="do not skip rates above a policy's first over the bound")
    ap.add_argument("--timeline-rate", type=float, default=None,
                    help="one rate for every policy in timeline.png (default: each policy at its highest swept rate)")
    ap.add_argument("--sample-interval-s", type=float, default=0.5, help="/health sampling period (default 0.5)")
    ap.add_argument("--rate-timeout-s", type=float, default=300.0,
                    help="give up on a rate's unfinished requests after this long (they count as failed; default 300)")
    ap.add_argument("--model", default=None, help="--model for the servers (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--server-flags", default="", help="more flags for every pagedserve serve")
    ap.add_argument("--out", default="sweep-out", help="directory for the CSV and PNG files (default sweep-out)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the table and plots from --out's CSV files")
    args = ap.parse_args(argv)
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policy_list if p not in POLICIES]
    if unknown or not args.policy_list:
        ap.error(f"--policies: unknown {unknown or 'empty'}; choose from {', '.join(POLICIES)}")
    try:
        args.rate_list = sorted({float(r) for r in args.rates.split(",") if r.strip()})
    except ValueError:
        ap.error(f"--rates {args.rates!r} is not a comma-separated list of numbers")
    if not args.rate_list or args.rate_list[0] <= 0:
        ap.error(f"--rates {args.rates!r}: give positive rates")
    if args.timeline_rate is not None and args.timeline_rate not in args.rate_list and not args.plot_only:
        ap.error(f"--timeline-rate {args.timeline_rate} is not one of --rates {args.rate_list}")
    if not 0 < args.scale_lengths <= 1:
        ap.error(f"--scale-lengths {args.scale_lengths} must be in (0, 1]")
    if args.num_kv_blocks is None:
        args.num_kv_blocks = math.ceil(POOL_CONTEXTS * scaled_context(args.max_model_len, args.scale_lengths) / BLOCK_SIZE)
    return args




def report(args, summaries: list[RateSummary], timeline: list, bound_s_per_token: float,
           expected: dict[str, tuple[float, float]]) -> None:
    """Print the table and the sustained rates (beside the capacity model's ``expected`` ratios);
    draw the plots."""
    names = list(dict.fromkeys([*args.policy_list, *(s.policy for s in summaries)]))
    names = [n for n in names if any(s.policy == n for s in summaries)]
    labels = {n: POLICIES[n].label if n in POLICIES else n for n in names}
    sustained = {n: sustained_rate([(s.rate_req_s, s.normalized_latency_s_per_token) for s in summaries
                                    if s.policy == n], bound_s_per_token) for n in names}
    say("")
    say(format_table(summaries, bound_s_per_token))
    say("")
    say(format_sustained(sustained, bound_s_per_token, labels, expected))
    say("")
    say(format_full_pool(summaries, labels, expected))
    context = scaled_context_note(args)
    latency_png = os.path.join(args.out, "latency_vs_rate.png")
    plot_latency_vs_rate(latency_png, summaries, labels, sustained, bound_s_per_token,
                         f"Normalized latency vs request rate: {context}")
    rates = timeline_rates(args.timeline_rate, summaries, timeline, names)
    by_policy = {n: [s for p, r, s in timeline if p == n and r == rates[n]] for n in names}
    timeline_png = os.path.join(args.out, "timeline.png")
    if args.timeline_rate is None:
        which = "each policy at its highest swept rate"
        plot_timeline(timeline_png, by_policy, {n: f"{labels[n]}, at {rates[n]:g} req/s" for n in names},
                      f"Each policy at its highest swept rate, past what it sustains (its KV pool full)\n{context}")
    else:
        which = f"at {args.timeline_rate:g} req/s"
        plot_timeline(timeline_png, by_policy, labels, f"At {args.timeline_rate:g} req/s: {context}")
    say(f"\nwrote {os.path.join(args.out, 'summary.csv')}, {os.path.join(args.out, 'timeline.csv')}, "
        f"{latency_png}, {timeline_png} (timeline {which})")


def timeline_rates(rate: float | None, summaries: list[RateSummary], timeline: list,
                   names: list[str]) -> dict[str, float]:
    """The rate whose samples each policy's timeline draws: ``rate`` (``--timeline-rate``) for
    every policy, or by default each policy's highest swept rate: the first above the bound (unless
    it never crossed), where the pool pins how many sequences run."""
    if rate is None:
        return {n: max(s.rate_req_s for s in summaries if s.policy == n) for n in names}
    if not any(r == rate for _, r, _ in timeline):
        raise SystemExit(f"--timeline-rate {rate:g}: no samples at that rate (swept: "
                         f"{', '.join(f'{r:g}' for r in sorted({r for _, r, _ in timeline}))})")
    return dict.fromkeys(names, rate)


def scaled_context_note(args) -> str:
    model = os.path.basename(args.model.rstrip("/")) if args.model else "SmolLM2-135M"
    return (f"{model}, {args.dataset}-like lengths x {args.scale_lengths:g}, "
            f"{args.num_kv_blocks} KV blocks, Poisson arrivals")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_cpu()
    os.makedirs(args.out, exist_ok=True)
    if args.plot_only:
        load_settings(args)
        summaries = read_summaries(os.path.join(args.out, "summary.csv"))
        timeline = read_timeline(os.path.join(args.out, "timeline.csv"))
        first = next(n for n in [*args.policy_list, summaries[0].policy] if any(s.policy == n for s in summaries))
        bound = args.latency_bound or latency_bound(summaries, first, args.latency_bound_factor)
        report(args, summaries, timeline, bound, capacity_model(args))
        return
    save_settings(args)
    n_max = max(num_requests_at(args, r) for r in args.rate_list)
    workload = build_workload(args.dataset, n_max, args.seed, args.max_model_len, args.scale_lengths)
    say(f"workload: {args.dataset}-like lengths for a {args.max_model_len}-token context, x {args.scale_lengths:g} "
        f"(context {workload.max_model_len}): mean prompt {_mean(workload.num_prompt_tokens):.0f}, mean output "
        f"{_mean(workload.num_output_tokens):.0f} tokens over {n_max} requests; KV pool {args.num_kv_blocks} blocks")
    say(f"policies {', '.join(args.policy_list)}; rates {', '.join(f'{r:g}' for r in args.rate_list)} req/s; "
        f"requests per rate {', '.join(str(num_requests_at(args, r)) for r in args.rate_list)}")
    expected = capacity_model(args)
    summaries: list[RateSummary] = []
    timeline: list = []
    bound: list[float | None] = [args.latency_bound]
    t0 = time.monotonic()
    run_sweep(args, workload, summaries, timeline, bound)
    say(f"\nsweep took {(time.monotonic() - t0) / 60:.1f} min")
    report(args, summaries, timeline, bound[0], expected)


def capacity_model(args) -> dict[str, tuple[float, float]]:
    """Print what KV memory alone predicts for these requests and this pool; returns the first
    policy's predicted ratio to each other policy: (replayed, perfect packing)."""
    workload = build_workload(args.dataset, NUM_REPLAY_REQUESTS, args.seed, args.max_model_len, args.scale_lengths)
    ways = {n: (POLICIES[n].kv_policy, POLICIES[n].reservation) for n in args.policy_list if n in POLICIES}
    model = capacities(workload, list(ways.values()), args.num_kv_blocks, BLOCK_SIZE, args.max_num_seqs)
    by_policy = {n: model[way] for n, way in ways.items()}
    say(format_capacities(by_policy, args.num_kv_blocks, len(workload)))
    first = by_policy[args.policy_list[0]]
    return {n: expected_ratio(first, c) for n, c in by_policy.items() if n != args.policy_list[0]}


SETTINGS = ("policy_list", "dataset", "scale_lengths", "max_model_len", "num_kv_blocks", "max_num_seqs", "model",
            "seed", "shared_prefix_tokens")


def save_settings(args) -> None:
    """What ``--plot-only`` needs to title the plots as the run was made."""
    with open(os.path.join(args.out, "settings.json"), "w") as f:
        json.dump({k: getattr(args, k) for k in SETTINGS}, f, indent=1)


def load_settings(args) -> None:
    path = os.path.join(args.out, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            for key, value in json.load(f).items():
                setattr(args, key, value)


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else math.nan


if __name__ == "__main__":
    main()
