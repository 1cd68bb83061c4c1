"""Prefill attention of one long sequence through torch's fused attention (``scaled_dot_product_
attention``), whose CPU kernel multiplies bfloat16 tiles in oneDNN's matmul micro-kernels (AMX
tiles where the CPU has them), on K/V gathered from the paged cache, or, for a prompt with no
cached prefix, on the step's new K/V where they already are.

The Numba kernels (``kernels/cpu/decode.py``) attend one query row at a time, at about 50 GFLOP/s
of bfloat16 here: fine for decodes, which read far more bytes than they multiply, but a prompt's
rows all read the same keys, and a matmul over tiles of rows does that arithmetic many times
faster. Measured on a 2-core Intel Xeon with AMX (2026-12-02; SmolLM2's shapes: 9 query heads, 3 KV
heads, head_dim 64, block size 16; 30 layers, median of 5, bfloat16; ``/tmp`` scripts quoted in
``docs/journal/profile-journal.md``, eighth session): one prompt of

| rows (+ cached prefix) | Numba prefill | this | ratio |
|---|---|---|---|
| 16 | 1.82 ms | 1.81 ms | 1.00 |
| 64 | 5.77 ms | 4.16 ms | 1.39 |
| 128 | 13.69 ms | 7.61 ms | 1.80 |
| 256 | 37.99 ms | 18.36 ms | 2.07 |
| 512 | 127.78 ms | 49.57 ms | 2.58 |
| 256 (+256) | 93.62 ms | 37.46 ms | 2.50 |
| 512 (+1,536) | 753.30 ms | 259.01 ms | 2.91 |

Outputs differ from the Numba kernel's by at most one bfloat16 step (torch rounds the softmax
weights to bfloat16 before multiplying them with V; the Numba kernel keeps them in float32).

Why only from ``MIN_ROWS`` rows: below 64 query rows, torch 2.13's kernel does not use the matmul
micro-kernels, and with 2 threads some of those shapes took 11-23 ms per call where 64 rows took
66 us (28 to 63 rows; 16 to 24 were fast; with one thread none were slow). From 64 rows, 150
random shapes (64-700 rows, prefixes up to 1,500 tokens) showed no such case.

Float32 is not offered this path: torch's float32 kernel took 1.7 s for the 512-row case above,
and float32 is the mode whose output must equal transformers' token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 64  # query rows of one sequence from which it takes this path (see the docstring)


def prefill_sequence(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                     scale: float, key: torch.Tensor | None = None,
                     value: torch.Tensor | None = None) -> None:
    """One sequence's new rows attend causally to themselves and its cached prefix.

    out, query: ``[n, H, D]``, the sequence's rows (row ``j`` at position ``context_len - n + j``);
    key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``, this layer's pools, holding the
    sequence's first ``context_len`` keys and values (the new ones written already); block_table:
    ``[max_blocks]`` int32. key, value: ``[n, Hkv, D]``, the rows' own new keys and values in the
    query's dtype, where the caller has them: a sequence with no cached prefix (``n ==
    context_len``) then attends to them where they are, without gathering its blocks from the
    pools (the same values: the pools hold them in this dtype). Writes ``out`` in place."""
    n, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if n == context_len and key is not None and value is not None:
        k, v = key.transpose(0, 1), value.transpose(0, 1)  # [Hkv, n, D] views
    else:
        blocks = block_table[: (context_len + block_size - 1) // block_size]
        # [blocks, Hkv, block_size, D] -> [Hkv, tokens, D]: one copy of the sequence's K and V
        k = key_cache.index_select(0, blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :context_len]
        v = value_cache.index_select(0, blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :context_len]
    q = query.transpose(0, 1)  # [H, n, D]
    mask = None
    if n != context_len:  # a cached prefix: row j sees keys up to position context_len - n + j
        mask = torch.arange(context_len) <= torch.arange(context_len - n, context_len).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                       is_causal=mask is None, scale=scale,
                                       enable_gqa=num_heads != num_kv_heads)
    out.copy_(o[0].transpose(0, 1))
