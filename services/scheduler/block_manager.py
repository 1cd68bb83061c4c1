"""The KV block pool, the per-sequence block tables and the prefix cache. Plain Python, no I/O.

Contract:
- ``num_blocks`` physical blocks of ``block_size`` slots each. A block is in exactly one of three
  states: *in use* (reference count >= 1, held by that many block tables), *cached* (count 0 but
  holding a full block of known content, reusable by hash, evictable least recently used first),
  or *free* (count 0, no content). Allocation takes free blocks first, then evicts cached ones.
- A sequence's block table maps its logical block ``i`` (tokens ``[i * block_size, (i + 1) *
  block_size)``) to a physical block; slot of token ``t`` is
  ``table[t // block_size] * block_size + t % block_size``.
- Prefix cache: a full block's hash covers its tokens and the hash of the block before it
  (``hash_block``, 128-bit BLAKE2b), so equal hashes mean equal whole prefixes. ``match_prefix``
  finds the leading cached blocks of a prompt; ``cache_full_blocks`` registers a sequence's blocks
  once their tokens are computed.
- Blocks are taken one at a time as a sequence grows (``allocate_slots``) and all given back at
  once (``free``), tail first, so a chain's tail is evicted before its head.
- Copy-on-write: when ``allocate_slots`` is about to let a sequence write into a block whose count
  is above one (a partly filled block shared after ``fork``), the sequence gets a fresh block and a
  ``(src, dst)`` copy is queued in ``pending_copies`` for the executors. Full blocks stay shared.
- Swap (``block_swap``): ``swap_out`` moves a group of sequences' blocks to the CPU pool of
  ``num_cpu_blocks`` (a block shared inside the group moves once) and returns the ``(device, cpu)``
  copies the executors must make; ``swap_in`` brings them back and returns ``(cpu, device)`` copies.
- Sliding window (``sliding_window``, ``sliding_window > 0``): ``free_out_of_window`` releases a
  sequence's leading blocks that no later query attends; their entries become ``NULL_BLOCK``, which
  every operation skips (never acquired, released, cached or swapped).
- ``events`` logs copy-on-write copies, evictions and swaps while the pool is watched (``kv_events``);
  ``cache_events`` the prefix cache's hashes stored, evicted and cleared, for ``--kv-events-config``
  (``kv_cache_events``).
- ``tiers`` (``kv_tiers.TierIndex``, None without ``--kv-offload-memory``): an evicted hashed block
  is copied to the host tier before it is reused (``tier_admission`` brings such blocks back).
- ``check_integrity`` verifies conservation in both pools, the consistency of the cache and the
  window's null entries (``block_checks``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict, deque
from enum import Enum
from typing import NewType, Sequence

import numpy as np

from shared.messages import KvEventKind

from . import sliding_window
from .block_checks import check_block_manager
from .block_swap import SwapMixin
from .kv_cache_events import KvCacheEventLog
from .kv_events import KvEventLog
from .kv_tiers import TierIndex
from .sliding_window import NULL_BLOCK

BlockHash = NewType("BlockHash", bytes)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """128-bit hash of a full block's tokens chained to its parent block's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return BlockHash(h.digest())


class AllocStatus(Enum):
    OK = "ok"  # can allocate now
    LATER = "later"  # not enough free blocks now; may fit once others finish
    NEVER = "never"  # larger than the whole pool


