"""The executor process: one rank of the executor group. Joins the group, loads its shard of the
model and its KV pools, then runs every ``Step`` it is sent.

Sockets (connected here): ``step`` SUB (scheduler -> all ranks), ``result`` PUSH (-> scheduler),
and a second PUSH to ``result`` for the heartbeat thread (``heartbeat``), which beats from start-up.
Rank 0 samples and replies with a ``StepResult``; the other ranks run the same steps and do not
reply. With ``--zmq-curve`` all three are CURVE clients of the scheduler (``shared.zmq_auth``).
The main loop also touches the rank's heartbeat file (``shared.heartbeat_file``, for container
healthchecks) before and after every step.

Handshake: once loaded, the rank says ``ExecutorReady`` unasked (epoch 0: a scheduler that knew an
earlier process of this rank learns it was replaced), then answers the first ``Hello`` of every
scheduler epoch with ``ExecutorReady`` again (its KV blocks and their bytes, model, pid). A new
epoch is a new scheduler, which knows none of the sequences this process held: they are dropped,
and so is any step of another epoch (a dead scheduler's). ``incarnation`` (random per process)
tells the scheduler which process of the rank is talking.

Failure in a group of more than one rank: a step that raises on one rank cannot be finished by the
others (they wait in its collectives), so the rank aborts the group with the reason (its peers'
collectives raise ``GroupError`` naming it) and exits with code 1; a rank whose communicator
reports a failed peer exits with ``EXIT_PEER_FAILED``, and one that a scheduler's ``Hello`` names
as retired (its group was lost) with ``EXIT_RETIRED``. The supervisor then restarts the whole
group, and the scheduler starts every sequence over on it. With one rank a failed step only fails
its requests. The communicator is closed on every way out.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import signal
import time
import traceback

from shared.heartbeat_file import HeartbeatFile
from shared.logging import configure_logging
from shared.messages import DecodeError, ExecutorReady, Hello, Shutdown, Step, StepResult, decode, encode
from shared.model_source import resolve_model
from shared.openmp import loaded_runtimes
from shared.cpu_threads import configure_cpu_threads
from shared.zmq_auth import load_keys, log_mode, secure_client

from .process_config import ExecutorConfig


EXIT_PEER_FAILED = 3  # this rank stopped because another rank of its group failed
EXIT_RETIRED = 4  # the scheduler gave this process up (its group was lost): a new one must replace it


class StepFailed(Exception):
    """A step raised on this rank of a group of more than one: the group cannot go on."""


class ExecutorProcess:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.log = configure_logging("executor").bind(rank=config.rank)
        self.stopping = False
        self.incarnation = secrets.randbits(62) + 1  # nonzero; new for every executor process
        self.epoch = 0  # of the scheduler this process answered last
        self._request_ids: dict[int, str] = {}  # seq_id -> request_id, for logs
        self._run_step = None  # runner.execute on the threads thread_tuner.py chooses, once loaded
        self.curve = load_keys(config.zmq_curve, "executor") if config.zmq_curve else None
        log_mode(self.log, self.curve)

    def _load(self):
        """Join the group (every rank must), then load this rank's shard; returns (comm, runner)."""
        import torch

        from .device import device_summary, resolve_device
        from .guided import load_vocabulary
        from .kv_cache import kv_storage
        from .loader import build_runner, plan_runner, shard_plan
        from .parallel.group import open_group
        from .weights import load_hf_config, load_weights, resolve_dtype

        cfg = self.config
        source = resolve_model(cfg.model)
        self._model_name = source.name
        device = resolve_device(cfg.device, cfg.rank if cfg.device_index is None else cfg.device_index)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device of torch's allocator and streams, and numba's
        self.log.info("device chosen", requested=cfg.device, **device_summary(device))
        choice = resolve_dtype(cfg.dtype, device)
        self.log.info("dtype chosen", requested=cfg.dtype, dtype=str(choice.dtype), reason=choice.reason,
                      **choice.cpu)
        options = dataclasses.replace(cfg.runner_options(), dtype=choice.dtype, device=str(device))
        t0 = time.monotonic()
        comm = open_group(cfg.group_config(), device)
        self.log.info("loading model", model=source.name, path=source.directory, dtype=str(options.dtype),
                      world_size=comm.world_size, all_reduce=comm.kind)
        try:
            hf_config = load_hf_config(source)
            group = comm if comm.world_size > 1 else None
            # Before the weights are read: a model or pool too big for this machine is refused in one line.
            plan = plan_runner(hf_config, options, f"the executor ({source.name})", shard_plan(hf_config, group))
            state, quantization = load_weights(source, hf_config, cfg.quantization, device.type)
            self.log.info("quantization chosen", requested=cfg.quantization, chosen=quantization.mode,
                          reason=quantization.reason)
            runner = build_runner(hf_config, state, options, plan, group)
            self.log.info("kv cache dtype chosen", requested=cfg.kv_cache_dtype, kv_cache_dtype=runner.kv_cache_dtype,
                          reason=kv_storage(cfg.kv_cache_dtype, choice.dtype).reason, num_blocks=runner.num_blocks,
                          block_bytes=plan.block_bytes)
        except BaseException as exc:
            comm.abort(f"rank {cfg.rank} could not load the model: {exc!r}")
            comm.close()
            raise
        runner.sampler.guided.load_vocabulary = functools.partial(load_vocabulary, cfg.tokenizer, source,
                                                                 runner.model.config.vocab_size, self.log)
        from .linear import linear_kernel_name  # torch is imported by now
        from .quantized import weights_summary

        backend = runner.backend
        self.log.info("model loaded", architecture=type(runner.model).__name__,
                      seconds=round(time.monotonic() - t0, 1), num_blocks=runner.num_blocks,
                      kv_cache_mib=round(runner.kv_cache_bytes / 2**20, 1),
                      attention_backend=getattr(backend, "runs_for", lambda _: backend.name)(options.dtype),
                      prefill_attention=getattr(backend, "prefill_kind", lambda: backend.name)(),
                      linear_kernel=linear_kernel_name(runner.model), max_model_len=runner.max_model_len, num_cpu_blocks=runner.num_cpu_blocks,
                      world_size=comm.world_size, all_reduce=comm.kind,
                      num_kv_heads=runner.model.plan.num_local_kv_heads, num_heads=runner.model.plan.num_local_heads,
                      **weights_summary(runner.model))
        return comm, runner

    def _warm_up(self, runner) -> None:
        """A throw-away prefill and decode (``warmup.py``), so the first request does not pay for
        loading the kernels."""
        from .warmup import warm_up

        t0 = time.monotonic()
        num_steps = warm_up(runner)
        self.log.info("warmed up", steps=num_steps, seconds=round(time.monotonic() - t0, 2),
                      openmp_runtimes=loaded_runtimes())

    def _ready(self, runner, comm) -> ExecutorReady:
        cfg = self.config
        return ExecutorReady(cfg.rank, cfg.world_size, runner.num_blocks, runner.block_size, runner.max_model_len,
                             runner.num_cpu_blocks, model=self._model_name, incarnation=self.incarnation,
                             pid=os.getpid(), epoch=self.epoch, all_reduce=comm.kind,
                             kv_cache_bytes=runner.kv_cache_bytes, sliding_window=runner.model.freeable_window,
                             kv_cache_dtype=runner.kv_cache_dtype,
                             **(runner.offload.ready_fields() if runner.offload is not None else {}))

    def _answer_new_scheduler(self, runner, comm, epoch: int) -> ExecutorReady:
        """A scheduler we have not answered: forget every sequence (it knows none), say ready."""
        if self._request_ids or self.epoch:
            self.log.info("new scheduler: dropping every sequence", epoch=epoch, num_sequences=len(self._request_ids))
        runner.forget_sequences()
        self._request_ids.clear()
        self.epoch = epoch
        return self._ready(runner, comm)

    def run(self) -> int:
        """Serve steps until Shutdown or a signal; returns the exit code."""
        import zmq

        from .heartbeat_sender import HeartbeatThread
        from .parallel.base import GroupError

        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cfg = self.config
        # ipc:// endpoints: the scheduler (and so the frontend) runs on this machine
        threads = configure_cpu_threads(cfg.num_threads, colocated=cfg.endpoints.step.startswith("ipc://"))
        self.log.info("cpu threads", num_threads=threads.num_threads, reason=threads.reason,
                      openmp=threads.openmp)
        ctx = zmq.Context()
        steps = ctx.socket(zmq.SUB)
        steps.setsockopt(zmq.LINGER, 0)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        secure_client(steps, self.curve)
        steps.connect(cfg.endpoints.step)
        results = ctx.socket(zmq.PUSH)
        results.setsockopt(zmq.LINGER, 0)
        secure_client(results, self.curve)
        results.connect(cfg.endpoints.result)
        beats = HeartbeatThread(ctx, cfg.endpoints.result, cfg.rank, self.incarnation, curve=self.curve).start()
        heartbeat_file = HeartbeatFile(f"executor-{cfg.rank}")  # removes a stale file; beats once loaded
        comm = None
        try:
            try:
                comm, runner = self._load()
                self._warm_up(runner)
            except Exception as exc:
                if (refusal := out_of_memory_at_start(exc)) is not None:
                    raise refusal from exc  # exit 2: restarting will not make room
                raise
            from .thread_tuner import step_runner

            self._run_step = step_runner(runner, threads.num_threads, cfg.world_size, cfg.adaptive_threads, self.log)
            results.send(encode(self._ready(runner, comm)))
            return self._serve(runner, comm, steps, results, heartbeat_file)
        except StepFailed as exc:
            comm.abort(str(exc))  # the peers' collectives now fail naming this rank
            self.log.error("executor group stopped: this rank's step failed", error=str(exc))
            return 1
        except GroupError as exc:
            self.log.error("executor group failed", error=str(exc), blamed_rank=exc.rank)
            return 1 if exc.rank == cfg.rank else EXIT_PEER_FAILED
        finally:
            if comm is not None:
                comm.close()
            self.log.info("executor stopping")
            beats.stop()
            ctx.destroy(linger=0)

    def _serve(self, runner, comm, steps, results, heartbeat_file: HeartbeatFile) -> int:
        """Run steps and answer schedulers until Shutdown or a signal (0), or until the scheduler
        says it gave this process up (``EXIT_RETIRED``)."""
        cfg = self.config
        while not self.stopping:
            heartbeat_file.beat()  # before and after every step: only one step longer than the max age fails
            if not steps.poll(200):
                continue
            try:
                msg = decode(steps.recv())
            except DecodeError as exc:
                self.log.warning("dropped a bad frame", error=str(exc))
                continue
            if isinstance(msg, Step) and msg.epoch == self.epoch:
                result = self._execute(runner, msg)
                heartbeat_file.beat()
                if cfg.rank == 0:
                    results.send(encode(result))
            elif isinstance(msg, Hello) and self.incarnation in msg.retired_incarnations:
                self.log.warning("the scheduler gave this process up (its group was lost); exiting to be replaced",
                                 epoch=msg.epoch)
                return EXIT_RETIRED
            elif isinstance(msg, Hello) and msg.epoch != self.epoch:
                results.send(encode(self._answer_new_scheduler(runner, comm, msg.epoch)))
            elif isinstance(msg, Shutdown):
                self.log.info("shutdown requested", reason=msg.reason)
                break
        if runner.offload is not None:
            runner.offload.flush()  # the block files being written: a restart finds them
        return 0

    def _execute(self, runner, step: Step) -> StepResult:
        for seq_id in step.finished_seq_ids:
            request_id = self._request_ids.pop(seq_id, None)
            self.log.info("sequence freed", request_id=request_id, seq_id=seq_id)
        for new in step.new_seqs:
            self._request_ids[new.seq_id] = new.request_id
            self.log.info("sequence started", request_id=new.request_id, seq_id=new.seq_id)
        from .parallel.base import GroupError

        try:
            return (self._run_step or runner.execute)(step)
        except GroupError:
            raise
        except Exception as exc:  # with one rank, a failed step fails its requests, not the process
            self.log.error("step failed", step_id=step.step_id, error=repr(exc), traceback=traceback.format_exc())
            if self.config.world_size > 1:
                raise StepFailed(f"step {step.step_id} raised {exc!r}") from exc
            runner.sampled.forget_failed(step)
            import numpy as np

            empty = np.zeros(0, np.int64)
            return StepResult(step.step_id, empty, empty, error=repr(exc))

    def _on_signal(self, signum, _frame) -> None:
        self.log.info("signal received", signal=signal.Signals(signum).name)
        self.stopping = True


def out_of_memory_at_start(exc: BaseException) -> ValueError | None:
    """A configuration error (one line) for a GPU that ran out of memory while the model loaded or
    warmed up (``torch.OutOfMemoryError``); None for any other exception."""
    if type(exc).__name__ != "OutOfMemoryError":
        return None
    said = " ".join(str(exc).split())
    said = said if len(said) <= 160 else said[:157] + "..."
    return ValueError(f"out of GPU memory while loading the model or warming up ({said}); lower "
                      "--kv-cache-memory, --max-num-batched-tokens or --max-model-len")


def run_executor(config: ExecutorConfig) -> int:
    """Run one executor rank; returns its exit code."""
    return ExecutorProcess(config).run()
