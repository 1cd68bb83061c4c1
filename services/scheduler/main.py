"""The scheduler process: a thin I/O shell around ``Scheduler``. The only place it touches sockets.

Sockets (all bound here): ``request`` ROUTER (frontends' DEALERs: requests in; each request's
outputs back to the frontend that sent it, stats to all; see ``frontends.py``), ``step`` PUB (us ->
every executor rank), ``result`` PULL (executors -> us).

Start-up handshake: wait for ``ExecutorReady`` from every rank (each reports its KV blocks), then
repeat ``Hello`` on the PUB socket until every rank acknowledged it (a SUB socket may miss early
messages), then size the block manager from the smallest rank and report ready to the frontend.
The ranks' reports (world size, all-reduce kind, KV blocks and bytes per rank) ride along in every
``EngineStats`` for /health and /metrics.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass

import zmq

from shared.endpoints import Endpoints
from shared.heartbeat import Heartbeat
from shared.logging import configure_logging
from shared.messages import (
    AbortRequest, AddRequest, DecodeError, ExecutorReady, Hello, HelloAck, Shutdown, Step, StepResult, decode,
    encode,
)

from .block_manager import BlockManager
from .contiguous import ContiguousBlockManager
from .frontends import FrontendLink
from .kv_publisher import KvPublisher
from .scheduler import Scheduler, SchedulerConfig

STATS_INTERVAL_S = 0.5
STEP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SchedulerProcessConfig:
    endpoints: Endpoints
    world_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: what the executors report
    preemption_mode: str = "recompute"
    kv_policy: str = "paged"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {self.world_size}")


class _Stop(Exception):
    pass


class SchedulerProcess:
    def __init__(self, config: SchedulerProcessConfig) -> None:
        self.config = config
        self.log = configure_logging("scheduler")
        self.ctx = zmq.Context()
        ep = config.endpoints
        self.frontends = FrontendLink(self.ctx, ep.request, self.log)
        self.kv_publisher = KvPublisher(self.frontends)  # the playground's map; idle while nobody watches
        self.steps = self._bind(zmq.PUB, ep.step)
        self.results = self._bind(zmq.PULL, ep.result)
        self.stopping = False
        self.scheduler: Scheduler | None = None
        self._last_stats = 0.0
        # Beats while starting and on every loop turn, not while a step is out: a scheduler stuck
        # on a lost executor's result turns unhealthy after `pagedserve health --max-age-s`.
        self.heartbeat = Heartbeat("scheduler")
        self._group: dict = {}  # the EngineStats fields describing the executor group

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return sock

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self._start_up()
            while not self.stopping:
                self._loop_once()
        except _Stop:
            pass
        finally:
            self.log.info("scheduler stopping")
            try:
                self.steps.send(encode(Shutdown("scheduler stopping")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.ctx.destroy(linger=0)

    def _on_signal(self, signum, _frame) -> None:
        self.log.info("signal received", signal=signal.Signals(signum).name)
        self.stopping = True

    def _start_up(self) -> None:
        cfg = self.config
        self.log.info("waiting for executors", world_size=cfg.world_size)
        ready: dict[int, ExecutorReady] = {}
        while len(ready) < cfg.world_size:
            self.heartbeat.beat()
            msg = self._recv(self.results, timeout_ms=200)
            if isinstance(msg, ExecutorReady):
                ready[msg.rank] = msg
                self.log.info("executor ready", rank=msg.rank, num_blocks=msg.num_blocks)
        nonce, acked = int(time.time() * 1000) & 0x7FFFFFFF, set()
        while len(acked) < cfg.world_size:
            self.heartbeat.beat()
            self.steps.send(encode(Hello(nonce)))
            msg = self._recv(self.results, timeout_ms=100)
            if isinstance(msg, HelloAck) and msg.nonce == nonce:
                acked.add(msg.rank)
        first = next(iter(ready.values()))
        self._group = group_stats(ready, cfg.world_size)
        self.log.info("executor group ready", **self._group)
        num_blocks = min(r.num_blocks for r in ready.values())
        max_model_len = min(r.max_model_len for r in ready.values())
        if cfg.max_model_len is not None:
            max_model_len = min(max_model_len, cfg.max_model_len)
        num_cpu_blocks = min(r.num_cpu_blocks for r in ready.values())
        manager = ContiguousBlockManager if cfg.kv_policy == "contiguous" else BlockManager
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len,
                            cfg.preemption_mode, cfg.kv_policy),
            manager(num_blocks, first.block_size, num_cpu_blocks=num_cpu_blocks,
                    enable_prefix_caching=cfg.enable_prefix_caching),
        )
        self.log.info("scheduler ready", num_blocks=num_blocks, block_size=first.block_size,
                      max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
                      num_cpu_blocks=num_cpu_blocks, preemption_mode=cfg.preemption_mode,
                      kv_policy=cfg.kv_policy, prefix_caching=cfg.enable_prefix_caching)
        self._send_stats(force=True)

    # ------------------------------------------------------------------ main loop

    def _loop_once(self) -> None:
        sched = self.scheduler
        self.heartbeat.beat()
        # Sleep on the request socket when idle; only drain it when there is work.
        self._drain_requests(timeout_ms=0 if sched.has_work() else 100)
        step = sched.schedule() if sched.has_work() else None
        self._send_outputs()
        if step is not None:
            self.steps.send(encode(step))
            sched.update(self._wait_result(step))
            self._send_outputs()
        self._send_stats()
        self.kv_publisher.publish(sched, time.monotonic())
        for request_id in self.frontends.take_orphans():
            self.log.info("request aborted: its frontend is gone", request_id=request_id)
            sched.abort_request(request_id)

    def _drain_requests(self, timeout_ms: int) -> None:
        msg = self.frontends.recv(timeout_ms)
        while msg is not None:
            if isinstance(msg, AddRequest):
                self.log.info("request added", request_id=msg.request_id,
                              num_prompt_tokens=len(msg.prompt_token_ids), max_tokens=msg.sampling.max_tokens)
                self.scheduler.add_request(msg)
                self._send_outputs()
            elif isinstance(msg, AbortRequest):
                self.log.info("request aborted", request_id=msg.request_id)
                self.scheduler.abort_request(msg.request_id)
            elif isinstance(msg, Shutdown):
                raise _Stop()
            msg = self.frontends.recv(0)

    def _wait_result(self, step: Step) -> StepResult:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.stopping:
                raise _Stop()
            msg = self._recv(self.results, timeout_ms=200)
            if isinstance(msg, StepResult) and msg.step_id == step.step_id:
                if msg.error:
                    self.log.error("step failed", step_id=step.step_id, error=msg.error)
                return msg
            if isinstance(msg, Shutdown):
                raise _Stop()
        raise RuntimeError(f"no result for step {step.step_id} within {STEP_TIMEOUT_S:.0f} s")

    def _send_outputs(self) -> None:
        for out in self.scheduler.take_outputs():
            if out.request_finished:
                self.log.info("request finished", request_id=out.request_id,
                              finish_reason=out.finish_reason, error=out.error)
            self.frontends.send_output(out)

    def _send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        self.frontends.send_stats(dataclasses.replace(self.scheduler.engine_stats(), **self._group))

    def _recv(self, sock: zmq.Socket, timeout_ms: int):
        """One decoded message, or None on timeout. Bad frames are logged and dropped."""
        if timeout_ms and not sock.poll(timeout_ms):
            return None
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return decode(frame)
        except DecodeError as exc:
            self.log.warning("dropped a bad frame", error=str(exc), num_bytes=len(frame))
            return None


def group_stats(ready: dict[int, ExecutorReady], world_size: int) -> dict:
    """The ``EngineStats`` fields that describe the group, from every rank's ``ExecutorReady``.

    Raises ``ValueError`` when the ranks disagree with the scheduler or each other about the group."""
    ranks = [ready[r] for r in sorted(ready)]
    for r in ranks:
        if r.world_size != world_size:
            raise ValueError(f"executor rank {r.rank} reports --world-size {r.world_size}; the scheduler has "
                             f"--world-size {world_size}")
        if r.block_size != ranks[0].block_size:
            raise ValueError(f"executor rank {r.rank} has --block-size {r.block_size}, rank {ranks[0].rank} "
                             f"{ranks[0].block_size}")
    return {"world_size": world_size, "all_reduce": ranks[0].all_reduce,
            "num_kv_blocks_per_rank": [r.num_blocks for r in ranks],
            "kv_cache_bytes_per_rank": [r.kv_cache_bytes for r in ranks]}


def run_scheduler(config: SchedulerProcessConfig) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    SchedulerProcess(config).run()