class BlockManager(SwapMixin):
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = True, sliding_window: int = 0) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be 0 (none) or positive, got {sliding_window}")
        self.sliding_window = sliding_window  # tokens every layer attends back (0: all of them)
        self.num_blocks, self.block_size = num_blocks, block_size
        # Blocks kept free at admission so a new prompt does not force an immediate preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self.tiers: TierIndex | None = None  # the offload tiers' books (``kv_tiers``), if any
        self.cache_events = KvCacheEventLog()  # kept across ``reset`` (which it reports); off unless published
        self.reset()
        self.num_queried_tokens = self.num_hit_tokens = 0  # prefix-cache lookups, for the hit rate
        self.events = KvEventLog()  # kept across ``reset``: whether it records is the publisher's choice

    def reset(self) -> None:
        """Both pools as new, as when the executors that held them were replaced (counters carry on)."""
        self.ref_counts = [0] * self.num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * self.num_blocks
        self.free_queue: deque[int] = deque(range(self.num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0, oldest first
        self.cached: dict[BlockHash, int] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.cpu_ref_counts = [0] * self.num_cpu_blocks
        self.cpu_free_queue: deque[int] = deque(range(self.num_cpu_blocks))
        self.cpu_tables: dict[int, list[int]] = {}  # swapped-out sequences
        self.trimmed_at: dict[int, int] = {}  # seq id -> computed tokens at its last window trim
        if self.tiers is not None:
            self.tiers.reset_host()  # the host pool went with the executors
        self.cache_events.cleared()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-but-unused (evictable)."""
        return len(self.free_queue) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds (a count of one or more)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds that keep their content for the prefix cache (evictable)."""
        return len(self.evictable)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks ``seq_id`` still needs to hold ``num_tokens`` tokens in total."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_needed(num_tokens) - held)

    def can_admit(self, num_tokens: int, num_prompt_tokens: int, cached_blocks: Sequence[int] = ()) -> AllocStatus:
        """Whether a new sequence may take blocks for ``num_tokens`` now, keeping the watermark. NEVER
        when its ``num_prompt_tokens`` cannot be held at once; with a sliding window only the blocks
        from the first one the cached hits leave in the window to ``num_tokens`` need to be."""
        peak = self.blocks_needed(num_prompt_tokens)
        if self.sliding_window:
            dead = sliding_window.num_dead_blocks(len(cached_blocks) * self.block_size, self.sliding_window,
                                                  self.block_size)
            peak = min(peak, self.blocks_needed(num_tokens) - dead)
        if peak > self.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        needed = self.blocks_needed(num_tokens) - len(cached_blocks) + revived
        if needed + self.watermark_blocks > self.num_free_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def slot(self, seq_id: int, position: int) -> int:
        block_id = self.block_tables[seq_id][position // self.block_size]
        assert block_id != NULL_BLOCK, f"sequence {seq_id}: position {position} is out of the window"
        return block_id * self.block_size + position % self.block_size

    # ------------------------------------------------------------------ prefix cache

    def prefix_hashes(self, token_ids: Sequence[int], num_blocks: int,
                      known: list[BlockHash] | None = None) -> list[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks; extends ``known`` in place."""
        hashes = known if known is not None else []
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def match_prefix(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> list[int]:
        """Leading cached blocks of a prompt, leaving at least its last token to compute."""
        if not self.enable_prefix_caching:
            return []
        limit = (num_prompt_tokens - 1) // self.block_size
        found = (self.cached.get(h) for h in hashes[:limit])
        return list(itertools.takewhile(lambda block_id: block_id is not None, found))

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted prompt's lookup for the hit rate."""
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq_id: int, hashes: Sequence[BlockHash], token_ids: Sequence[int] = ()) -> None:
        """Register the sequence's full, computed blocks ``hashes[i] -> table[i]`` (``token_ids``: the
        sequence's, for ``cache_events``)."""
        if not self.enable_prefix_caching:
            return
        table, bs = self.block_tables[seq_id], self.block_size
        for i, (block_id, h) in enumerate(zip(table, hashes)):
            if block_id != NULL_BLOCK and self.block_hashes[block_id] is None and h not in self.cached:
                self.block_hashes[block_id] = h
                self.cached[h] = block_id
                if self.cache_events.enabled:
                    self.cache_events.stored(h, hashes[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs], bs)

    # ------------------------------------------------------------------ changes

    def _take(self) -> int:
        if self.free_queue:
            block_id = self.free_queue.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently used
            if self.tiers is not None:
                self.tiers.offload(self.block_hashes[block_id], block_id)  # copied before reuse
            del self.cached[self.block_hashes[block_id]]
            if self.cache_events.enabled:
                self.cache_events.removed(self.block_hashes[block_id])
            self.block_hashes[block_id] = None
            self.events.record(KvEventKind.EVICT, block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is not None:
                self.evictable[block_id] = None  # most recently used end
            else:
                self.free_queue.append(block_id)

    def _acquire(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def allocate_slots(self, seq_id: int, num_tokens: int, num_computed_tokens: int | None = None,
                       cached_blocks: Sequence[int] = ()) -> bool:
        """Grow ``seq_id``'s table so it holds ``num_tokens`` tokens in total.

        A new sequence first takes ``cached_blocks`` (its prefix-cache hits). If the block that
        position ``num_computed_tokens`` falls into is shared, it is copied first (copy-on-write).
        Returns False, changing nothing, when there are not enough free blocks.
        """
        table = self.block_tables.get(seq_id)
        if table is None:
            revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
            needed = self.blocks_needed(num_tokens) - len(cached_blocks)
            if needed + revived > self.num_free_blocks:
                return False
            for block_id in cached_blocks:
                self._acquire(block_id)
            table = self.block_tables[seq_id] = list(cached_blocks)
        cow_idx = None
        if num_computed_tokens is not None:
            idx = num_computed_tokens // self.block_size
            if idx < len(table) and table[idx] != NULL_BLOCK and self.ref_counts[table[idx]] > 1:
                cow_idx = idx
        needed = self.num_new_blocks(seq_id, num_tokens) + (cow_idx is not None)
        if needed > self.num_free_blocks:
            return False
        if cow_idx is not None:
            src = table[cow_idx]
            table[cow_idx] = self._take()
            self._release(src)
            self.pending_copies.append((src, table[cow_idx]))
            self.events.record(KvEventKind.COPY, src, table[cow_idx])
        for _ in range(self.num_new_blocks(seq_id, num_tokens)):
            table.append(self._take())
        return True

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (reference counts go up by one)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"sequence {child_seq_id} already has a block table")
        table = list(self.block_tables[parent_seq_id])
        for block_id in sliding_window.live(table):
            self._acquire(block_id)
        self.block_tables[child_seq_id] = table
        if parent_seq_id in self.trimmed_at:
            self.trimmed_at[child_seq_id] = self.trimmed_at[parent_seq_id]

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id``, tail first. Unknown ids are ignored."""
        for block_id in reversed(sliding_window.live(self.block_tables.pop(seq_id, ()))):
            self._release(block_id)
        self.trimmed_at.pop(seq_id, None)

    def free_tail(self, seq_id: int, num_tokens: int) -> None:
        """Release ``seq_id``'s blocks past those its first ``num_tokens`` tokens fill, last first:
        speculative decoding's rollback of blocks allocated only for rejected tokens."""
        table = self.block_tables[seq_id]
        while len(table) > self.blocks_needed(num_tokens):
            self._release(table.pop())

    def free_out_of_window(self, seq_id: int, num_computed_tokens: int) -> int:
        """Release ``seq_id``'s blocks that no query from ``num_computed_tokens`` on attends (their
        entries become ``NULL_BLOCK``); returns how many. Nothing without a window (``sliding_window``)."""
        return sliding_window.trim(self, seq_id, num_computed_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self) -> None:
        """Raise AssertionError if blocks were lost, duplicated or miscounted (``block_checks``)."""
        check_block_manager(self)
