"""The rate sweep's figures (matplotlib, written as PNG without a display).

- ``latency_vs_rate.png``: the paper's Fig. 12 on our engine. Left, normalized latency (s/token,
  log scale) against request rate, one curve per policy, with the latency bound; right, output
  tokens per second (those that came while requests were arriving) against request rate. A run with a failed request is drawn at the top edge.
- ``timeline.png``: one run per policy (by default each at its highest swept rate, its pool full;
  or all at one rate): running sequences, KV blocks in use (% of the pool) and KV slot utilization
  (% of the running sequences' allocated slots that hold tokens) against time since the first
  arrival, sampled from ``/health``.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.sweep.load import HealthSample  # noqa: E402
from loadtest.sweep.report import RateSummary, Sustained  # noqa: E402

COLORS = {"paged": "tab:blue", "paged-no-prefix-caching": "tab:cyan", "contiguous": "tab:red",
          "contiguous-pow2": "tab:orange", "contiguous-max": "tab:brown"}


def _color(policy: str, i: int) -> str:
    return COLORS.get(policy, f"C{i % 10}")


def plot_latency_vs_rate(path: str, summaries: list[RateSummary], labels: dict[str, str],
                         sustained: dict[str, Sustained], bound_s_per_token: float, title: str) -> None:
    fig, (ax_lat, ax_tok) = plt.subplots(1, 2, figsize=(12, 4.8))
    finite = [s.normalized_latency_s_per_token for s in summaries if math.isfinite(s.normalized_latency_s_per_token)]
    top = max(finite + [bound_s_per_token]) * 2.0
    for i, policy in enumerate(labels):
        rows = sorted((s for s in summaries if s.policy == policy), key=lambda s: s.rate_req_s)
        if not rows:
            continue
        rates = [s.rate_req_s for s in rows]
        lat = [min(s.normalized_latency_s_per_token, top) for s in rows]
        est = sustained[policy].best_estimate if policy in sustained else None
        more = "≥ " if policy in sustained and sustained[policy].beyond_sweep else ""
        label = f"{labels[policy]}: sustains {more}{est:.2g} req/s" if est else f"{labels[policy]}: sustains none"
        ax_lat.plot(rates, lat, "o-", color=_color(policy, i), label=label)
        ax_tok.plot(rates, [s.arriving_output_tokens_s for s in rows], "o-", color=_color(policy, i),
                    label=labels[policy])
    ax_lat.axhline(bound_s_per_token, color="gray", linestyle="--", linewidth=1,
                   label=f"latency bound {bound_s_per_token:.3g} s/token")
    ax_lat.set_yscale("log")
    ax_lat.set_ylim(top=top)
    ax_lat.set_xlabel("request rate (req/s)")
    ax_lat.set_ylabel("normalized latency (s/token, log scale)")
    ax_lat.set_title("Normalized latency: mean of (end-to-end latency / output tokens)", fontsize=10)
    ax_lat.legend(fontsize=8, loc="upper left")
    ax_tok.set_xlabel("request rate (req/s)")
    ax_tok.set_ylabel("output tokens/s")
    ax_tok.set_title("Throughput while requests arrive", fontsize=10)
    ax_tok.legend(fontsize=8, loc="upper left")
    for ax in (ax_lat, ax_tok):
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3, which="both")
    ax_tok.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(path: str, samples: dict[str, list[HealthSample]], labels: dict[str, str], title: str) -> None:
    """``samples``: per policy, its ``/health`` samples at the chosen rate (drawn as steps: each
    value holds until the next sample)."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    ax_run, ax_blocks, ax_util = axes
    for i, policy in enumerate(labels):
        rows = samples.get(policy) or []
        style = {"color": _color(policy, i), "where": "post", "linewidth": 1.4}
        ax_run.step([s.t_s for s in rows], [s.num_running or 0 for s in rows], label=labels[policy], **style)
        blocks = [(s.t_s, 100 * s.num_blocks_used / s.num_blocks_total) for s in rows
                  if s.num_blocks_total and s.num_blocks_used is not None]
        ax_blocks.step(*zip(*blocks) if blocks else ([], []), **style)
        util = [(s.t_s, 100 * s.num_slots_used / s.num_slots_allocated) for s in rows if s.num_slots_allocated]
        ax_util.step(*zip(*util) if util else ([], []), **style)
    ax_run.set_ylabel("running sequences")
    ax_run.set_ylim(bottom=0)
    ax_run.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 1.32), ncol=2, frameon=False)
    ax_blocks.set_ylabel("KV blocks in use\n(% of the pool)")
    ax_util.set_ylabel("KV slot utilization\n(% of allocated slots\nholding tokens)")
    for ax in (ax_blocks, ax_util):
        ax.set_ylim(0, 105)
    ax_util.set_xlabel("time since the first arrival (s); /health sampled every ~0.5 s")
    for ax in axes:
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
