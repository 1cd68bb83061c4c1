"""Conservation checks of a ``BlockManager``'s two pools, its prefix cache and its sliding-window
null entries (tests call them after every step, through ``BlockManager.check_integrity``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sliding_window import NULL_BLOCK, max_live_blocks, num_dead_blocks

if TYPE_CHECKING:
    from .block_manager import BlockManager


def check_block_manager(bm: "BlockManager") -> None:
    """Raise AssertionError if blocks were lost, duplicated or miscounted."""
    idle = list(bm.free_queue) + list(bm.evictable)
    check_pool(bm.num_blocks, bm.block_tables, bm.ref_counts, idle)
    check_pool(bm.num_cpu_blocks, bm.cpu_tables, bm.cpu_ref_counts, list(bm.cpu_free_queue))
    assert not set(bm.block_tables) & set(bm.cpu_tables), "a sequence is in both pools"
    for block_id in bm.free_queue:
        assert bm.block_hashes[block_id] is None, f"free block {block_id} still has a hash"
    for block_id in bm.evictable:
        assert bm.block_hashes[block_id] is not None, f"evictable block {block_id} has no hash"
    for h, block_id in bm.cached.items():
        assert bm.block_hashes[block_id] == h, f"cache entry for block {block_id} is stale"
    assert sum(h is not None for h in bm.block_hashes) == len(bm.cached), "hash without entry"
    check_window(bm)
    if bm.tiers is not None:
        bm.tiers.check()


def check_window(bm: "BlockManager") -> None:
    """Null entries only where the window let a block go. For each sequence (device or CPU table),
    trimmed last at ``t`` computed tokens (0: never): its nulls are exactly its first
    ``num_dead_blocks(t)`` entries (trims only ever free a longer prefix, and every later entry was
    allocated for a position the window still needs), so no null follows a live entry; and its live
    blocks are at most ``max_live_blocks`` for the computed tokens plus one per block past them."""
    assert not set(bm.trimmed_at) - set(bm.block_tables) - set(bm.cpu_tables), "trim count of a freed sequence"
    bs = bm.block_size
    for tables in (bm.block_tables, bm.cpu_tables):
        for seq_id, table in tables.items():
            t = bm.trimmed_at.get(seq_id, 0)
            assert len(table) >= -(-t // bs), f"sequence {seq_id}: {len(table)} blocks for {t} computed tokens"
            dead = num_dead_blocks(t, bm.sliding_window, bs)
            nulls = [i for i, b in enumerate(table) if b == NULL_BLOCK]
            assert nulls == list(range(dead)), (
                f"sequence {seq_id} trimmed at {t} tokens: null entries at {nulls}, expected the first {dead}"
            )
            if bm.sliding_window:
                bound = max_live_blocks(bm.sliding_window, bs) + max(0, len(table) - -(-t // bs))
                assert len(table) - dead <= bound, f"sequence {seq_id}: {len(table) - dead} live blocks > {bound}"


def check_pool(num_blocks: int, tables: dict[int, list[int]], ref_counts: list[int], idle: list[int]) -> None:
    """Every block's count equals the tables holding it, and a block is idle exactly when its count is 0."""
    holders = [0] * num_blocks
    for table in tables.values():
        for block_id in table:
            if block_id != NULL_BLOCK:
                holders[block_id] += 1
    idle_set = set(idle)
    assert len(idle_set) == len(idle), "a block is idle twice"
    for block_id in range(num_blocks):
        count = ref_counts[block_id]
        assert count == holders[block_id], (
            f"block {block_id}: ref count {count} but held by {holders[block_id]} tables"
        )
        assert (count == 0) == (block_id in idle_set), (
            f"block {block_id}: ref count {count} but {'idle' if block_id in idle_set else 'not idle'}"
        )
