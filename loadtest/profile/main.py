"""Where one engine step's time goes, beside the time of its matmuls alone.

    python -m loadtest.profile [--dtype auto|float32|bfloat16] [--steps 10] [--context 256]

Runs SmolLM2 (or ``--model``) in one process through the product's own pieces, as the server's
lock-step loop does: ``Scheduler.schedule``, the ``Step`` encoded, sent over a ZeroMQ ipc socket
and decoded, ``ModelRunner.execute``, the ``StepResult`` back the same way, ``Scheduler.update``,
and the pass's outputs for the frontend encoded (one ``RequestOutputs`` frame, as the scheduler
sends them). Scenarios: decode batches of 1, 16 and
64 at ``--context`` tokens, and a mixed step (a fresh ``--prefill``-token prompt, or
``--prefill-prompts`` prompts of varied lengths summing to it as in a chunk of a burst of requests,
plus ``--prefill-decodes`` decodes). The cache is filled with noise instead of being prefilled (the
runner's bookkeeping runs, the model does not), so that setting up costs seconds.

For each scenario it prints the median per step of: scheduling, messages, and in the executor the
matmuls, attention, norms, rotary, the other per-layer ops, the LM head, sampling and the runner's
own work (``loadtest/profile/step_timer.py`` times them with wrappers installed from outside; the product
carries no timing code); then the matmul roofline (``loadtest/profile/costs.py``) and the ratio of
the step to it. The roofline's passes run between the measured steps (``--roofline-repeats`` after
each), so that it is timed in the same minutes as the steps on a machine whose speed moves: the table
gives the step's median over the best pass, and the median (and range) of each step over the best
pass timed right after it. Last, the frontend's CPU cost per 1000 output tokens (output frames,
detokenization, SSE chunks). Figures from a machine shared with other work are noisy: compare
ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Callable

from shared.cpu_threads import configure_cpu_threads

from .report import format_frontend, format_table, header, write_json


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _NoMaths:
    """Stands in for the model while the cache is "prefilled": the runner's bookkeeping runs (new
    sequences, histories, sampling), the forward pass does not; logits are noise."""

    def __init__(self, model) -> None:
        import torch

        self._torch, self.max_model_len = torch, model.max_model_len
        self._hidden, self._vocab = model.config.hidden_size, model.config.vocab_size

    def __call__(self, input_ids, positions, kv_caches, meta, backend):
        return self._torch.zeros(len(input_ids), self._hidden)

    def compute_logits(self, hidden):
        return self._torch.randn(hidden.shape[0], self._vocab)


class StepBench:
    """A scheduler over ``runner``'s pool, stepping it with every message through the wire."""

    def __init__(self, runner, max_num_seqs: int, max_num_batched_tokens: int, clock=time.perf_counter_ns) -> None:
        import zmq

        from services.scheduler.block_manager import BlockManager
        from services.scheduler.scheduler import Scheduler, SchedulerConfig

        from .step_timer import RegionTimer, install

        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, runner.max_model_len),
                                   self.blocks)
        self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-profile-")
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        endpoint = f"ipc://{self._dir.name}/step"
        self._pull.bind(endpoint)
        self._push.connect(endpoint)
        self.timer = RegionTimer(clock)
        self._install = lambda: install(runner, self.timer)
        self._num_requests = 0
        self._rng = __import__("random").Random(0)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
        self._dir.cleanup()

    def add_requests(self, num_requests: int, num_prompt_tokens: int) -> list[str]:
        """Queue requests with prompts of random tokens (no prefix-cache hits), greedy, long."""
        import numpy as np

        from shared.messages import AddRequest, SamplingParams

        vocab = self.runner.model.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=self.runner.max_model_len, ignore_eos=True)
        ids = []
        for _ in range(num_requests):
            request_id = f"profile-{self._num_requests}"
            self._num_requests += 1
            prompt = np.array([self._rng.randrange(100, vocab) for _ in range(num_prompt_tokens)], np.int32)
            self.scheduler.add_request(AddRequest(request_id, prompt, params, time.time()))
            ids.append(request_id)
        return ids

    def prefill_without_maths(self) -> None:
        """Step until every running sequence decodes, with the forward pass replaced by noise."""
        model = self.runner.model
        self.runner.model = _NoMaths(model)
        try:
            while self.scheduler.waiting or any(s.num_pending_tokens > 1 for s in self.scheduler.running):
                self.scheduler.update(self.runner.execute(self.scheduler.schedule()))
                self.scheduler.take_outputs()
        finally:
            self.runner.model = model

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
        self.scheduler.take_outputs()

    def timed_step(self) -> dict[str, int]:
        """One step through the whole loop; ns per part (``step_timer.breakdown`` and ours)."""
        from shared.messages import RequestOutputs, decode, encode

        from .step_timer import breakdown

        clock = self.timer.clock
        uninstall = self._install()
        try:
            t0 = clock()
            step = self.scheduler.schedule()
            t1 = clock()
            step = self._send(step)
            t2 = clock()
            result = self.runner.execute(step)
            t3 = clock()
            result = self._send(result)
            t4 = clock()
            self.scheduler.update(result)
            outputs = self.scheduler.take_outputs()
            t5 = clock()
            frame = encode(RequestOutputs(outputs))  # one frontend: one frame per pass
            t6 = clock()
        finally:
            uninstall()
        sent = decode(frame).outputs
        assert sent and all(o.error is None for o in sent)
        parts = breakdown(self.timer.take())
        parts.update(scheduler=(t1 - t0) + (t5 - t4), messages=(t2 - t1) + (t4 - t3) + (t6 - t5))
        return parts

    def _send(self, message):
        from shared.messages import decode, encode

        self._push.send(encode(message))
        return decode(self._pull.recv())


