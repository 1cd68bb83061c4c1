"""Which token id each KV slot holds: a shadow of the paged cache, for the sampler's penalties.

The executor never receives a prompt as such, but every token it computes passes through a slot
of the cache. Writing each step's input tokens at their ``slot_mapping`` and replaying the step's
block moves (swap out, swap in, copy-on-write copies, in the runner's order) keeps, for every
block, the token ids whose keys and values it holds. A sequence's tokens are then read through
its block table, whoever computed them: a prefix served from the prefix cache, blocks shared
with the parent of a forked sample, blocks back from swap, or a recompute, all read right.
Slots never written read -1.
"""

from __future__ import annotations

import numpy as np

from shared.messages import Step

UNKNOWN_TOKEN = -1


class TokenShadow:
    """Token ids per device block (and per CPU swap block), ``[num_blocks, block_size]`` int32.

    Both pools grow on demand, so the sizes given are only a first allocation."""

    def __init__(self, block_size: int, num_blocks: int = 0, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.device = np.full((num_blocks, block_size), UNKNOWN_TOKEN, np.int32)
        self.cpu = np.full((num_cpu_blocks, block_size), UNKNOWN_TOKEN, np.int32)

    def apply(self, step: Step) -> None:
        """Replay the step's block moves, then write its input tokens into their slots."""
        if len(step.swap_out):
            src, dst = step.swap_out[:, 0], step.swap_out[:, 1]
            self.cpu = _grown(self.cpu, int(dst.max()) + 1)
            self.cpu[dst] = self._rows(src)
        if len(step.swap_in):
            src, dst = step.swap_in[:, 0], step.swap_in[:, 1]
            self.cpu = _grown(self.cpu, int(src.max()) + 1)
            self.device = _grown(self.device, int(dst.max()) + 1)
            self.device[dst] = self.cpu[src]
        if len(step.block_copies):
            src, dst = step.block_copies[:, 0], step.block_copies[:, 1]
            self.device = _grown(self.device, int(dst.max()) + 1)
            self.device[dst] = self._rows(src)
        real = step.slot_mapping >= 0  # a negative slot is padding: nothing is written
        if real.any():
            slots = step.slot_mapping[real]
            self.device = _grown(self.device, int(slots.max()) // self.block_size + 1)
            self.device.reshape(-1)[slots] = step.input_token_ids[real]

    def tokens(self, block_table: np.ndarray, num_tokens: int) -> np.ndarray:
        """The first ``num_tokens`` token ids of a sequence with ``block_table`` ([>= blocks] int)."""
        num_blocks = -(-num_tokens // self.block_size)
        blocks = np.asarray(block_table[:num_blocks], np.int64)
        self.device = _grown(self.device, int(blocks.max(initial=-1)) + 1)
        return self.device[blocks].reshape(-1)[:num_tokens]

    def _rows(self, blocks: np.ndarray) -> np.ndarray:
        self.device = _grown(self.device, int(blocks.max()) + 1)
        return self.device[blocks].copy()


def _grown(pool: np.ndarray, num_blocks: int) -> np.ndarray:
    if num_blocks <= len(pool):
        return pool
    num_blocks = max(num_blocks, 2 * len(pool))
    extra = np.full((num_blocks - len(pool), pool.shape[1]), UNKNOWN_TOKEN, pool.dtype)
    return np.concatenate([pool, extra])
