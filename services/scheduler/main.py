"""The scheduler process: a thin I/O shell around ``Scheduler``. The only place it touches sockets.

Sockets (all bound here): ``request`` ROUTER (frontends' DEALERs: requests in; each request's
outputs back to the frontend that sent it, stats to all; see ``frontends.py``), ``step`` PUB and
``result`` PULL (the executor ranks; see ``executors.py``), and a PUSH to the supervisor when one
is given. With ``--zmq-curve`` the three are CURVE servers behind a ZAP allow-list
(``shared.zmq_auth``): only the frontends' and executors' keys get through.

One loop, never blocked for long: it sends a step when the executors are ready and none is in
flight, and by default (async scheduling; ``--no-async-scheduling`` is lock-step) also when one
is, planning the next step while the executors compute that one (``Scheduler.can_schedule_ahead``)
shortly before that one is expected to end (``step_timing``: requests that arrive meanwhile join it),
then waits on both sockets at once, so that while a step runs it still takes requests, aborts and
heartbeats, and sends ``EngineStats`` every ``STATS_INTERVAL_S`` (the frontends' sign
that the scheduler lives) and, while a playground watches, block-pool snapshots
(``kv_publisher``), and with ``--kv-events-config`` the prefix cache's events of that turn in vLLM's
format (``kv_events_zmq``). Every turn also touches the scheduler's heartbeat file
(``shared.heartbeat_file``, for a container healthcheck), while a step is out too: the loop turning is
the scheduler's health; an executor's is its own file and its heartbeats.

Start-up and restarts: ``Hello`` (with this process's random epoch) goes out until every rank
answered with ``ExecutorReady``; the block manager is sized from the first answers. When the
executors are lost (``liveness``: a rank died, hung, stopped beating, or was replaced) the
supervisor is told, the scheduler resets its executor state (every sequence starts over by
recompute; ``recovery``), and the Hello loop runs again until the new ranks answer with the same
pool shape. Requests keep arriving meanwhile and wait. The ranks' reports (world size, all-reduce
kind, KV blocks and bytes per rank) ride along in every ``EngineStats`` for /health and /metrics.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time

import zmq

from shared.heartbeat_file import HeartbeatFile
from shared import kv_events_config, speculative
from shared.logging import configure_logging
from shared.messages import AbortRequest, AddRequest, EngineStats, Shutdown, StepResult
from shared.zmq_auth import load_keys, log_mode, start_authenticator

from .block_manager import BlockManager
from .contiguous import ContiguousBlockManager
from .executors import ExecutorLink
from .frontends import FrontendLink
from .kv_events_zmq import KvEventsPublisher
from .kv_publisher import KvPublisher
from .liveness import ExecutorGroup, Loss
from .process_config import SchedulerProcessConfig
from .scheduler import Scheduler, SchedulerConfig
from .tiered import keys_on_every_rank, scheduler_class
from .step_timing import PlanAheadTimer

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
STALL_S = 1.0  # a loop turn this much longer than its poll: the scheduler itself was stalled


class _Stop(Exception):
    pass


class SchedulerProcess:
    def __init__(self, config: SchedulerProcessConfig) -> None:
        self.config = config
        self.epoch = secrets.randbits(62) + 1  # nonzero; new for every scheduler process
        self.log = configure_logging("scheduler").bind(epoch=self.epoch)
        keys = load_keys(config.zmq_curve, "scheduler") if config.zmq_curve else None
        log_mode(self.log, keys)
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, keys, self.log)  # before any socket binds
        ep = config.endpoints
        self.frontends = FrontendLink(self.ctx, ep.request, self.log, silence_timeout_s=config.heartbeat_timeout,
                                      curve=keys)
        group = ExecutorGroup(config.world_size, config.heartbeat_timeout, config.step_timeout)
        self.executors = ExecutorLink(self.ctx, ep.step, ep.result, group, self.epoch, self.log,
                                      config.supervisor_endpoint, curve=keys)
        self.kv_publisher = KvPublisher(self.frontends)  # the playground's map; idle while nobody watches
        events = kv_events_config.parse(config.kv_events_config)  # for routers (--kv-events-config); None: off
        self.kv_events = (KvEventsPublisher(events, config.data_parallel_rank, self.ctx, self.log)
                          if events is not None and events.publishes else None)
        self.poller = zmq.Poller()
        self.poller.register(self.frontends.socket, zmq.POLLIN)
        self.poller.register(self.executors.results, zmq.POLLIN)
        self.stopping = False
        self.scheduler: Scheduler | None = None
        self.in_flight: list[int] = []  # ids of the steps sent and not answered, oldest first
        self.step_timing = PlanAheadTimer(config.plan_ahead_at)  # when to plan the next step while one runs
        self._held: list = []  # requests and aborts that came before the scheduler existed
        self._last_stats = float("-inf")
        self._last_turn = time.monotonic()
        self.heartbeat_file = HeartbeatFile("scheduler")

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.log.info("waiting for executors", world_size=self.config.world_size)
        try:
            while not self.stopping:
                self._loop_once()
        except _Stop:
            pass
        finally:
            self.log.info("scheduler stopping")
            self.executors.shut_down("scheduler stopping")
            if self.auth is not None:
                self.auth.stop()
            self.ctx.destroy(linger=0)

    def _on_signal(self, signum, _frame) -> None:
        self.log.info("signal received", signal=signal.Signals(signum).name)
        self.stopping = True

    # ------------------------------------------------------------------ main loop

    def _loop_once(self) -> None:
        self.heartbeat_file.beat()
        stepped = self._maybe_step()
        if not stepped:
            self.poller.poll(self._poll_timeout_ms())
        now = time.monotonic()
        self._excuse_own_stall(now)
        self._drain_requests()
        results, loss = self.executors.receive(now)
        for result in results:
            self._apply_result(result)
        loss = loss or self.executors.group.check(now)
        if loss is not None:
            self._lose_executors(loss)
        self._start_when_ready()
        self.executors.say_hello(now)
        self.frontends.forget_silent(now)
        if self.scheduler is not None:
            self.kv_publisher.publish(self.scheduler, now)
            if self.kv_events is not None:
                self.kv_events.publish(self.scheduler.blocks.cache_events, self.scheduler.blocks.sliding_window)
                self.kv_events.serve_replay()
        for request_id in self.frontends.take_orphans():
            self.log.info("request aborted: its frontend is gone", request_id=request_id)
            self._handle(AbortRequest(request_id))
        self._send_stats(now)

    def _excuse_own_stall(self, now: float) -> None:
        """A turn of this loop takes milliseconds; a long gap is a stall of ours (a SIGSTOP, a
        starved CPU), not the silence of our peers: their clocks move on by as much. Messages that
        waited meanwhile may still be on their way through ZeroMQ's I/O thread."""
        stall_s = now - self._last_turn - IDLE_POLL_MS / 1000
        self._last_turn = now
        if stall_s > STALL_S:
            self.log.warning("the scheduler was stalled; peers' silence excused", seconds=round(stall_s, 1))
            self.executors.group.excuse(stall_s)
            self.frontends.excuse(stall_s)

    def _maybe_step(self) -> bool:
        """Send the next step if the executors are ready and none is in flight (or, with async
        scheduling, one is and the next may be planned ahead of its result); True if one went."""
        sched = self.scheduler
        if sched is None or not self.executors.group.ready:
            return False
        if self.in_flight and not (self.config.async_scheduling and sched.can_schedule_ahead()
                                   and time.monotonic() >= self.step_timing.plan_ahead_at()):
            return False
        self._drain_requests()  # what came since this turn's poll joins this step, as it would have then
        if not sched.has_work():
            return False
        began = time.monotonic()
        step = sched.schedule()
        self._send_outputs()
        if step is None:
            return False
        now = time.monotonic()
        self.executors.send_step(step, now)
        self.in_flight.append(step.step_id)
        self.step_timing.sent(step.step_id, len(step.input_token_ids), now, time.monotonic() - began)
        return True

    def _poll_timeout_ms(self) -> int:
        if self.in_flight or not self.executors.group.ready:
            # a result, or an executor's answer, may come any moment; stats keep going; and the
            # next step may be due to be planned ahead sooner
            if self.config.async_scheduling:
                until_plan_ms = (self.step_timing.plan_ahead_at() - time.monotonic()) * 1000
                if 0 < until_plan_ms < 20:
                    return max(1, int(until_plan_ms) + 1)
            return 20
        return IDLE_POLL_MS

    def _apply_result(self, result: StepResult) -> None:
        if not self.in_flight or result.step_id != self.in_flight[0]:
            return  # a step lost with its executors, answered late (rank 0 answers in order)
        self.in_flight.pop(0)
        now = time.monotonic()
        self.executors.group.step_done(now)
        self.step_timing.answered(result.step_id, now)
        if result.error:
            self.log.error("step failed", step_id=result.step_id, error=result.error)
        self.scheduler.update(result)
        self._send_outputs()

    def _lose_executors(self, loss: Loss) -> None:
        """Replace the executor group: tell the supervisor, start every sequence over."""
        group = self.executors.group
        replaced = group.lose(loss)
        self.log.error("executor lost; waiting for a new one", rank=loss.rank, cause=loss.cause,
                       num_steps_lost=len(self.in_flight),
                       executor_pids=[pid for _, pid in replaced], num_restarts=group.ranks[loss.rank].num_restarts)
        self.executors.report_lost(replaced, loss.cause)
        self.in_flight = []
        self.step_timing.forget()
        if self.scheduler is not None:
            self.scheduler.reset_executor_state(loss.cause)
            self._send_outputs()

    def _start_when_ready(self) -> None:
        """Build the scheduler when the first executor group is complete, and let the requests
        held until then in."""
        group = self.executors.group
        if self.scheduler is not None or not group.ready:
            return
        cfg, shape = self.config, group.shape
        max_model_len = min(shape.max_model_len, cfg.max_model_len or shape.max_model_len)
        if cfg.kv_policy == "contiguous":  # a reservation is never trimmed: no sliding window there
            manager = ContiguousBlockManager(shape.num_blocks, shape.block_size, num_cpu_blocks=shape.num_cpu_blocks)
        else:
            manager = BlockManager(shape.num_blocks, shape.block_size, num_cpu_blocks=shape.num_cpu_blocks,
                                   enable_prefix_caching=cfg.enable_prefix_caching,
                                   sliding_window=shape.sliding_window)
        readies = [state.ready for state in group.ranks]  # their offload tiers' books live with the blocks'
        scheduler_cls = scheduler_class(manager, shape.num_host_offload_blocks, shape.num_disk_offload_blocks,
                                        keys_on_every_rank(readies))
        self.scheduler = scheduler_cls(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len, cfg.preemption_mode,
                            cfg.kv_policy, speculative.parse(cfg.speculative_config)), manager)
        self.log.info("scheduler ready", num_blocks=shape.num_blocks, block_size=shape.block_size,
                      max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
                      num_cpu_blocks=shape.num_cpu_blocks, preemption_mode=cfg.preemption_mode,
                      kv_policy=cfg.kv_policy, prefix_caching=cfg.enable_prefix_caching,
                      sliding_window=manager.sliding_window,
                      async_scheduling=cfg.async_scheduling)
        if self.kv_events is not None:  # a (re)started scheduler holds nothing: routers forget what it held
            manager.cache_events.enabled = True
            manager.cache_events.cleared()
        held, self._held = self._held, []
        for msg in held:
            self._handle(msg)
        self._send_stats(time.monotonic(), force=True)

    def _drain_requests(self) -> None:
        msg = self.frontends.recv(0)
        while msg is not None:
            if isinstance(msg, Shutdown):
                raise _Stop()
            if isinstance(msg, (AddRequest, AbortRequest)):
                self._handle(msg)
            msg = self.frontends.recv(0)

    def _handle(self, msg: AddRequest | AbortRequest) -> None:
        if self.scheduler is None:
            self._held.append(msg)
        elif isinstance(msg, AddRequest):
            self.log.info("request added", request_id=msg.request_id, num_prompt_tokens=len(msg.prompt_token_ids),
                          num_resumed_tokens=len(msg.resumed_token_ids), max_tokens=msg.sampling.max_tokens)
            self.scheduler.add_request(msg)
            self._send_outputs()
        else:
            self.log.info("request aborted", request_id=msg.request_id)
            self.scheduler.abort_request(msg.request_id)

    def _send_outputs(self) -> None:
        outputs = self.scheduler.take_outputs()
        for out in outputs:
            if out.request_finished:
                self.log.info("request finished", request_id=out.request_id,
                              finish_reason=out.finish_reason, error=out.error)
        if outputs:
            self.frontends.send_outputs(outputs)

    def _send_stats(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        group = self.executors.group
        stats = self.scheduler.engine_stats() if self.scheduler is not None else EngineStats(0, 0, 0, 0, 0, 0, False)
        stats.ready = self.scheduler is not None and group.ready
        stats.epoch, stats.pid, stats.num_frontends_lost = self.epoch, os.getpid(), self.frontends.num_lost
        stats.executors = group.health(now)
        self.frontends.send_stats(dataclasses.replace(stats, **group.stats))


def run_scheduler(config: SchedulerProcessConfig) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    SchedulerProcess(config).run()