def run_scenario(bench: StepBench, label: str, num_decodes: int, context: int, prompt_lengths: tuple[int, ...],
                 warmup: int, steps: int, after_step: Callable[[], None] | None = None) -> list[dict[str, int]]:
    """``num_decodes`` sequences at ``context`` tokens, decoding; fresh prompts of
    ``prompt_lengths`` tokens (none for a decode step) join every step (and are aborted after it).
    ``after_step``: called after each measured step (the roofline passes of its moment)."""
    say(f"  {label}: filling the cache of {num_decodes} sequence(s) with {context} tokens")
    decoding = bench.add_requests(num_decodes, context)
    bench.prefill_without_maths()
    samples = []
    for i in range(warmup + steps):
        say(f"  {label}: step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}")
        fresh = [rid for length in prompt_lengths for rid in bench.add_requests(1, length)]
        parts = bench.timed_step()
        bench.abort(fresh)
        if i >= warmup:
            samples.append(parts)
            if after_step is not None:
                after_step()
    bench.abort(decoding)
    return samples


def build(model: str | None, dtype_name: str, num_blocks: int, max_model_len: int, linear_kernel: str = "auto",
          device_name: str = "cpu"):
    """(runner, dtype choice, model source) with the KV pool filled with noise."""
    from services.executor.device import resolve_device
    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.weights import load_hf_config, load_state_dict, resolve_dtype
    from shared.model_source import resolve_model

    source = resolve_model(model)
    device = resolve_device(device_name)
    choice = resolve_dtype(dtype_name, device)
    say(f"loading {source.name} in {choice.dtype} ({choice.reason}) on {device}")
    options = RunnerOptions(dtype=choice.dtype, num_kv_blocks=num_blocks, num_cpu_blocks=0, device=str(device),
                            max_model_len=max_model_len, linear_kernel=linear_kernel)
    runner = build_runner(load_hf_config(source), load_state_dict(source), options)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.normal_()
        value_cache.normal_()
    return runner, choice, source


def synchronized(clock: Callable[[], int]) -> Callable[[], int]:
    """``clock`` read after the GPU's queued work is done: a region timed with it holds its kernels'
    time, not only their launches' (which serializes host and GPU: the regions sum to more than an
    unsynchronized step would take)."""
    import torch

    def read() -> int:
        torch.cuda.synchronize()
        return clock()

    return read


def scenarios(args) -> list[tuple[str, int, tuple[int, ...]]]:
    """(label, decodes, lengths of the fresh prompts) per column."""
    cols = [(f"decode {b}", b, ()) for b in args.batches]
    if args.prefill:
        prompts = "" if args.prefill_prompts == 1 else f" in {args.prefill_prompts}"
        cols.append((f"prefill {args.prefill}{prompts} + {args.prefill_decodes} dec", args.prefill_decodes,
                     split_prompt(args.prefill, args.prefill_prompts)))
    return cols


