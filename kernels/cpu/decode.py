"""Numba CPU paged decode: one query per sequence over its whole context.

- One task per (sequence, KV head) in a ``prange``: every K/V row of the sequence is loaded once
  and used by the whole group of query heads that share it (grouped-query attention). The softmax
  is online at block granularity: the scores of one cache block are computed for the group, then
  the running max / sum / accumulator are rescaled once per block (not per token). Everything
  accumulates in float32, in per-task scratch; ``out`` is written once, at the end.
- 16-bit caches (bfloat16 / float16 bits, ``kernels/cpu/common.py``): each cache block's K and V
  rows are widened to float32 once, into per-task scratch, and the float32 loops run on that; a
  float32 cache is read in place. Queries and outputs may be float32 or the cache's format.
- A small batch gives too few tasks to keep every thread evenly busy, so the entry point then
  splits each context into partitions (a multiple of the block size, at least
  ``MIN_PARTITION_SIZE`` tokens: short contexts stay whole), runs (sequence, KV head, partition)
  tasks in parallel, and merges the partial results with the log-sum-exp rule.
- Cache blocks are scattered over the pool, so the hardware prefetchers, which follow contiguous
  streams, stall at every block boundary: while reading one block the kernel prefetches the K/V
  rows of the block two ahead (``llvm.prefetch``, into L2), one row per row read. That took the
  memory-bound decode shapes from ~1.4x to ~0.8x the time of SDPA over a contiguous cache.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from kernels.cpu.common import (
    _FASTMATH, _prefetch, as_bits, as_input, line_elems, narrow_like, output_target, widen,
    widen_rows,
)

_PREFETCH_AHEAD = 2  # cache blocks ahead of the one being read whose K/V are prefetched
MIN_PARTITION_SIZE = 128  # tokens: the automatic partitions are never shorter


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _scratch(group, block_size, head_dim):
    """One task's float32 scratch: (query, accumulator, scores, K rows, V rows, max, sum)."""
    gd = group * head_dim
    bd = block_size * head_dim
    buf = np.empty(2 * gd + group * block_size + 2 * bd + 2 * group, np.float32)
    q = buf[:gd].reshape((group, head_dim))
    acc = buf[gd:2 * gd].reshape((group, head_dim))
    o = 2 * gd
    sco = buf[o:o + group * block_size].reshape((group, block_size))
    o += group * block_size
    kscr = buf[o:o + bd].reshape((block_size, head_dim))
    vscr = buf[o + bd:o + 2 * bd].reshape((block_size, head_dim))
    o += 2 * bd
    return q, acc, sco, kscr, vscr, buf[o:o + group], buf[o + group:o + 2 * group]


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _start_group(q, acc, m, l, query_rows):
    """Widen the group's query rows ([G, D], any format) into ``q``; reset the accumulators."""
    for g in range(q.shape[0]):
        m[g] = -np.inf
        l[g] = 0.0
        for d in range(q.shape[1]):
            q[g, d] = widen(query_rows[g, d])
            acc[g, d] = 0.0


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _attend_range(acc, m, l, sco, kscr, vscr, q, key_cache, value_cache, table, kvh, start, end,
                  scale):
    """Accumulate positions ``[start, end)`` of one sequence for one KV head's query group.

    acc: [G, D] unnormalized output; m, l: [G] running max and sum; sco: [G, block_size] scratch;
    kscr, vscr: [block_size, D] float32 scratch for widened 16-bit rows; q: [G, D] the group's
    float32 query; table: [max_blocks] the sequence's block table. ``start`` must be a multiple of
    the block size.
    """
    group = acc.shape[0]
    head_dim = acc.shape[1]
    block_size = key_cache.shape[2]
    line = line_elems(key_cache)
    pos = start
    while pos < end:
        blk = table[pos // block_size]
        n = min(block_size, end - pos)
        # the blocks are scattered, so no hardware prefetcher guesses the next one: prefetch the
        # K/V rows of the block _PREFETCH_AHEAD blocks ahead, one row per row processed here
        ahead = pos + _PREFETCH_AHEAD * block_size
        prefetch = ahead < end
        kn = key_cache[table[ahead // block_size] if prefetch else blk, kvh]
        vn = value_cache[table[ahead // block_size] if prefetch else blk, kvh]
        kb = widen_rows(key_cache[blk, kvh, :n], kscr)  # [n, D] float32
        # scores of the block's tokens, each K row loaded once for the whole group
        for t in range(n):
            k = kb[t]
            if prefetch:
                for i in range(0, head_dim, line):
                    _prefetch(kn, t * head_dim + i)
            for g in range(group):
                qg = q[g]
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += qg[d] * k[d]
                sco[g, t] = dot * scale
        # online softmax, one rescale per block
        for g in range(group):
            bm = sco[g, 0]
            for t in range(1, n):
                if sco[g, t] > bm:
                    bm = sco[g, t]
            mo = m[g]
            if bm > mo:
                alpha = np.exp(mo - bm)  # exp(-inf) = 0 on the first block
                l[g] *= alpha
                a = acc[g]
                for d in range(head_dim):
                    a[d] *= alpha
                m[g] = bm
                mo = bm
            tot = np.float32(0.0)
            for t in range(n):
                p = np.exp(sco[g, t] - mo)
                sco[g, t] = p
                tot += p
            l[g] += tot
        # weighted values, each V row loaded once for the whole group
        vb = widen_rows(value_cache[blk, kvh, :n], vscr)
        for t in range(n):
            v = vb[t]
            if prefetch:
                for i in range(0, head_dim, line):
                    _prefetch(vn, t * head_dim + i)
            for g in range(group):
                p = sco[g, t]
                a = acc[g]
                for d in range(head_dim):
                    a[d] += p * v[d]
        pos += n


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _store_group(out_rows, acc, l):
    """``out_rows`` ([G, D], the output's format) = ``acc / l``."""
    for g in range(acc.shape[0]):
        inv = np.float32(1.0) / l[g]
        for d in range(acc.shape[1]):
            out_rows[g, d] = narrow_like(out_rows, acc[g, d] * inv)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _decode_kernel(out, query, key_cache, value_cache, block_tables, context_lens, scale):
    # out, query: [S, H, D] float32 or the cache's format; key_cache, value_cache: [num_blocks,
    # num_kv_heads, block_size, D] float32 / bf16 bits (uint16) / fp16 bits (int16);
    # block_tables: [S, max_blocks] int32; context_lens: [S] int32
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    sc = np.float32(scale)
    for task in prange(num_seqs * num_kv_heads):
        s = task // num_kv_heads
        kvh = task - s * num_kv_heads
        h0 = kvh * group
        q, acc, sco, kscr, vscr, m, l = _scratch(group, key_cache.shape[2], head_dim)
        _start_group(q, acc, m, l, query[s, h0:h0 + group])
        _attend_range(acc, m, l, sco, kscr, vscr, q, key_cache, value_cache, block_tables[s],
                      kvh, 0, context_lens[s], sc)
        _store_group(out[s, h0:h0 + group], acc, l)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _decode_partitioned_kernel(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                               partition_size, num_parts):
    # out, query, caches, block_tables, context_lens: as in _decode_kernel;
    # partition_size: tokens per partition (rounded up to a block multiple here); or, when it is 0,
    # num_parts: the number of partitions of the longest context (sized to fit, >= MIN_PARTITION_SIZE)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    block_size = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = context_lens.max()
    if partition_size <= 0:
        partition_size = max((max_len + num_parts - 1) // num_parts, MIN_PARTITION_SIZE)
    partition_size = (partition_size + block_size - 1) // block_size * block_size
    num_parts = (max_len + partition_size - 1) // partition_size
    sc = np.float32(scale)
    tasks = num_seqs * num_kv_heads * num_parts
    part_acc = np.empty((tasks, group, head_dim), np.float32)  # unnormalized partial outputs
    part_stats = np.empty((tasks, 2, group), np.float32)  # running max and sum
    # phase 1: every (sequence, KV head, partition) on its own, unnormalized
    for task in prange(tasks):
        p = task % num_parts
        sk = task // num_parts
        s = sk // num_kv_heads
        kvh = sk - s * num_kv_heads
        h0 = kvh * group
        q, _, sco, kscr, vscr, _, _ = _scratch(group, block_size, head_dim)
        acc = part_acc[task]
        m = part_stats[task, 0]
        l = part_stats[task, 1]
        _start_group(q, acc, m, l, query[s, h0:h0 + group])
        start = p * partition_size
        end = min(start + partition_size, context_lens[s])
        if start < end:
            _attend_range(acc, m, l, sco, kscr, vscr, q, key_cache, value_cache, block_tables[s],
                          kvh, start, end, sc)
    # phase 2: log-sum-exp merge of the partitions of each (sequence, KV head); serial, since the
    # entry point partitions small batches only and a second parallel region costs more
    o = np.empty(head_dim, np.float32)
    for sk in range(num_seqs * num_kv_heads):
        s = sk // num_kv_heads
        kvh = sk - s * num_kv_heads
        used = (context_lens[s] + partition_size - 1) // partition_size
        for g in range(group):
            gmax = np.float32(-np.inf)
            for p in range(used):
                mp = part_stats[sk * num_parts + p, 0, g]
                if mp > gmax:
                    gmax = mp
            for d in range(head_dim):
                o[d] = 0.0
            total = np.float32(0.0)
            for p in range(used):
                task = sk * num_parts + p
                w = np.exp(part_stats[task, 0, g] - gmax)
                total += w * part_stats[task, 1, g]
                a = part_acc[task, g]
                for d in range(head_dim):
                    o[d] += w * a[d]
            inv = np.float32(1.0) / total
            row = out[s, kvh * group + g]
            for d in range(head_dim):
                row[d] = narrow_like(row, o[d] * inv)


def auto_partitions(num_seqs: int, num_kv_heads: int, num_threads: int) -> int:
    """How many partitions the decode entry point splits the longest context into by itself: 1
    (none) unless the (sequence, KV head) tasks are too few to keep ``num_threads`` threads evenly
    busy (fewer than 4 per thread), then enough for ~4 tasks per thread. The partitions are never
    shorter than ``MIN_PARTITION_SIZE`` tokens, so short contexts stay in one."""
    tasks = num_seqs * num_kv_heads
    if num_threads <= 1 or tasks >= 4 * num_threads:
        return 1
    return -(-4 * num_threads // tasks)


def paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                           partition_size: int | None = None, num_threads: int | None = None) -> None:
    """One query per sequence over its whole context; writes ``out`` in place.

    Caches: float32, numpy float16, or 16-bit bits (``kernels/cpu/common.py``); ``query`` and
    ``out`` float32 or the cache's format. ``partition_size``: ``None`` chooses
    (``auto_partitions``), ``0`` never partitions, a positive number forces the partitioned form
    with partitions of that many tokens (rounded up to a multiple of the block size).
    ``num_threads``: numba's current count, when the caller knows it.
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return
    key_cache, value_cache = as_bits(key_cache), as_bits(value_cache)
    out = out.view(np.int16) if out.dtype == np.float16 else out
    num_kv_heads = key_cache.shape[1]
    query = as_input(query, key_cache)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    context_lens = np.ascontiguousarray(context_lens, dtype=np.int32)
    target = output_target(out, key_cache)
    num_parts = 1
    if partition_size is None:
        partition_size = 0
        threads = numba.get_num_threads() if num_threads is None else num_threads
        num_parts = auto_partitions(num_seqs, num_kv_heads, threads)
    if partition_size > 0 or num_parts > 1:
        _decode_partitioned_kernel(target, query, key_cache, value_cache, block_tables,
                                   context_lens, float(scale), partition_size, num_parts)
    else:
        _decode_kernel(target, query, key_cache, value_cache, block_tables, context_lens,
                       float(scale))
    if target is not out:
        out[...] = target
