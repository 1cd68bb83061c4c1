"""The executor process: loads the model and the KV pool, then runs every ``Step`` it is sent.

Sockets (connected here): ``step`` SUB (scheduler -> all ranks), ``result`` PUSH (-> scheduler).
Rank 0 samples and replies with a ``StepResult``; other ranks (tensor parallelism, later) only run.
"""

from __future__ import annotations

import signal
import time
import traceback
from dataclasses import dataclass

from shared.endpoints import Endpoints
from shared.heartbeat import Heartbeat
from shared.logging import configure_logging
from shared.messages import DecodeError, ExecutorReady, Hello, HelloAck, Shutdown, Step, StepResult, decode, encode
from shared.model_source import resolve_model
from shared.threads import configure_cpu_threads

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"512m"``, ``"1.5g"`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"--kv-cache-memory: cannot read {text!r} (use e.g. 1GiB, 512MiB)")
    return int(float(num) * _UNITS[unit])


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
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"--num-kv-blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be greater than 1, got {self.max_model_len}")
        parse_bytes(self.kv_cache_memory)
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.world_size != 1:
            raise ValueError("--world-size > 1 (tensor parallelism) is not implemented yet")


class ExecutorProcess:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.log = configure_logging("executor").bind(rank=config.rank)
        self.stopping = False
        self._request_ids: dict[int, str] = {}  # seq_id -> request_id, for logs

    def _load(self):
        import torch

        from .attention import select_backend
        from .model import ModelConfig
        from .runner import ModelRunner, allocate_kv_cache, kv_block_bytes
        from .weights import build_model, load_hf_config, load_state_dict, resolve_dtype

        cfg = self.config
        device = torch.device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        source = resolve_model(cfg.model)
        t0 = time.monotonic()
        self.log.info("loading model", model=source.name, path=source.directory, dtype=str(dtype))
        hf_config = load_hf_config(source)
        max_model_len = min(cfg.max_model_len or hf_config.max_position_embeddings,
                            hf_config.max_position_embeddings)
        model = build_model(hf_config, load_state_dict(source), dtype, device, max_model_len)
        mcfg = ModelConfig.from_hf(hf_config)
        block_bytes = kv_block_bytes(mcfg, cfg.block_size, dtype)
        num_blocks = cfg.num_kv_blocks or parse_bytes(cfg.kv_cache_memory) // block_bytes
        if num_blocks <= 0:
            raise ValueError(f"--kv-cache-memory {cfg.kv_cache_memory} holds no block of {block_bytes} bytes")
        kv = allocate_kv_cache(mcfg, num_blocks, cfg.block_size, dtype, device)
        num_cpu_blocks = int(cfg.swap_space * 2**30) // block_bytes
        cpu_kv = allocate_kv_cache(mcfg, num_cpu_blocks, cfg.block_size, dtype, torch.device("cpu"))
        backend = select_backend(cfg.attention_backend, device)
        self.log.info("model loaded", seconds=round(time.monotonic() - t0, 1), num_blocks=num_blocks,
                      kv_cache_mib=round(num_blocks * block_bytes / 2**20), attention_backend=backend.name,
                      max_model_len=max_model_len, num_cpu_blocks=num_cpu_blocks)
        runner = ModelRunner(model, kv, backend, device, seed=cfg.seed, cpu_kv_caches=cpu_kv)
        return runner, max_model_len

    def run(self) -> None:
        import zmq

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
        heartbeat = Heartbeat(f"executor-{cfg.rank}")  # removes a stale file; beats once loaded
        try:
            runner, max_model_len = self._load()
            results.send(encode(ExecutorReady(cfg.rank, cfg.world_size, runner.num_blocks,
                                              cfg.block_size, max_model_len,
                                              len(runner.cpu_kv_caches[0][0]) if runner.cpu_kv_caches else 0)))
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
