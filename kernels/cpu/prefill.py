"""Numba CPU paged prefill: new tokens attend causally to themselves and their cached prefix.

A prefill is decode done once per new token: the token at position ``p`` attends to positions
``[0, p]`` of its sequence's cache (its own K/V already written). So this module only maps the
chunk's tokens to rows of ``decode.attend_rows`` (sequence and length of each) and the decode
kernel does the work, tile by tile with the group's query and accumulators in registers
(``kernels/cpu/vectors.py``). The rows re-read their sequence's K/V, from L2/L3 for any but the
first; measured on a 512-token prompt (SmolLM2's shapes, bf16, one thread) that took 2.6 ms a
layer where the previous kernel, which read each K/V row once for a tile of 16 query rows but
with a dot product and a horizontal sum per row and head, took 6.5 ms. The rows go to the
threads longest with shortest (``rows_plan.balanced_order``), since causal rows grow by one
position each.
"""

from __future__ import annotations

import numpy as np

from kernels.cpu.decode import attend_rows


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, num_threads: int | None = None,
                            partition_threads: int | None = None, sequences=None, window: int = 0,
                            softcap: float = 0.0) -> None:
    """New tokens attend causally to themselves and their cached prefix; writes ``out`` in place.

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``; with
    ``q_len`` of them, row ``j`` is at position ``context_lens[s] - q_len + j``. Formats as in
    ``decode.attend_rows``. ``sequences``: only these sequences' rows are computed (the others'
    ``out`` rows are left as they were), in one call; default all. ``window`` > 0: row ``j``
    attends to its last ``window`` positions only; ``softcap`` > 0: soft-capped scores."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = starts[1:] - starts[:-1]
    num_tokens = int(q_lens.sum())
    if num_tokens == 0:
        return
    seqs = np.repeat(np.arange(len(q_lens)), q_lens)
    first = np.repeat(np.asarray(context_lens, dtype=np.int64) - q_lens - starts[:-1], q_lens)
    row_lens = first + np.arange(starts[0], starts[0] + num_tokens) + 1
    rows = slice(int(starts[0]), int(starts[0]) + num_tokens)
    row_ids = None
    if sequences is not None:
        base = int(starts[0])
        row_ids = np.concatenate([np.arange(starts[s] - base, starts[s + 1] - base) for s in sequences]
                                 or [np.zeros(0, np.int64)])
    attend_rows(out[rows], query[rows], key_cache, value_cache, block_tables, seqs, row_lens,
                scale, num_threads=num_threads, partition_threads=partition_threads, row_ids=row_ids,
                window=window, softcap=softcap)
