"""What one frontend's link has seen of its schedulers (``engine_client``): the latest ``EngineStats``,
and what lasts across scheduler processes. A new process has a new epoch and starts its counters at
0: the restart is counted, and the counters and executor restarts it reported are kept."""

from __future__ import annotations

import time

from shared.messages import EngineStats

# EngineStats fields that only grow while one scheduler lives (it starts them at 0)
COUNTERS = ("num_steps", "sum_slots_used", "sum_slots_allocated", "num_preemptions", "num_prefix_cache_queries",
            "num_prefix_cache_hits", "num_swap_outs", "num_recomputes", "num_kv_snapshots")


class SchedulerHistory:
    """The latest stats of the scheduler behind one link, and the counts over every scheduler it has known."""

    def __init__(self) -> None:
        self.latest: EngineStats | None = None
        self.latest_time: float | None = None  # time.monotonic() when it arrived
        self.epoch: int | None = None
        self.num_restarts = 0
        self._executor_restarts_before = 0  # reported by the schedulers before this one
        self.ever_ready = False  # a scheduler of this link has said ready (one not ready since is being mended)
        # the monotonic counters of the schedulers before this one, summed (``counters``)
        self.counters_before: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def observe(self, stats: EngineStats) -> bool:
        """Keep ``stats`` as the latest; True when they come from a new scheduler (a restart, counted)."""
        restarted = self.epoch is not None and stats.epoch != self.epoch
        if restarted:
            self.num_restarts += 1
            self._executor_restarts_before = self.num_executor_restarts
            for name in COUNTERS:
                self.counters_before[name] += getattr(self.latest, name)
        self.epoch = stats.epoch
        self.latest = stats
        self.ever_ready = self.ever_ready or stats.ready
        self.latest_time = time.monotonic()
        return restarted

    @property
    def num_executor_restarts(self) -> int:
        reported = sum(e.num_restarts for e in self.latest.executors) if self.latest else 0
        return self._executor_restarts_before + reported

    def process_restarts(self) -> dict[str, int]:
        """Restarts seen so far, by process (see ``metrics``)."""
        lost_frontends = self.latest.num_frontends_lost if self.latest else 0
        return {"executor": self.num_executor_restarts, "scheduler": self.num_restarts, "frontend": lost_frontends}

    def counters(self) -> dict[str, int]:
        """``COUNTERS`` over every scheduler this link has known: they keep growing across restarts."""
        latest = self.latest
        return {name: self.counters_before[name] + (getattr(latest, name) if latest else 0) for name in COUNTERS}
