"""The KV block pool and the per-sequence block tables. Plain Python, no I/O.

Contract:
- ``num_blocks`` physical blocks of ``block_size`` slots each. A block is either free (in the
  free queue, reference count 0) or in use (count >= 1, held by that many block tables).
- A sequence's block table maps its logical block ``i`` (tokens ``[i * block_size, (i + 1) *
  block_size)``) to a physical block; slot of token ``t`` is
  ``table[t // block_size] * block_size + t % block_size``.
- Blocks are taken one at a time as a sequence grows (``allocate_slots``) and all given back at
  once (``free``), tail first, so the free queue holds chain tails before heads.
- Swap: ``swap_out`` moves a group of sequences' blocks to the CPU pool of ``num_cpu_blocks``
  (a block shared inside the group moves once) and returns the ``(device, cpu)`` copies the
  executors must make; ``swap_in`` brings them back and returns ``(cpu, device)`` copies.
- ``check_integrity`` verifies conservation in both pools: free + in use = total, and every count
  equals the number of tables that hold the block.
"""

from __future__ import annotations

from collections import deque
from enum import Enum


class AllocStatus(Enum):
    OK = "ok"  # can allocate now
    LATER = "later"  # not enough free blocks now; may fit once others finish
    NEVER = "never"  # larger than the whole pool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Blocks kept free at admission so a new prompt does not force an immediate preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_ref_counts = [0] * num_cpu_blocks
        self.cpu_free_queue: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_tables: dict[int, list[int]] = {}  # swapped-out sequences

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks ``seq_id`` still needs to hold ``num_tokens`` tokens in total."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_needed(num_tokens) - held)

    def can_admit(self, num_tokens: int, num_prompt_tokens: int) -> AllocStatus:
        """Whether a new sequence may take blocks for ``num_tokens`` now, keeping the watermark."""
        if self.blocks_needed(num_prompt_tokens) > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.blocks_needed(num_tokens) + self.watermark_blocks > self.num_free_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def slot(self, seq_id: int, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------------ changes

    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table so it holds ``num_tokens`` tokens in total.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        needed = self.num_new_blocks(seq_id, num_tokens)
        if needed > len(self.free_queue):
            return False
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(needed):
            block_id = self.free_queue.popleft()
            self.ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (reference counts go up by one)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq_id} already has a block table")
        table = list(self.block_tables[parent_seq_id])
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_seq_id] = table

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``, tail first. Unknown ids are ignored."""
        table = self.block_tables.pop(seq_id, None)
        if not table:
            return
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue.append(block_id)

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(self._distinct(self.block_tables, seq_ids)) <= len(self.cpu_free_queue)

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        needed = len(self._distinct(self.cpu_tables, seq_ids))
        return needed + self.watermark_blocks <= len(self.free_queue)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns ``(device, cpu)`` block copies."""
        return self._move(seq_ids, self.block_tables, self.ref_counts, self.free_queue,
                          self.cpu_tables, self.cpu_ref_counts, self.cpu_free_queue)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back; returns ``(cpu, device)`` block copies."""
        return self._move(seq_ids, self.cpu_tables, self.cpu_ref_counts, self.cpu_free_queue,
                          self.block_tables, self.ref_counts, self.free_queue)

    @staticmethod
    def _distinct(tables: dict[int, list[int]], seq_ids: list[int]) -> list[int]:
        return list(dict.fromkeys(b for s in seq_ids for b in tables[s]))

    def _move(self, seq_ids, src_tables, src_counts, src_free, dst_tables, dst_counts, dst_free):
        needed = self._distinct(src_tables, seq_ids)
        if len(needed) > len(dst_free):
            raise RuntimeError(f"cannot move {len(needed)} blocks: {len(dst_free)} free in the target pool")
        mapping = {src: dst_free.popleft() for src in needed}
        for seq_id in seq_ids:
            table = src_tables.pop(seq_id)
            dst_tables[seq_id] = [mapping[b] for b in table]
            for block_id in table:
                dst_counts[mapping[block_id]] += 1
            for block_id in reversed(table):
                src_counts[block_id] -= 1
                if src_counts[block_id] == 0:
                    src_free.append(block_id)
        return list(mapping.items())

    def free_swapped(self, seq_id: int) -> None:
        """Release a swapped-out sequence's CPU blocks (it was aborted while swapped)."""
        table = self.cpu_tables.pop(seq_id, None) or []
        for block_id in reversed(table):
            self.cpu_ref_counts[block_id] -= 1
            if self.cpu_ref_counts[block_id] == 0:
                self.cpu_free_queue.append(block_id)

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise AssertionError if blocks were lost, duplicated or miscounted."""
        self._check_pool(self.num_blocks, self.block_tables, self.ref_counts, self.free_queue)
        self._check_pool(self.num_cpu_blocks, self.cpu_tables, self.cpu_ref_counts, self.cpu_free_queue)
        assert not set(self.block_tables) & set(self.cpu_tables), "a sequence is in both pools"

    @staticmethod
    def _check_pool(num_blocks, tables, ref_counts, free_queue) -> None:
        holders = [0] * num_blocks
        for table in tables.values():
            for block_id in table:
                holders[block_id] += 1
        free = set(free_queue)
        assert len(free) == len(free_queue), "a block is in the free queue twice"
        for block_id in range(num_blocks):
            count = ref_counts[block_id]
            assert count == holders[block_id], (
                f"block {block_id}: ref count {count} but held by {holders[block_id]} tables"
            )
            assert (count == 0) == (block_id in free), (
                f"block {block_id}: ref count {count} but {'in' if block_id in free else 'not in'} free queue"
            )
        used = sum(1 for c in ref_counts if c > 0)
        assert used + len(free) == num_blocks, f"{used} used + {len(free)} free != {num_blocks} blocks"

