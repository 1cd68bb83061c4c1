"""What the rate sweep should find if KV memory alone limited every policy: its capacity model.

The sweep's servers differ only in how a request holds KV memory, so when the pool, not the CPU,
is what runs out, the rate a policy sustains is proportional to how many requests the pool serves
per step. Two estimates, from the sweep's own request lengths, with no model and no clock:

- **memory-time**: the slots a request holds, summed over the steps it runs (one output token per
  step). Paged holds its prompt and the tokens so far, rounded up to whole blocks: at step ``t``,
  ``ceil(p + t)``; a reservation holds ``ceil(p + reserved)`` from its first step to its last (the
  exact output for Orca (Oracle), the next power of two for Pow2, the rest of the context for
  Max). A full pool serves requests at a rate inversely proportional to the mean, so
  ``E[policy] / E[paged]`` is the capacity ratio with perfect packing: no gaps between
  reservations, no queueing.
- **replay**: the same requests, all queued at once, through the engine's own ``Scheduler`` and
  block managers (``services/scheduler``: paged with recompute preemption, or contiguous first-fit
  runs, whose gaps are the external fragmentation, and first come first served, so a large request
  at the head waits for a large enough run), one token per running sequence per step, each request
  ending at its drawn length; requests finished per step until the queue is empty, and the mean
  number of sequences running. At a constant step time this is what the sweep measures.

On a CPU the step time is not constant: it grows with the batch and with the prompts recomputed
after preemptions, so the measured ratios fall short of the replay's by that much.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.sweep.load import Workload, max_tokens_for
from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import ContiguousBlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import AddRequest, SamplingParams, StepResult

NUM_REPLAY_REQUESTS = 300  # enough that the queue stays full for hundreds of steps
FILLER_TOKEN_ID = 5


@dataclass(frozen=True)
class Capacity:
    """One way of holding KV memory (``kv_policy`` and ``reservation``) in the model."""

    kv_policy: str  # "paged" or "contiguous"
    reservation: str  # "exact", "pow2" or "max" (sweep_load.max_tokens_for)
    mean_memory_time: float  # slots x steps per request, blocks rounded up
    requests_per_step: float  # replay: requests finished per step while the queue was not empty
    mean_running: float  # replay: sequences per step over the same span
    num_preemptions: int  # replay


def memory_time(kv_policy: str, reservation: str, num_prompt_tokens: int, num_output_tokens: int,
                max_model_len: int, block_size: int) -> int:
    """Slots x steps that one request holds (see the module docstring)."""
    def whole_blocks(num_tokens: int) -> int:
        return -(-num_tokens // block_size) * block_size

    if kv_policy == "paged":
        return sum(whole_blocks(num_prompt_tokens + t) for t in range(1, num_output_tokens + 1))
    reserved = max_tokens_for(reservation, num_prompt_tokens, num_output_tokens, max_model_len)
    return whole_blocks(num_prompt_tokens + reserved) * num_output_tokens


def replay(workload: Workload, num_requests: int, kv_policy: str, reservation: str, num_blocks: int,
           block_size: int, max_num_seqs: int) -> tuple[float, float, int]:
    """``(requests_per_step, mean_running, num_preemptions)`` for the first ``num_requests``, all
    queued at once (see the module docstring)."""
    manager = ContiguousBlockManager if kv_policy == "contiguous" else BlockManager
    blocks = manager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=workload.max_model_len,
                                      kv_policy=kv_policy), blocks)
    wanted: dict[str, int] = {}
    for i in range(num_requests):
        p, o = workload.num_prompt_tokens[i], workload.num_output_tokens[i]
        max_tokens = max_tokens_for(reservation, p, o, workload.max_model_len)
        wanted[f"r{i}"] = o
        sched.add_request(AddRequest(f"r{i}", np.full(p, FILLER_TOKEN_ID, np.int32),
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                    eos_token_ids=[0]),
                                     float(i)))
    refused = [o.error for o in sched.take_outputs() if o.error]
    if refused:
        raise ValueError(f"capacity replay: a request cannot run in {num_blocks} KV blocks: {refused[0]}")
    num_steps, sum_running = 0, 0
    while sched.waiting:
        step = sched.schedule()
        if step is None:
            raise RuntimeError(f"capacity replay: no progress with {len(sched.waiting)} requests waiting")
        sampled = step.seq_ids[step.sample_mask]
        sched.update(StepResult(step.step_id, sampled, np.full(len(sampled), FILLER_TOKEN_ID, np.int64)))
        for request_id, group in list(sched.groups.items()):
            if len(group.seqs[0].output_token_ids) >= wanted[request_id]:
                sched.abort_request(request_id)  # the client closes the stream at its drawn length
        sched.take_outputs()
        num_steps += 1
        sum_running += len(step.seq_ids)
    num_finished = num_requests - len(sched.groups)
    return num_finished / num_steps, sum_running / num_steps, sched.stats.num_preemptions


def capacities(workload: Workload, ways: list[tuple[str, str]], num_blocks: int, block_size: int,
               max_num_seqs: int, num_requests: int = NUM_REPLAY_REQUESTS) -> dict[tuple[str, str], Capacity]:
    """The model for each ``(kv_policy, reservation)`` in ``ways``, over the workload's first
    ``num_requests`` (all of them if it has fewer)."""
    n = min(num_requests, len(workload))
    lengths = list(zip(workload.num_prompt_tokens[:n], workload.num_output_tokens[:n]))
    out = {}
    for kv_policy, reservation in dict.fromkeys(ways):
        mean_mt = float(np.mean([memory_time(kv_policy, reservation, p, o, workload.max_model_len, block_size)
                                 for p, o in lengths]))
        per_step, running, preemptions = replay(workload, n, kv_policy, reservation, num_blocks, block_size,
                                                max_num_seqs)
        out[(kv_policy, reservation)] = Capacity(kv_policy, reservation, mean_mt, per_step, running, preemptions)
    return out


def expected_ratio(first: Capacity, other: Capacity) -> tuple[float, float]:
    """``first``'s capacity over ``other``'s: (replayed, memory-time with perfect packing)."""
    return first.requests_per_step / other.requests_per_step, other.mean_memory_time / first.mean_memory_time


def format_capacities(by_policy: dict[str, Capacity], num_blocks: int, num_requests: int) -> str:
    """The model's lines: per policy, sequences held and requests per step, and the first policy's
    ratio to each (replayed; with perfect packing)."""
    names = list(by_policy)
    first = by_policy[names[0]]
    lines = [f"capacity model (KV memory alone at a constant step time; loadtest/sweep/capacity.py): "
             f"{num_requests} of the requests queued at once in {num_blocks} KV blocks"]
    for name in names:
        c = by_policy[name]
        ratio = "" if c is first else "; {0} / this: {1:.2f}x (perfect packing: {2:.2f}x)".format(
            names[0], *expected_ratio(first, c))
        lines.append(f"  {name:26}{c.mean_running:5.1f} sequences running, {1000 * c.requests_per_step:6.1f} "
                     f"requests per 1000 steps, {c.num_preemptions} preemptions{ratio}")
    return "\n".join(lines)
