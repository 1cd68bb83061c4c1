"""The prefix cache as one sequence sees it: which cached blocks hold its leading tokens, and
registering its blocks once they are full of computed tokens."""

from __future__ import annotations

from .block_manager import BlockManager
from .sequence import Sequence


def prefix_hits(blocks: BlockManager, seq: Sequence) -> list[int]:
    """Cached blocks that hold ``seq``'s leading tokens (at least one token is left to compute)."""
    if not blocks.enable_prefix_caching or (seq.prompt_scores is not None and not seq.prompt_scores.complete):
        return []  # a prompt to score is computed whole: a cached block is never computed
    if seq.pooling is not None and seq.pooling.needs_every_position:
        return []  # so is a prompt to mean-pool
    limit = (seq.num_tokens - 1) // blocks.block_size
    if len(seq.block_hashes) < limit:
        blocks.prefix_hashes(seq.token_ids, limit, seq.block_hashes)
    return blocks.match_prefix(seq.block_hashes, seq.num_tokens)


def cache_computed_blocks(blocks: BlockManager, seq: Sequence, num_computed_tokens: int) -> None:
    """Register ``seq``'s blocks full of its first ``num_computed_tokens`` tokens (computed by the
    steps answered so far; their ids all known)."""
    full = num_computed_tokens // blocks.block_size
    if blocks.enable_prefix_caching and full > 0:
        if len(seq.block_hashes) < full:
            blocks.prefix_hashes(seq.token_ids, full, seq.block_hashes)
        tokens = seq.token_ids if blocks.cache_events.enabled else ()  # for a KV cache event (--kv-events-config)
        blocks.cache_full_blocks(seq.seq_id, seq.block_hashes[:full], tokens)
