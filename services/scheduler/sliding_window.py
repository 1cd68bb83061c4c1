"""Sliding-window block freeing: with every layer's window ``W``, a query at position ``p`` attends
keys ``j`` with ``p - W < j <= p``. Once a sequence has ``n`` computed tokens (its next query is at
``n`` or later), logical block ``i`` is *dead* when its last token ``(i + 1) * bs - 1 <= n - W``.

``trim`` releases a sequence's dead blocks (a hashed one stays in the prefix cache, evictable, an
unhashed one is free) and puts ``NULL_BLOCK`` in their table entries, so the table still maps a
logical block index to a physical block by position. The manager records the count each sequence
was last trimmed at (``trimmed_at``); ``block_checks`` asserts that the nulls are exactly the dead
prefix at that count. Plain Python, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_manager import BlockManager

NULL_BLOCK = -1  # a table entry whose block was freed: out of every layer's window


def num_dead_blocks(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading logical blocks no later query attends (0 when ``window`` is 0: no window)."""
    if window <= 0:
        return 0
    return max(0, (num_computed_tokens - window + 1) // block_size)


def max_live_blocks(window: int, block_size: int) -> int:
    """Blocks a sequence holds, at most, for its computed tokens once trimmed (``-(-(W + bs - 1) // bs)``)."""
    return -(-(window + block_size - 1) // block_size)


def trim(bm: "BlockManager", seq_id: int, num_computed_tokens: int) -> int:
    """Release ``seq_id``'s dead blocks at ``num_computed_tokens``; returns how many were released.
    Does nothing without a window or for a sequence without a device table. Counts never go back:
    a lower count than the last one trimmed at (a caller's mistake) is an error."""
    table = bm.block_tables.get(seq_id)
    if bm.sliding_window <= 0 or table is None:
        return 0
    last = bm.trimmed_at.get(seq_id, 0)
    if num_computed_tokens < last:
        raise ValueError(f"sequence {seq_id}: trimmed at {last} tokens, now asked at {num_computed_tokens}")
    dead = min(num_dead_blocks(num_computed_tokens, bm.sliding_window, bm.block_size), len(table))
    released = 0
    for idx in reversed(range(dead)):  # tail first, as ``free``: a chain's tail is evicted first
        block_id = table[idx]
        if block_id == NULL_BLOCK:
            break  # the rest of the prefix was trimmed before
        table[idx] = NULL_BLOCK
        bm._release(block_id)
        released += 1
    bm.trimmed_at[seq_id] = num_computed_tokens
    return released


def live(table: list[int]) -> list[int]:
    """The table's blocks, without the null entries."""
    return [b for b in table if b != NULL_BLOCK]
