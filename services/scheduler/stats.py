"""What the scheduler counts for /health, /metrics and the benchmarks. Mixed into Scheduler."""

from __future__ import annotations

from .step_builder import Scheduled


class SchedulerStatsMixin:
    def _account_utilization(self, scheduled: list[Scheduled]) -> None:
        """Add this step's slots holding tokens and slots allocated (all running sequences)."""
        new = {s.seq.seq_id: s.num_new_tokens for s in scheduled}
        self.num_steps += 1
        self.sum_slots_used += sum(s.num_computed_tokens + new.get(s.seq_id, 0) for s in self.running)
        self.sum_slots_allocated += sum(
            len(self.blocks.block_tables.get(s.seq_id, ())) for s in self.running
        ) * self.blocks.block_size

    def stats(self) -> dict[str, int]:
        """Counts the metrics read: sequences, blocks, and slots holding tokens vs allocated."""
        slots_used = sum(s.num_computed_tokens for s in self.running)
        slots_alloc = sum(len(t) for t in self.blocks.block_tables.values()) * self.blocks.block_size
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_blocks_total": self.blocks.num_blocks,
            "num_blocks_used": self.blocks.num_used_blocks,
            "num_slots_used": slots_used,
            "num_slots_allocated": slots_alloc,
            "num_steps": self.num_steps,
            "sum_slots_used": self.sum_slots_used,
            "sum_slots_allocated": self.sum_slots_allocated,
            "num_preemptions": self.num_preemptions,
            "num_swapped": sum(len(g) for g in self.swapped),
            "max_num_running": self.max_num_running,
            "num_cached_blocks": self.blocks.num_cached_blocks,
            "num_swap_outs": self.num_swap_outs,
            "num_recomputes": self.num_recomputes,
            "num_prefix_cache_queries": self.blocks.num_queried_tokens,
            "num_prefix_cache_hits": self.blocks.num_hit_tokens,
        }
