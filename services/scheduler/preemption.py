"""Preempting a group of sequences when the device pool runs out: its blocks swapped to the CPU pool,
or freed for a recompute (the group is prefilled again, outputs included, when blocks return)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_manager import BlockManager
from .plan import Plan
from .sequence import Sequence, SequenceStatus
from .stats import SchedulerStats

if TYPE_CHECKING:
    from .groups import SequenceGroup


def preempt_group(group: list[Sequence], plan: Plan, blocks: BlockManager, preemption_mode: str,
                  stats: SchedulerStats) -> bool:
    """``group`` (every running sequence of a request, already out of the running queue) gives up
    its device blocks, all together. Swapped out when ``preemption_mode`` is swap and the CPU pool
    has room: returns True, and the caller queues the group as swapped. Else freed: returns False,
    and the caller queues its sequences to wait, in order. A step in flight may still write the
    freed blocks: the executors run steps in the order sent, so it does so before any later step
    that is given them."""
    ids = [s.seq_id for s in group]
    for seq in group:
        seq.num_preemptions += 1
    plan.preempted = True
    swap = preemption_mode == "swap" and blocks.can_swap_out(ids)
    stats.record_preemption(swapped=swap)
    if swap:
        plan.swap_out.extend(blocks.swap_out(ids))
        for seq in group:
            seq.status = SequenceStatus.SWAPPED
        return True
    for seq in reversed(group):  # recompute: prefill prompt + output again later
        blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.beam_candidates = None  # the re-prefill samples them again
        seq.status = SequenceStatus.WAITING
    return False


def preempt_newest(running: list[Sequence], groups: dict[str, SequenceGroup], plan: Plan, blocks: BlockManager,
                   preemption_mode: str, stats: SchedulerStats) -> tuple[list[Sequence], bool]:
    """Preempt the request of the newest running sequence (``running`` is in arrival order): its
    running sequences leave ``running`` and ``plan`` and give up their blocks (``preempt_group``).
    Returns them, and whether they were swapped out (else they are to wait, to be prefilled again)."""
    victim = running[-1]
    group = [s for s in groups[victim.request_id].seqs if s.status is SequenceStatus.RUNNING]
    plan.drop(group)
    for s in group:
        running.remove(s)
    return group, preempt_group(group, plan, blocks, preemption_mode, stats)
