"""Prometheus metrics of the frontend, in their own registry (one per application).

Gauges and engine counters come from the scheduler's latest ``EngineStats`` at scrape time;
request counters and latency histograms are observed here as generations progress (times from
the request's arrival at the frontend):

- time to first token: arrival -> the first generated token reaches the frontend;
- time per output token: (last token - first token) / (tokens - 1), once per request with at
  least two tokens;
- end-to-end latency: arrival -> the last token, for requests that finished (stop or length).

A request with several choices (n, best_of, beam search) is one engine request: it counts once in
the latencies (time per output token over its longest choice), and each returned choice counts
in ``request_success`` by its finish reason (as vLLM counts finished sequences).

``num_queued`` counts engine requests sent that have had no output yet (waiting at the
scheduler or being prefilled): what ``--max-queue-len`` limits.

``process_restarts_total{process}`` counts the processes that ended (died, were killed as hung, or
were killed while they started up) and were replaced, each replacement once; the executor ranks
restart together and count as one. Under ``pagedserve serve`` the count is the launcher's, which
replaced them all (read from its file, ``shared.restart_counts``): only the launcher sees a process
killed before any other heard of it, and its count goes on across restarts of this frontend and of
the scheduler. A process no launcher of ours supervises (started on its own, by compose say) is
counted where it is seen instead: the executor ranks by the scheduler (an accepted rank lost;
summed over the schedulers this frontend knew), the scheduler by this frontend (a new epoch), the
frontends by the scheduler (frontends that went away or fell silent); there, a process that ends
before any of these heard of it is not counted, and a restarted frontend starts again from the
counts the current scheduler reports.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.frontend.generation import Generation
from shared.messages import EngineStats

PREFIX = "pagedserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0)


class _RestartsCollector(Collector):
    """Restarts by process, from ``restarts()`` when scraped."""

    def __init__(self, restarts: Callable[[], dict[str, int]]) -> None:
        self._restarts = restarts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(PREFIX + "process_restarts",
                                     "Processes that ended (died, hung, killed while starting) and were replaced.",
                                     labels=["process"])
        for process, num in sorted(self._restarts().items()):
            family.add_metric([process], num)
        yield family


class _EngineStatsCollector(Collector):
    """Reads the latest ``EngineStats`` when scraped (all zero before the first one arrives)."""

    def __init__(self, latest: Callable[[], EngineStats | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        stats = self._latest()
        get = (lambda name: getattr(stats, name)) if stats is not None else (lambda name: 0)
        yield _gauge("num_requests_running", "Sequences in the running batch.", get("num_running"))
        yield _gauge("num_requests_waiting", "Sequences waiting to be scheduled.", get("num_waiting"))
        yield _gauge("num_requests_swapped", "Sequences swapped out to CPU memory.", get("num_swapped"))
        total = get("num_blocks_total")
        yield _gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).",
                     get("num_blocks_used") / total if total else 0.0)
        allocated = get("sum_slots_allocated")
        yield _gauge("kv_slot_utilization",
                     "Mean over all steps of KV slots holding tokens / slots allocated (0 to 1).",
                     get("sum_slots_used") / allocated if allocated else 0.0)
        yield _gauge("num_kv_blocks_total", "KV blocks in the device pool.", total)
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       get("num_prefix_cache_queries"))
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", get("num_prefix_cache_hits"))
        yield _counter("num_preemptions", "Sequence groups preempted (recompute or swap).", get("num_preemptions"))
        yield from _group_metrics(stats)
        yield from _speculation_metrics(stats)


def _speculation_metrics(stats: EngineStats | None) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names): draft tokens proposed and accepted, in all and per
    position (0: the first draft after the last known token), and the acceptance rate per position."""
    proposed, accepted = (stats.spec_proposed, stats.spec_accepted) if stats else ([], [])
    yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding).", sum(proposed))
    yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", sum(accepted))
    for name, doc, values in (
        ("spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at each position.", proposed),
        ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position.", accepted),
    ):
        family = CounterMetricFamily(PREFIX + name, doc, labels=["position"])
        for pos, value in enumerate(values):
            family.add_metric([str(pos)], value)
        yield family
    rate = GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate_per_pos",
                             "Accepted / proposed draft tokens at each position.", labels=["position"])
    for pos, (p, a) in enumerate(zip(proposed, accepted)):
        rate.add_metric([str(pos)], a / p if p else 0.0)
    yield rate


def _group_metrics(stats: EngineStats | None) -> Iterator[Metric]:
    """The executor group: its size, its all-reduce kind (an info-style gauge), and per rank its
    KV blocks and their bytes."""
    yield _gauge("tensor_parallel_size", "Executor ranks in the group.", stats.world_size if stats else 0)
    kind = GaugeMetricFamily(PREFIX + "all_reduce_info", "The group's all-reduce kind (value 1).",
                             labels=["kind"])
    if stats is not None:
        kind.add_metric([stats.all_reduce], 1)
    yield kind
    kv_dtype = GaugeMetricFamily(PREFIX + "kv_cache_dtype_info", "How the KV pool stores keys and values "
                                 "(--kv-cache-dtype; value 1).", labels=["dtype"])
    if stats is not None and stats.kv_cache_dtype:
        kv_dtype.add_metric([stats.kv_cache_dtype], 1)
    yield kv_dtype
    for name, doc, values in (
        ("kv_blocks_per_rank", "KV blocks in each rank's device pool.", stats.num_kv_blocks_per_rank if stats else []),
        ("kv_cache_bytes_per_rank", "Bytes of each rank's device KV pool (its KV heads only).",
         stats.kv_cache_bytes_per_rank if stats else []),
        ("kv_tokens_per_rank", "Tokens each rank's device KV pool holds (blocks x block size).",
         [n * stats.kv_block_size for n in stats.num_kv_blocks_per_rank] if stats else []),
    ):
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["rank"])
        for rank, value in enumerate(values):
            family.add_metric([str(rank)], value)
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class FrontendMetrics:
    """The registry /metrics serves, and the ``GenerationObserver`` that feeds it."""

    def __init__(self, latest_stats: Callable[[], EngineStats | None],
                 restarts: Callable[[], dict[str, int]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(latest_stats))
        self.registry.register(_RestartsCollector(restarts))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Choices finished, by reason.",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.num_queued = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ GenerationObserver

    def on_start(self, gen: Generation) -> None:
        self.num_queued += 1

    def on_first_output(self, gen: Generation) -> None:
        self.num_queued -= 1

    def on_tokens(self, gen: Generation, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)
        if gen.num_completion_tokens == num_tokens and gen.first_token_time is not None:  # the first ones
            self.prompt_tokens.inc(gen.num_prompt_tokens)
            self.ttft.observe(gen.first_token_time - gen.arrival_time)

    def on_finish(self, gen: Generation) -> None:
        assert gen.finish_time is not None
        for reason in gen.finish_reasons:
            self.request_success.labels(finished_reason=reason).inc()
        self.e2e.observe(gen.finish_time - gen.arrival_time)
        num_tokens = max((c.num_tokens for c in gen.choices), default=0)  # the choices decode side by side
        if num_tokens > 1 and gen.first_token_time is not None:
            self.tpot.observe((gen.finish_time - gen.first_token_time) / (num_tokens - 1))
