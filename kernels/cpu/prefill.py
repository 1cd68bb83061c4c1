"""Numba CPU paged prefill: new tokens attend causally to themselves and their cached prefix.

One task per (sequence, KV head, tile of ``_PREFILL_TILE`` query rows): each K/V row is loaded
once for the tile's rows times the group's heads; causality is a per-row position test. The
softmax is online at block granularity, in float32, as in decode, and so are the formats: 16-bit
K/V blocks are widened once into float32 scratch, queries and outputs are float32 or the cache's
format, the accumulators are float32 scratch and ``out`` is written once, at the end.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.common import (
    _FASTMATH, as_bits, as_input, narrow_like, output_target, widen, widen_rows,
)

_PREFILL_TILE = 16  # query rows per prefill task


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _prefill_kernel(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                    scale, task_seq, task_row):
    # out, query: [T, H, D] float32 or the cache's format; key_cache, value_cache: [num_blocks,
    # num_kv_heads, block_size, D] float32 / bf16 bits (uint16) / fp16 bits (int16);
    # block_tables: [S, max_blocks] int32; query_start_loc: [S + 1] int32; context_lens: [S] int32;
    # task_seq, task_row: [num_tiles] int32 (sequence, first query row of each tile of
    # _PREFILL_TILE rows)
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = key_cache.shape[1]
    block_size = key_cache.shape[2]
    group = num_heads // num_kv_heads
    tile = _PREFILL_TILE
    sc = np.float32(scale)
    for task in prange(task_seq.shape[0] * num_kv_heads):
        ti = task // num_kv_heads
        kvh = task - ti * num_kv_heads
        h0 = kvh * group
        s = task_seq[ti]
        row0 = task_row[ti]  # absolute query row
        q_start = query_start_loc[s]
        q_len = query_start_loc[s + 1] - q_start
        length = context_lens[s]
        rows = min(tile, q_start + q_len - row0)
        first_pos = length - q_len + (row0 - q_start)  # position of the tile's first row
        end = first_pos + rows  # the tile attends to positions [0, end)
        table = block_tables[s]
        # float32 scratch: row i = r * group + g holds query row r, head h0 + g
        sc_t = np.empty((tile * group, block_size), np.float32)
        q = np.empty((tile * group, head_dim), np.float32)
        acc = np.zeros((tile * group, head_dim), np.float32)
        kscr = np.empty((block_size, head_dim), np.float32)
        vscr = np.empty((block_size, head_dim), np.float32)
        m = np.full(tile * group, -np.inf, np.float32)
        l = np.zeros(tile * group, np.float32)
        for r in range(rows):
            for g in range(group):
                for d in range(head_dim):
                    q[r * group + g, d] = widen(query[row0 + r, h0 + g, d])
        pos = 0
        while pos < end:
            blk = table[pos // block_size]
            n = min(block_size, end - pos)
            kb = widen_rows(key_cache[blk, kvh, :n], kscr)  # [n, D] float32
            for t in range(n):
                k = kb[t]
                kp = pos + t
                for r in range(rows):
                    if kp > first_pos + r:  # causal: row r sees positions <= first_pos + r
                        for g in range(group):
                            sc_t[r * group + g, t] = -np.inf
                    else:
                        for g in range(group):
                            qg = q[r * group + g]
                            dot = np.float32(0.0)
                            for d in range(head_dim):
                                dot += qg[d] * k[d]
                            sc_t[r * group + g, t] = dot * sc
            for r in range(rows):
                # rows that see none of this block (positions all > first_pos + r) skip it
                if pos > first_pos + r:
                    continue
                for g in range(group):
                    i = r * group + g
                    bm = sc_t[i, 0]
                    for t in range(1, n):
                        if sc_t[i, t] > bm:
                            bm = sc_t[i, t]
                    mo = m[i]
                    if bm > mo:
                        alpha = np.exp(mo - bm)
                        l[i] *= alpha
                        o = acc[i]
                        for d in range(head_dim):
                            o[d] *= alpha
                        m[i] = bm
                        mo = bm
                    tot = np.float32(0.0)
                    for t in range(n):
                        p = np.exp(sc_t[i, t] - mo)  # exp(-inf) = 0 for masked positions
                        sc_t[i, t] = p
                        tot += p
                    l[i] += tot
            vb = widen_rows(value_cache[blk, kvh, :n], vscr)
            for t in range(n):
                v = vb[t]
                kp = pos + t
                for r in range(rows):
                    if kp > first_pos + r:
                        continue
                    for g in range(group):
                        p = sc_t[r * group + g, t]
                        o = acc[r * group + g]
                        for d in range(head_dim):
                            o[d] += p * v[d]
            pos += n
        for r in range(rows):
            orow = out[row0 + r]
            for g in range(group):
                inv = np.float32(1.0) / l[r * group + g]
                a = acc[r * group + g]
                o = orow[h0 + g]
                for d in range(head_dim):
                    o[d] = narrow_like(orow, a[d] * inv)


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale) -> None:
    """New tokens attend causally to themselves and their cached prefix; writes ``out`` in place.

    Formats as in ``paged_decode_attention``."""
    num_tokens = query.shape[0]
    query_start_loc = np.ascontiguousarray(query_start_loc, dtype=np.int32)
    starts = query_start_loc.astype(np.int64)
    q_lens = starts[1:] - starts[:-1]
    tiles = -(-q_lens // _PREFILL_TILE)
    if num_tokens == 0 or int(tiles.sum()) == 0:
        return
    task_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles)
    first_tile = np.cumsum(tiles) - tiles
    tile_in_seq = np.arange(int(tiles.sum())) - np.repeat(first_tile, tiles)
    task_row = (starts[:-1][task_seq] + tile_in_seq * _PREFILL_TILE).astype(np.int32)
    key_cache, value_cache = as_bits(key_cache), as_bits(value_cache)
    out = out.view(np.int16) if out.dtype == np.float16 else out
    query = as_input(query, key_cache)
    target = output_target(out, key_cache)
    _prefill_kernel(
        target, query, key_cache, value_cache, np.ascontiguousarray(block_tables, dtype=np.int32),
        query_start_loc, np.ascontiguousarray(context_lens, dtype=np.int32), float(scale),
        task_seq, task_row,
    )
    if target is not out:
        out[...] = target
