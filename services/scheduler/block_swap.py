"""Swap for ``BlockManager`` (a mixin): a group of sequences' blocks move to the CPU pool of
``num_cpu_blocks`` and back. A block shared inside the group moves once. Null entries (blocks
freed out of the sliding window, ``sliding_window.NULL_BLOCK``) move nothing and stay null on
the CPU side and back. Plain Python, no I/O."""

from __future__ import annotations

from shared.messages import KvEventKind

from .sliding_window import NULL_BLOCK


class SwapMixin:
    """Needs the manager's pools: ``block_tables``, ``cpu_tables``, the counts and free queues."""

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(self._distinct(self.block_tables, seq_ids)) <= len(self.cpu_free_queue)

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        needed = len(self._distinct(self.cpu_tables, seq_ids))
        return needed + self.watermark_blocks <= self.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the CPU pool; returns ``(device, cpu)`` block copies."""
        needed = self._distinct(self.block_tables, seq_ids)
        if len(needed) > len(self.cpu_free_queue):
            raise RuntimeError(f"cannot swap out {len(needed)} blocks: {len(self.cpu_free_queue)} free")
        mapping = {b: self.cpu_free_queue.popleft() for b in needed}
        for seq_id in seq_ids:
            table = self.block_tables.pop(seq_id)
            self.cpu_tables[seq_id] = [mapping.get(b, NULL_BLOCK) for b in table]
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self.cpu_ref_counts[mapping[block_id]] += 1
                    self._release(block_id)  # a hashed block stays cached on the device too
        self.events.record_pairs(KvEventKind.SWAP_OUT, mapping.items())
        return list(mapping.items())

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back; returns ``(cpu, device)`` block copies."""
        needed = self._distinct(self.cpu_tables, seq_ids)
        if len(needed) > self.num_free_blocks:
            raise RuntimeError(f"cannot swap in {len(needed)} blocks: {self.num_free_blocks} free")
        mapping = {cpu_block: self._take() for cpu_block in needed}
        for device_block in mapping.values():
            self.ref_counts[device_block] = 0  # counted again from the tables below
        for seq_id in seq_ids:
            table = self.cpu_tables.pop(seq_id)
            self.block_tables[seq_id] = [mapping.get(b, NULL_BLOCK) for b in table]
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.ref_counts[mapping[block_id]] += 1
            self._free_cpu(table)
        self.events.record_pairs(KvEventKind.SWAP_IN, mapping.items())
        return list(mapping.items())

    @staticmethod
    def _distinct(tables: dict[int, list[int]], seq_ids: list[int]) -> list[int]:
        """The live blocks of the sequences' tables, each once, in table order."""
        return list(dict.fromkeys(b for s in seq_ids for b in tables[s] if b != NULL_BLOCK))

    def _free_cpu(self, table: list[int]) -> None:
        for block_id in reversed(table):
            if block_id == NULL_BLOCK:
                continue
            self.cpu_ref_counts[block_id] -= 1
            if self.cpu_ref_counts[block_id] == 0:
                self.cpu_free_queue.append(block_id)

    def free_swapped(self, seq_id: int) -> None:
        """Release a swapped-out sequence's CPU blocks (it was aborted while swapped)."""
        self._free_cpu(self.cpu_tables.pop(seq_id, []))
        self.trimmed_at.pop(seq_id, None)