def split_prompt(total: int, num_prompts: int, seed: int = 0) -> tuple[int, ...]:
    """``total`` prompt tokens as ``num_prompts`` prompts of varied lengths (at least 1 each; cut at
    random points, the same for a seed), as a burst of requests of different lengths arrives."""
    if not 1 <= num_prompts <= total:
        raise ValueError(f"cannot split {total} tokens into {num_prompts} prompts")
    cuts = sorted(random.Random(seed).sample(range(1, total), num_prompts - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


def measure(args) -> tuple[dict, list]:
    """Run every scenario; returns (header facts, [(label, parts, roofline)])."""
    import torch

    from services.executor.linear import linear_kernel_name
    from services.executor.thread_tuner import thread_tuner_for

    from .costs import RooflinePasses, median_parts, roofline_of

    cols = scenarios(args)
    max_seqs = max(n + len(lengths) for _, n, lengths in cols)
    per_seq = -(-(args.context + args.warmup + args.steps + 2) // 16)
    num_blocks = max_seqs * per_seq + sum(-(-length // 16) for _, _, lengths in cols for length in lengths) + 8
    runner, choice, source = build(args.model, args.dtype, num_blocks, args.context + args.prefill + 64,
                                   args.linear_kernel, args.device)
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns
    if runner.device.type == "cuda":
        clock = synchronized(clock)
    # the backend set up as a server's executor sets it (attention partitions, row kernels), though
    # every step here runs on all the threads: no tuner chooses them
    _, tuning = thread_tuner_for(runner, torch.get_num_threads(), 1)
    kernel = linear_kernel_name(runner.model)  # the roofline times the engine's kernel
    bench = StepBench(runner, max_seqs, max(2048, args.prefill + args.prefill_decodes), clock)
    results = []
    try:
        for label, num_decodes, lengths in cols:
            say(f"  {label}: the matmul roofline's weights")
            roofline = RooflinePasses(runner.model.config, choice.dtype, num_decodes + sum(lengths),
                                      num_decodes + len(lengths), kernel=kernel, device=runner.device)
            passes: list[list[tuple[int, int]]] = []
            samples = run_scenario(
                bench, label, num_decodes, args.context, lengths, args.warmup, args.steps,
                after_step=lambda: passes.append([roofline.time_pass(clock) for _ in range(args.roofline_repeats)]))
            del roofline
            roof = roofline_of(passes, [sum(parts.values()) for parts in samples])
            results.append((label, median_parts(samples), roof))
    finally:
        bench.close()
    backend = runner.backend
    facts = {"model": source.name, "dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason,
             "source": source, "backend": getattr(backend, "runs_for", lambda _: backend.name)(choice.dtype),
             "linear": kernel, "device": str(runner.device), "executor_setup": tuning,
             "prefill_kind": getattr(backend, "prefill_kind", lambda: backend.name)()}
    return facts, results


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="as the server's --model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn", "numba", "torch"],
                    help="the engine's --linear-kernel (services/executor/linear.py)")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64],
                    help="decode batch sizes, comma-separated (default 1,16,64)")
    ap.add_argument("--context", type=int, default=256, help="tokens in each decoding sequence's cache")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the mixed step (0: no mixed step)")
    ap.add_argument("--prefill-decodes", type=int, default=32, help="decodes beside the prefill in the mixed step")
    ap.add_argument("--prefill-prompts", type=int, default=1,
                    help="prompts the mixed step's --prefill tokens are split into, of varied lengths (default 1; "
                         "e.g. --prefill 2032 --prefill-prompts 15, a chunk of a burst of chat requests)")
    ap.add_argument("--steps", type=int, default=10, help="steps measured per scenario")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and not measured")
    ap.add_argument("--roofline-repeats", type=int, default=1,
                    help="passes of the matmul roofline timed after each measured step (default 1): the "
                         "roofline is the best of them all, and each step is also set against the passes "
                         "of its own moment")
    ap.add_argument("--num-threads", type=int, default=None, help="as the executor's --num-threads")
    ap.add_argument("--device", default="cpu", metavar="{auto,cpu,cuda,cuda:N}",
                    help="as the executor's --device (default cpu); on a GPU every timed region starts and "
                         "ends with torch.cuda.synchronize, so that each holds its kernels' time")
    ap.add_argument("--json", default=None, help="also write the medians (ms) to this file")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or the process's CPU time (steadier on a busy machine, with "
                         "--num-threads 1)")
    args = ap.parse_args(argv)
    if args.prefill and not 1 <= args.prefill_prompts <= args.prefill:
        ap.error(f"--prefill-prompts must be between 1 and --prefill ({args.prefill}), got {args.prefill_prompts}")
    if args.steps < 1 or args.context < 1 or min(args.batches) < 1 or args.roofline_repeats < 1:
        ap.error(f"--steps, --context, --batches and --roofline-repeats must be positive, got {args.steps}, "
                 f"{args.context}, {args.batches}, {args.roofline_repeats}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = configure_cpu_threads(args.num_threads)  # before torch is imported
    load_before = os.getloadavg()
    t0 = time.monotonic()
    facts, results = measure(args)
    facts["threads_reason"] = threads.reason
    facts["openmp"] = threads.openmp
    say("  frontend: detokenization and SSE chunks")
    from shared.model_source import load_tokenizer

    from .costs import frontend_costs

    costs = frontend_costs(load_tokenizer(facts["source"]))
    print(header(facts, args, load_before))
    print()
    print(format_table(facts, results, args))
    print()
    print(format_frontend(costs, results))
    if args.json:
        write_json(args.json, facts, results, costs)
    say(f"done in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
