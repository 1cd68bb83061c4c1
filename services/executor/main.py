"""The executor process: loads the model and the KV pool, then runs every ``Step`` it is sent.

Sockets (connected here): ``step`` SUB (scheduler -> all ranks), ``result`` PUSH (-> scheduler).
Rank 0 samples and replies with a ``StepResult``; other ranks (tensor parallelism, later) only run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.endpoints import Endpoints
from shared.heartbeat import Heartbeat
from shared.logging import configure_logging
from shared.messages import DecodeError, ExecutorReady, Hello, HelloAck, Shutdown, Step, StepResult, decode, encode
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
        self._request_ids: dict[int, str] = {}  # seq_id -> request_id, for logs

    def _load(self):
        import torch

        from .loader import build_runner, plan_runner
        from .weights import load_hf_config, load_state_dict, resolve_dtype

        source = resolve_model(self.config.model)
        choice = resolve_dtype(self.config.dtype, torch.device(self.config.device))
        self.log.info("dtype chosen", requested=self.config.dtype, dtype=str(choice.dtype), reason=choice.reason,
                      **choice.cpu)
        options = dataclasses.replace(self.config.runner_options(), dtype=choice.dtype)
        t0 = time.monotonic()
        self.log.info("loading model", model=source.name, path=source.directory, dtype=str(options.dtype))
        hf_config = load_hf_config(source)
        # Before the weights are read: a model or pool too big for this machine is refused in one line.
        plan = plan_runner(hf_config, options, f"the executor ({source.name})")
        runner = build_runner(hf_config, load_state_dict(source), options, plan)
        self.log.info("model loaded", seconds=round(time.monotonic() - t0, 1), num_blocks=runner.num_blocks,
                      kv_cache_mib=round(runner.kv_cache_bytes / 2**20), attention_backend=runner.backend.name,
                      max_model_len=runner.max_model_len, num_cpu_blocks=runner.num_cpu_blocks)
        return runner

    def run(self) -> None:
        import zmq

        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cfg = self.config
        # ipc:// endpoints: the scheduler (and so the frontend) runs on this machine
        threads = configure_cpu_threads(cfg.num_threads, colocated=cfg.endpoints.step.startswith("ipc://"))
        self.log.info("cpu threads", num_threads=threads.num_threads, reason=threads.reason,
                      omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
        ctx = zmq.Context()
        steps = ctx.socket(zmq.SUB)
        steps.setsockopt(zmq.LINGER, 0)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        steps.connect(cfg.endpoints.step)
        results = ctx.socket(zmq.PUSH)
        results.setsockopt(zmq.LINGER, 0)
        results.connect(cfg.endpoints.result)
        heartbeat = Heartbeat(f"executor-{cfg.rank}")  # removes a stale file; beats once loaded
        try:
            runner = self._load()
            results.send(encode(ExecutorReady(cfg.rank, cfg.world_size, runner.num_blocks, runner.block_size,
                                              runner.max_model_len, runner.num_cpu_blocks)))
            while not self.stopping:
                heartbeat.beat()  # before and after every step: only one step longer than the max age fails
                if not steps.poll(200):
                    continue
                try:
                    msg = decode(steps.recv())
                except DecodeError as exc:
                    self.log.warning("dropped a bad frame", error=str(exc))
                    continue
                if isinstance(msg, Step):
                    result = self._execute(runner, msg)
                    heartbeat.beat()
                    if cfg.rank == 0:
                        results.send(encode(result))
                elif isinstance(msg, Hello):
                    results.send(encode(HelloAck(cfg.rank, msg.nonce)))
                elif isinstance(msg, Shutdown):
                    self.log.info("shutdown requested", reason=msg.reason)
                    break
        finally:
            self.log.info("executor stopping")
            ctx.destroy(linger=0)

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
