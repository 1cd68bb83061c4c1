"""What the scheduler counts over its life, for /health, /metrics and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import EngineStats

from .block_manager import BlockManager
from .sliding_window import NULL_BLOCK
from .sequence import Sequence
from .step_builder import Scheduled


@dataclass
class SchedulerStats:
    """Counters the scheduler updates as it goes; ``EngineStats`` carries them with the queue sizes."""

    num_steps: int = 0
    sum_slots_used: int = 0  # over every step: slots holding tokens of the running sequences
    sum_slots_allocated: int = 0  # over every step: slots in their blocks
    num_preemptions: int = 0  # groups preempted, by either mode
    num_swap_outs: int = 0
    num_recomputes: int = 0
    max_num_running: int = 0
    num_kv_snapshots: int = 0  # built for the playground's watchers (``kv_publisher``)
    # Speculative decoding, per draft position j: drafts proposed there, and accepted (``speculation``)
    spec_proposed: list[int] = field(default_factory=list)
    spec_accepted: list[int] = field(default_factory=list)

    @property
    def mean_utilization(self) -> float:
        """Slots holding tokens / slots allocated, over every step (0 before the first)."""
        return self.sum_slots_used / self.sum_slots_allocated if self.sum_slots_allocated else 0.0

    def record_step(self, scheduled: list[Scheduled], running: list[Sequence], blocks: BlockManager) -> None:
        """Add a step's slots holding tokens (after it ran) and slots allocated (all running sequences)."""
        new = {s.seq.seq_id: s.num_new_tokens for s in scheduled}
        self.num_steps += 1
        self.sum_slots_used += sum(s.num_computed_tokens + new.get(s.seq_id, 0)
                                   - _num_freed_slots(blocks, s.seq_id) for s in running)
        self.sum_slots_allocated += blocks.block_size * sum(_num_live(blocks.block_tables.get(s.seq_id, ()))
                                                            for s in running)

    def record_preemption(self, swapped: bool) -> None:
        self.num_preemptions += 1
        if swapped:
            self.num_swap_outs += 1
        else:
            self.num_recomputes += 1

    def snapshot(self, running: list[Sequence], num_waiting: int, num_swapped: int,
                 blocks: BlockManager) -> EngineStats:
        """The counters with the queue sizes and block counts of this moment."""
        return EngineStats(
            num_running=len(running), num_waiting=num_waiting, num_blocks_total=blocks.num_blocks,
            num_blocks_used=blocks.num_used_blocks,
            num_slots_used=sum(s.num_computed_tokens - _num_freed_slots(blocks, s.seq_id) for s in running),
            num_slots_allocated=sum(_num_live(t) for t in blocks.block_tables.values()) * blocks.block_size, ready=True,
            num_steps=self.num_steps, sum_slots_used=self.sum_slots_used,
            sum_slots_allocated=self.sum_slots_allocated, num_preemptions=self.num_preemptions,
            num_swapped=num_swapped, max_num_running=self.max_num_running,
            num_prefix_cache_queries=blocks.num_queried_tokens, num_prefix_cache_hits=blocks.num_hit_tokens,
            num_cached_blocks=blocks.num_cached_blocks, num_swap_outs=self.num_swap_outs,
            num_recomputes=self.num_recomputes, num_kv_snapshots=self.num_kv_snapshots,
            spec_proposed=list(self.spec_proposed), spec_accepted=list(self.spec_accepted),
        )


def _num_live(table) -> int:
    """Entries of a block table that hold a block (not freed out of the sliding window)."""
    return sum(1 for b in table if b != NULL_BLOCK)


def _num_freed_slots(blocks: BlockManager, seq_id: int) -> int:
    """Slots of a sequence's tokens whose blocks were freed out of the sliding window (its leading ones)."""
    return blocks.block_tables.get(seq_id, []).count(NULL_BLOCK) * blocks.block_size
