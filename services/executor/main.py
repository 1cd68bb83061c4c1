"""The executor process: loads the model and the KV pool, then runs every ``Step`` it is sent.

Sockets (connected here): ``step`` SUB (scheduler -> all ranks), ``result`` PUSH (-> scheduler),
and a second PUSH to ``result`` for the heartbeat thread (``heartbeat``), which beats from start-up.
Rank 0 samples and replies with a ``StepResult``; other ranks (tensor parallelism, later) only run.

Handshake: once loaded, the rank says ``ExecutorReady`` unasked (epoch 0: a scheduler that knew an
earlier process of this rank learns it was replaced), then answers the first ``Hello`` of every
scheduler epoch with ``ExecutorReady`` again. A new epoch is a new scheduler, which knows none of
the sequences this process held: they are dropped, and so is any step of another epoch (a dead
scheduler's). ``incarnation`` (random per process) tells the scheduler which process of the rank
is talking.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.endpoints import Endpoints
from shared.logging import configure_logging
from shared.messages import DecodeError, ExecutorReady, Hello, Shutdown, Step, StepResult, decode, encode
from shared.model_source import resolve_model
from shared.threads import configure_cpu_threads

if TYPE_CHECKING:  # the loader imports torch, which must wait for the thread settings
    from .loader import RunnerOptions


@dataclass(frozen=True)
class ExecutorConfig:
    endpoints: Endpoints
    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str = "1GiB"
    swap_space: float = 1.0  # GiB of CPU memory for swapped-out blocks
    max_model_len: int | None = None
    attention_backend: str = "auto"
    rank: int = 0
    world_size: int = 1
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.runner_options()  # validates the flags it shares with the offline engine
        if self.world_size != 1:
            raise ValueError("--world-size > 1 (tensor parallelism) is not implemented yet")

    def runner_options(self) -> "RunnerOptions":
        from .loader import RunnerOptions

        return RunnerOptions(
            dtype=self.dtype, device=self.device, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory, swap_space=self.swap_space, max_model_len=self.max_model_len,
            attention_backend=self.attention_backend, seed=self.seed,
        )


class ExecutorProcess:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.log = configure_logging("executor").bind(rank=config.rank)
        self.stopping = False
        self.incarnation = secrets.randbits(62) + 1  # nonzero; new for every executor process
        self.epoch = 0  # of the scheduler this process answered last
        self._request_ids: dict[int, str] = {}  # seq_id -> request_id, for logs

    def _load(self):
        from .loader import build_runner
        from .weights import load_hf_config, load_state_dict

        source = resolve_model(self.config.model)
        self._model_name = source.name
        t0 = time.monotonic()
        self.log.info("loading model", model=source.name, path=source.directory, dtype=self.config.dtype)
        runner = build_runner(load_hf_config(source), load_state_dict(source), self.config.runner_options())
        self.log.info("model loaded", seconds=round(time.monotonic() - t0, 1), num_blocks=runner.num_blocks,
                      kv_cache_mib=round(runner.kv_cache_bytes / 2**20), attention_backend=runner.backend.name,
                      max_model_len=runner.max_model_len, num_cpu_blocks=runner.num_cpu_blocks)
        return runner

    def run(self) -> None:
        import zmq

        from .heartbeat import HeartbeatThread

        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cfg = self.config
        configure_cpu_threads(cfg.num_threads)
        ctx = zmq.Context()
        steps = ctx.socket(zmq.SUB)
        steps.setsockopt(zmq.LINGER, 0)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        steps.connect(cfg.endpoints.step)
        results = ctx.socket(zmq.PUSH)
        results.setsockopt(zmq.LINGER, 0)
        results.connect(cfg.endpoints.result)
        heartbeat = HeartbeatThread(ctx, cfg.endpoints.result, cfg.rank, self.incarnation).start()
        try:
            runner = self._load()
            results.send(encode(self._ready(runner)))
            while not self.stopping:
                if not steps.poll(200):
                    continue
                try:
                    msg = decode(steps.recv())
                except DecodeError as exc:
                    self.log.warning("dropped a bad frame", error=str(exc))
                    continue
                if isinstance(msg, Step) and msg.epoch == self.epoch:
                    result = self._execute(runner, msg)
                    if cfg.rank == 0:
                        results.send(encode(result))
                elif isinstance(msg, Hello) and msg.epoch != self.epoch:
                    results.send(encode(self._answer_new_scheduler(runner, msg.epoch)))
                elif isinstance(msg, Shutdown):
                    self.log.info("shutdown requested", reason=msg.reason)
                    break
        finally:
            self.log.info("executor stopping")
            heartbeat.stop()
            ctx.destroy(linger=0)

    def _ready(self, runner) -> ExecutorReady:
        cfg = self.config
        return ExecutorReady(cfg.rank, cfg.world_size, runner.num_blocks, runner.block_size, runner.max_model_len,
                             runner.num_cpu_blocks, model=self._model_name, incarnation=self.incarnation,
                             pid=os.getpid(), epoch=self.epoch)

    def _answer_new_scheduler(self, runner, epoch: int) -> ExecutorReady:
        """A scheduler we have not answered: forget every sequence (it knows none), say ready."""
        if self._request_ids or self.epoch:
            self.log.info("new scheduler: dropping every sequence", epoch=epoch, num_sequences=len(self._request_ids))
        runner.forget_sequences()
        self._request_ids.clear()
        self.epoch = epoch
        return self._ready(runner)

    def _execute(self, runner, step: Step) -> StepResult:
        for seq_id in step.finished_seq_ids:
            request_id = self._request_ids.pop(seq_id, None)
            self.log.info("sequence freed", request_id=request_id, seq_id=seq_id)
        for new in step.new_seqs:
            self._request_ids[new.seq_id] = new.request_id
            self.log.info("sequence started", request_id=new.request_id, seq_id=new.seq_id)
        try:
            return runner.execute(step)
        except Exception as exc:  # a failed step fails its requests, not the process
            self.log.error("step failed", step_id=step.step_id, error=repr(exc), traceback=traceback.format_exc())
            import numpy as np

            empty = np.zeros(0, np.int64)
            return StepResult(step.step_id, empty, empty, error=repr(exc))

    def _on_signal(self, signum, _frame) -> None:
        self.log.info("signal received", signal=signal.Signals(signum).name)
        self.stopping = True


def run_executor(config: ExecutorConfig) -> None:
    ExecutorProcess(config).run()
