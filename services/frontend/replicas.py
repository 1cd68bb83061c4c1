"""Data-parallel replicas behind one frontend: one ``EngineClient`` per replica's scheduler, and the
``ReplicaRouter`` choosing which takes each request.

``Replicas`` answers what the rest of the frontend asks of an ``EngineClient`` (``add_request``,
``abort``, ``latest_stats``, ``scheduler_lost``...), so routes, health and metrics take either.
A request goes to the replica the router picks among those that can take work now (ready, and
heard from lately: ``_available``; while none is, those not lost, else any, so that requests sent
during start-up or a restart wait at a scheduler as they do with one replica); it stays there:
its outputs, its abort, and its resubmission when that replica's scheduler restarts
(``EngineClient``). A replica whose scheduler or executors restarted starts with an empty cache,
so the router forgets what it sent there. Its load is the number of requests this frontend has in
flight there.

The stats are summed over the replicas heard from (``sum_stats``), the counters over every
scheduler each replica has had; the executor group's shape (tensor-parallel size, KV blocks per
rank) is the first ready replica's, every replica having the same.
The playground's block pool is replica 0's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.frontend.engine_client import EngineClient
from services.frontend.replica_router import ReplicaRouter
from services.frontend.scheduler_history import COUNTERS
from shared.messages import AddRequest, EngineStats, KvSnapshot, RequestOutput

log = structlog.get_logger()

ROUTE_SILENCE_S = 2.0

_SUMMED = ("num_running", "num_waiting", "num_blocks_total", "num_blocks_used", "num_slots_used",
           "num_slots_allocated", "num_swapped", "max_num_running", "num_cached_blocks", "num_frontends_lost",
           *COUNTERS)


def sum_stats(stats: list[EngineStats], counters: list[dict[str, int]] | None = None) -> EngineStats | None:
    """One ``EngineStats`` for several replicas: counts summed, ready if any is, the group's shape
    and the liveness fields (epoch, pid, executors) of the first ready one (else the first: a
    restarting scheduler's stats have no group yet). ``counters``: each replica's ``COUNTERS`` over
    all its schedulers (``EngineClient.counters``), summed instead of the latest stats' own, so that
    a replica's restart does not take the sums back (Prometheus would see a reset of them all)."""
    if not stats:
        return None
    first = next((s for s in stats if s.ready), stats[0])
    sums = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED}
    if counters is not None:
        sums.update({name: sum(c[name] for c in counters) for name in COUNTERS})
    for name in ("spec_proposed", "spec_accepted"):  # speculative decoding, per draft position
        sums[name] = [sum(col) for col in itertools.zip_longest(*(getattr(s, name) for s in stats), fillvalue=0)]
    return dataclasses.replace(first, ready=any(s.ready for s in stats), **sums)


