"""What sliding-window block freeing buys, in the block manager and scheduler alone (no model).

    python -m loadtest.memory.sliding_window [--window 256] [--block-size 16] [--num-blocks 512] [--num-seqs 24]

Prints figures only (no assertions):
1. the most blocks one sequence holds while it grows to a context of 4W, with the window's blocks
   freed and without (the whole context);
2. at the same pool, how many sequences can hold a context of 4W at once (each grown in chunks, as
   a chunked prefill does, until the pool is full), window freeing on and off;
3. a stream of ``--num-seqs`` requests generating to 4W through the scheduler (one token per
   sequence per step, recompute preemption): steps, most sequences running, preemptions.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sliding_window import NULL_BLOCK, max_live_blocks
from shared.messages import AddRequest, SamplingParams, StepResult

PROMPT, CHUNK = 32, 256


def _live(bm: BlockManager, seq_id: int) -> int:
    return sum(b != NULL_BLOCK for b in bm.block_tables.get(seq_id, ()))


def max_blocks_one_sequence(window: int, block_size: int, context: int) -> int:
    """The most blocks a sequence holds while decoding one token at a time to ``context``."""
    bm = BlockManager(-(-context // block_size) + 1, block_size, watermark=0.0, sliding_window=window)
    peak = 0
    for n in range(context):
        bm.free_out_of_window(0, n)
        assert bm.allocate_slots(0, n + 1, n)
        peak = max(peak, _live(bm, 0))
    return peak


def sequences_that_fit(window: int, block_size: int, num_blocks: int, context: int) -> int:
    """How many sequences reach ``context`` tokens at once in ``num_blocks``, each grown in chunks
    of ``CHUNK`` tokens (its window trimmed before each) until one no longer fits."""
    bm = BlockManager(num_blocks, block_size, watermark=0.0, sliding_window=window)
    for seq_id in itertools.count():
        for n in range(0, context, CHUNK):
            bm.free_out_of_window(seq_id, n)
            if not bm.allocate_slots(seq_id, min(n + CHUNK, context), n):
                return seq_id
        bm.free_out_of_window(seq_id, context)  # it holds the window of its next query only
    raise AssertionError("unreachable")


def stream(window: int, block_size: int, num_blocks: int, num_seqs: int, context: int) -> dict[str, float]:
    """``num_seqs`` requests of ``PROMPT`` tokens generating to ``context`` through the scheduler."""
    bm = BlockManager(num_blocks, block_size, watermark=0.0, enable_prefix_caching=False, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=CHUNK,
                                      max_model_len=context + 1), bm)
    params = SamplingParams(temperature=0.0, max_tokens=context - PROMPT, ignore_eos=True)
    for i in range(num_seqs):
        sched.add_request(AddRequest(f"r{i}", np.full(PROMPT, 1 + i, np.int32), params, float(i)))
    steps, start = 0, time.perf_counter()
    while sched.has_work():
        step = sched.schedule()
        sampled = step.seq_ids[step.sample_mask]
        sched.update(StepResult(step.step_id, sampled, np.full(len(sampled), 7, np.int64)))
        sched.take_outputs()
        steps += 1
    return {"steps": steps, "max_running": sched.stats.max_num_running,
            "preemptions": sched.stats.num_preemptions, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256, help="W, tokens every layer attends back")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--num-seqs", type=int, default=24, help="requests in the scheduler stream")
    args = parser.parse_args(argv)
    w, bs, n = args.window, args.block_size, args.num_blocks
    context = 4 * w
    print(f"window W={w} tokens, {bs}-token blocks, pool {n} blocks ({n * bs} slots), context 4W={context}")
    on, off = max_blocks_one_sequence(w, bs, context), max_blocks_one_sequence(0, bs, context)
    print(f"\nmost blocks one sequence holds (decoding to {context}):")
    print(f"  window freeing on:  {on:>5}  (bound ceil((W + bs - 1) / bs) = {max_live_blocks(w, bs)})")
    print(f"  window freeing off: {off:>5}  ({off / on:.1f}x)")
    fit_on, fit_off = sequences_that_fit(w, bs, n, context), sequences_that_fit(0, bs, n, context)
    print(f"\nsequences holding a context of {context} at once in {n} blocks (grown in {CHUNK}-token chunks):")
    print(f"  window freeing on:  {fit_on:>5}")
    print(f"  window freeing off: {fit_off:>5}  (on / off: {fit_on / max(fit_off, 1):.1f}x)")
    print(f"\n{args.num_seqs} requests of {PROMPT} prompt tokens generating to {context} through the scheduler:")
    print(f"  {'':20}{'steps':>8}{'max running':>13}{'preemptions':>13}{'sim seconds':>13}")
    for label, window in (("window freeing on", w), ("window freeing off", 0)):
        r = stream(window, bs, n, args.num_seqs, context)
        print(f"  {label:20}{r['steps']:>8}{r['max_running']:>13}{r['preemptions']:>13}{r['seconds']:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
