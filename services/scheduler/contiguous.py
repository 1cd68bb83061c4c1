"""``--kv-policy contiguous``: the pre-paging baseline, so one engine can measure what paging buys.

Each sequence reserves one unbroken run of blocks for its prompt plus ``max_tokens`` (capped at the
model length) when it is admitted, found first fit in block-id order, as servers that stored each
request's cache contiguously did. The run is never grown and is freed whole. Everything else
(slots, block tables, the kernels) works unchanged, because a run is just a block table whose ids
happen to be consecutive. Waste comes from the reservation and from gaps between runs.
"""

from __future__ import annotations

from .block_manager import AllocStatus, BlockManager


class ContiguousBlockManager(BlockManager):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["enable_prefix_caching"] = False
        if kwargs.get("sliding_window"):
            raise ValueError("the contiguous policy reserves a run freed whole: it has no sliding-window freeing")
        super().__init__(*args, **kwargs)

    def _find_run(self, num_blocks: int) -> int | None:
        """First block id of the lowest free run of ``num_blocks`` consecutive blocks, or None."""
        if num_blocks == 0:
            return 0
        run_start, run_len = None, 0
        for block_id in sorted(self.free_queue):
            if run_start is not None and block_id == run_start + run_len:
                run_len += 1
            else:
                run_start, run_len = block_id, 1
            if run_len == num_blocks:
                return run_start
        return None

    def can_admit(self, num_tokens: int, num_prompt_tokens: int, cached_blocks=()) -> AllocStatus:
        needed = self.blocks_needed(max(num_tokens, num_prompt_tokens))
        if needed > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if self._find_run(needed) is not None else AllocStatus.LATER

    def allocate_slots(self, seq_id: int, num_tokens: int, num_computed_tokens=None, cached_blocks=()) -> bool:
        held = self.block_tables.get(seq_id)
        if held is not None:
            return self.blocks_needed(num_tokens) <= len(held)  # a reservation never grows
        needed = self.blocks_needed(num_tokens)
        start = self._find_run(needed)
        if start is None:
            return False
        run = list(range(start, start + needed))
        taken = set(run)
        self.free_queue = type(self.free_queue)(b for b in self.free_queue if b not in taken)
        for block_id in run:
            self.ref_counts[block_id] = 1
        self.block_tables[seq_id] = run
        return True

    def free_tail(self, seq_id: int, num_tokens: int) -> None:
        pass  # a reservation is freed whole (speculation's tokens stay within it: max_tokens caps them)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return False  # the baseline preempts by recompute only