class Replicas:
    """Several schedulers behind this frontend, used as one ``EngineClient``."""

    def __init__(self, clients: list[EngineClient], router: ReplicaRouter | None = None) -> None:
        if len(clients) < 2:
            raise ValueError("Replicas needs at least two clients; use the EngineClient itself")
        self.clients = clients
        self.router = router or ReplicaRouter(len(clients))
        self._incarnations: list[tuple | None] = [None] * len(clients)  # what a restart changes, per replica
        self.num_routed = [[0, 0] for _ in clients]  # per replica: [by prefix, by load]
        self.num_routed_tokens = [0] * len(clients)  # prompt tokens routed to a replica that had seen them
        self.on_kv_snapshot: Callable[[KvSnapshot], None] | None = None
        clients[0].on_kv_snapshot = self._on_kv_snapshot

    def __len__(self) -> int:
        return len(self.clients)

    # ---------------------------------------------------------------- the EngineClient interface

    async def start(self) -> None:
        for client in self.clients:
            await client.start()
        log.info("data-parallel replicas", num_replicas=len(self.clients))

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    def add_request(self, request: AddRequest) -> asyncio.Queue[RequestOutput | None]:
        self._forget_restarted()
        route = self.router.choose(request.prompt_token_ids, [c.num_pending for c in self.clients],
                                   self._available())
        self.num_routed[route.replica][0 if route.by_prefix else 1] += 1
        self.num_routed_tokens[route.replica] += route.matched_tokens
        log.debug("request routed", request_id=request.request_id, replica=route.replica,
                  matched_tokens=route.matched_tokens, by_prefix=route.by_prefix)
        return self.clients[route.replica].add_request(request)

    def abort(self, request_id: str) -> None:
        owners = [c for c in self.clients if request_id in c.routes]
        for client in owners or self.clients:  # unknown here: ended, or never sent; each scheduler ignores it
            client.abort(request_id)

    def abort_all(self, reason: str) -> int:
        return sum(client.abort_all(reason) for client in self.clients)

    @property
    def num_pending(self) -> int:
        return sum(c.num_pending for c in self.clients)

    @property
    def scheduler_lost(self) -> bool:
        """Every replica's scheduler is lost: nothing can take a request."""
        return all(c.scheduler_lost for c in self.clients)

    def scheduler_silence_s(self) -> float | None:
        """The shortest silence among the schedulers heard from (None: none heard yet)."""
        silences = [s for c in self.clients if (s := c.scheduler_silence_s()) is not None]
        return min(silences) if silences else None

    @property
    def latest_stats(self) -> EngineStats | None:
        heard = [c for c in self.clients if c.latest_stats is not None]
        return sum_stats([c.latest_stats for c in heard], [c.counters() for c in heard])

    def process_restarts(self) -> dict[str, int]:
        """Summed over the replicas, but for the frontends lost: every scheduler counts the same ones."""
        counts = [c.process_restarts() for c in self.clients]
        totals = {process: sum(c.get(process, 0) for c in counts) for process in counts[0]}
        totals["frontend"] = max(c.get("frontend", 0) for c in counts)
        return totals

    def ever_ready(self) -> list[bool]:
        """Per replica, whether it has been ready since this frontend started (one that has not is
        still starting; one that has and is not now is being mended)."""
        return [c.ever_ready for c in self.clients]

    def watch_kv(self, on: bool) -> None:
        self.clients[0].watch_kv(on)

    # ---------------------------------------------------------------- routing

    def _available(self) -> list[bool]:
        """The replicas ready now and not falling silent; else those not lost; else all (a request
        sent to a lost scheduler waits for its successor, as with one replica). Falling silent: not
        heard from for ``ROUTE_SILENCE_S`` longer than the most recently heard replica (stats come
        every 0.5 s; a scheduler killed a moment ago takes no more requests well before its
        heartbeat timeout says it is lost, while a pause of this frontend delays all alike)."""
        silences = [c.scheduler_silence_s() for c in self.clients]
        freshest = min((s for s in silences if s is not None), default=0.0)
        ready = [c.latest_stats is not None and c.latest_stats.ready and not c.scheduler_lost
                 and (silence is None or silence - freshest <= ROUTE_SILENCE_S)
                 for c, silence in zip(self.clients, silences)]
        if any(ready):
            return ready
        alive = [not c.scheduler_lost for c in self.clients]
        return alive if any(alive) else [True] * len(self.clients)

    def _forget_restarted(self) -> None:
        """A replica whose scheduler or executors restarted has an empty cache: forget what went there."""
        for i, client in enumerate(self.clients):
            incarnation = (client.scheduler_epoch, client.num_executor_restarts)
            if self._incarnations[i] is not None and incarnation != self._incarnations[i]:
                self.router.forget(i)
                log.info("replica restarted: its prefix routes forgotten", replica=i)
            self._incarnations[i] = incarnation

    def _on_kv_snapshot(self, snapshot: KvSnapshot) -> None:
        if self.on_kv_snapshot is not None:
            self.on_kv_snapshot(snapshot)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_ReplicasCollector(self))


class _ReplicasCollector(Collector):
    """Per replica: requests in flight, running and waiting, and how requests were routed."""

    def __init__(self, replicas: Replicas) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self._replicas
        yield GaugeMetricFamily("pagedserve:data_parallel_size", "Data-parallel replicas behind this frontend.",
                                value=len(replicas))
        in_flight = GaugeMetricFamily("pagedserve:replica_requests_in_flight",
                                      "Requests this frontend has in flight at each replica.", labels=["replica"])
        running = GaugeMetricFamily("pagedserve:replica_num_requests_running", "Sequences in each replica's batch.",
                                    labels=["replica"])
        waiting = GaugeMetricFamily("pagedserve:replica_num_requests_waiting", "Sequences waiting at each replica.",
                                    labels=["replica"])
        routed = CounterMetricFamily("pagedserve:replica_routed_requests",
                                     "Requests sent to each replica, by why it was chosen (prefix: it had been sent "
                                     "the prompt's beginning; load: the least loaded).", labels=["replica", "reason"])
        matched = CounterMetricFamily("pagedserve:replica_routed_prefix_tokens",
                                      "Prompt tokens sent to a replica that had been sent them before.",
                                      labels=["replica"])
        for i, client in enumerate(replicas.clients):
            label = str(i)
            stats = client.latest_stats
            in_flight.add_metric([label], client.num_pending)
            running.add_metric([label], stats.num_running if stats else 0)
            waiting.add_metric([label], stats.num_waiting if stats else 0)
            routed.add_metric([label, "prefix"], replicas.num_routed[i][0])
            routed.add_metric([label, "load"], replicas.num_routed[i][1])
            matched.add_metric([label], replicas.num_routed_tokens[i])
        yield from (in_flight, running, waiting, routed, matched)
