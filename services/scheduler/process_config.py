"""What the scheduler process is started with (``pagedserve scheduler`` or the launcher's argv):
its endpoints, its budgets and its liveness timeouts, each default taken from the flag that
declares it (``shared.engine_flags``), checked once here."""

from __future__ import annotations

from dataclasses import dataclass

from shared.endpoints import Endpoints
from shared import kv_events_config
from shared.engine_flags import LivenessFlags, RankFlags, ReplicaFlags, SchedulingFlags

from .step_timing import PLAN_AT_FRACTION

_SCHEDULING, _LIVENESS = SchedulingFlags(), LivenessFlags()  # the flags' defaults, declared there once


@dataclass(frozen=True)
class SchedulerProcessConfig:
    endpoints: Endpoints
    world_size: int = RankFlags().world_size
    max_num_seqs: int = _SCHEDULING.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULING.max_num_batched_tokens
    max_model_len: int | None = None  # None: what the executors report
    preemption_mode: str = _SCHEDULING.preemption_mode
    kv_policy: str = _SCHEDULING.kv_policy
    enable_prefix_caching: bool = _SCHEDULING.enable_prefix_caching
    step_timeout: float = _LIVENESS.step_timeout  # seconds a step result may take
    heartbeat_timeout: float = _LIVENESS.heartbeat_timeout  # seconds an executor rank or a frontend may be silent
    supervisor_endpoint: str | None = None  # where to report lost processes (pagedserve serve)
    zmq_curve: str | None = None  # --zmq-curve: the CURVE key directory; None: plain ZeroMQ
    async_scheduling: bool = _SCHEDULING.async_scheduling  # plan step N + 1 while the executors run step N (False: lock-step)
    plan_ahead_at: float = PLAN_AT_FRACTION  # ... when N is this far through its expected time (0: at once)
    speculative_config: str | None = None  # --speculative-config's JSON (``shared.speculative``); None: off
    kv_events_config: str | None = None  # --kv-events-config's JSON (``shared.kv_events_config``); None: off
    data_parallel_rank: int = ReplicaFlags().data_parallel_rank  # this scheduler's -dp replica index

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {self.world_size}")
        for flag, value in (("--step-timeout", self.step_timeout), ("--heartbeat-timeout", self.heartbeat_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        if not 0 <= self.plan_ahead_at <= 1:
            raise ValueError(f"--plan-ahead-at must be between 0 and 1, got {self.plan_ahead_at}")
        if self.data_parallel_rank < 0:
            raise ValueError(f"--data-parallel-rank must be 0 or more, got {self.data_parallel_rank}")
        kv_events_config.parse(self.kv_events_config)  # a bad one: its one-line ValueError
