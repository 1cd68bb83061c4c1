"""A waiting sequence's prefix found in the offload tiers (``kv_tiers``): blocks in the host tier are
brought back to the device at admission (``revive_host_hits``: device blocks taken, their hashes
registered, a ``RELOAD`` queued that the executors apply before anything reads them), and blocks
on disk are read into the host tier first (``request_loads``), the sequence waiting meanwhile."""

from __future__ import annotations

from .block_manager import BlockManager
from .sequence import Sequence


def _lookup_limit(blocks: BlockManager, seq: Sequence) -> int:
    """Leading full blocks ``seq`` may reuse (0 when it must compute its whole prompt), hashed."""
    if blocks.tiers is None or not blocks.enable_prefix_caching:
        return 0
    if (seq.prompt_scores is not None and not seq.prompt_scores.complete) or (
            seq.pooling is not None and seq.pooling.needs_every_position):
        return 0  # as ``prefix.prefix_hits``: these prompts are computed whole
    limit = (seq.num_tokens - 1) // blocks.block_size
    blocks.prefix_hashes(seq.token_ids, limit, seq.block_hashes)
    return limit


def revive_host_hits(blocks: BlockManager, seq: Sequence, hits: list[int]) -> list[int]:
    """``hits`` (device prefix hits) extended by the blocks after them that the host tier holds,
    each now a cached device block again, as many as leave room for the rest of the prompt."""
    limit = _lookup_limit(blocks, seq)
    tiers, run = blocks.tiers, []
    for h in seq.block_hashes[len(hits):limit]:
        if h not in blocks.cached and (tiers is None or tiers.where(h) != "host"):
            break
        run.append(h)
    if not run:
        return hits
    rest = blocks.blocks_needed(seq.num_planned_tokens) - len(hits) - len(run)
    tiers.pin(run)  # the blocks taken below may push other hashes out of the host tier, not these
    pinned = list(hits)
    for block_id in pinned:
        blocks._acquire(block_id)  # so that taking blocks below evicts none of them
    for h in run:
        if blocks.num_free_blocks - blocks.watermark_blocks - rest <= 0:
            break
        if h in blocks.cached:
            block_id = blocks.cached[h]
            blocks._acquire(block_id)
        elif tiers.where(h) == "host":
            block_id = blocks._take()  # may evict a device block to the host tier (not a pinned one)
            blocks.block_hashes[block_id], blocks.cached[h] = h, block_id
            tiers.reload(h, block_id)
        else:
            break  # a device hit of the run that the blocks taken above evicted (and kept nowhere)
        pinned.append(block_id)
    tiers.unpin(run)
    for block_id in reversed(pinned):
        blocks._release(block_id)  # cached again, the tail evictable first
    return pinned


def request_loads(blocks: BlockManager, seq: Sequence) -> bool:
    """Queue reads of the stored blocks of ``seq``'s prefix past those the device and host hold;
    True when some are on their way (it should wait for them)."""
    limit = _lookup_limit(blocks, seq)
    tiers = blocks.tiers
    if not limit or not tiers.num_disk_blocks:
        return False
    prefix = seq.block_hashes[:limit]
    held = [h for h in prefix if h in tiers.host and h not in blocks.cached]
    tiers.pin(held)  # loads below take other hashes' slots (or those of copies the device holds too)
    budget = tiers.num_loadable() - sum(1 for h in tiers.host if h in tiers.pins)
    waiting = False
    for h in prefix:
        where = tiers.where(h)
        if h in blocks.cached or where == "host":
            continue
        if where == "loading":
            waiting = True
            continue
        if where != "disk" or budget <= 0 or not tiers.load(h):
            break
        budget -= 1
        waiting = True
    tiers.unpin(held)
    return waiting
