"""Numba CPU forms of the paged-attention kernels (layouts and semantics: ``kernels/reference.py``).

The module-level functions take numpy arrays, in the reference's argument order, and write their
output argument in place. ``NumbaCPUBackend`` adapts them to the torch tensors of the attention
dispatch (``services/executor/attention.py``), zero-copy through ``Tensor.numpy()``.

Design notes

- Decode runs one task per (sequence, KV head) in a ``prange``: every K/V row of the sequence is
  loaded once and used by the whole group of query heads that share it (grouped-query attention).
  The softmax is online at block granularity: the scores of one cache block are computed for the
  group, then the running max / sum / accumulator are rescaled once per block (not per token).
  Everything accumulates in float32.
- A small batch gives too few tasks to keep every thread evenly busy, so the decode entry point
  then splits each context into partitions (a multiple of the block size, at least
  ``MIN_PARTITION_SIZE`` tokens: short contexts stay whole), runs (sequence, KV head, partition)
  tasks in parallel, and merges the partial results with the log-sum-exp rule.
- Cache blocks are scattered over the pool, so the hardware prefetchers, which follow contiguous
  streams, stall at every block boundary: while reading one block the kernel prefetches the K/V
  rows of the block two ahead (``llvm.prefetch``, into L2), one row per row read. That took the
  memory-bound decode shapes from ~1.4x to ~0.8x the time of SDPA over a contiguous cache.
- Prefill runs one task per (sequence, KV head, tile of ``_PREFILL_TILE`` query rows): each K/V row
  is loaded once for the tile's rows times the group's heads; causality is a per-row position test.
- ``fastmath`` is limited to ``reassoc``/``contract`` (plus ``nsz``/``arcp``) so that the dot
  products over ``head_dim`` vectorize; no ``nnan``/``ninf`` (the running max starts at ``-inf``)
  and no ``afn`` (``exp`` stays the libm one).
- Compilation: ``cache=True`` (the cache lives in ``kernels/__pycache__``, or ``NUMBA_CACHE_DIR``).
  The wrappers pass C-contiguous float32 / int32 / int64 arrays and a Python float, so each kernel
  has a single specialization for float32 caches.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels import reference


@intrinsic
def _prefetch(typingctx, array, index):
    """Hint the CPU to fetch the cache line holding ``array.flat[index]`` (C-contiguous array)."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        # read, locality 1 (x86 prefetcht2: into L2, not L1), data cache. Measured on Zen 4 against
        # locality 3 (prefetcht0): 25-30% less time on the memory-bound shapes; 2 blocks ahead
        # beat 1 and tied with 3-4.
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 1), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_PREFETCH_AHEAD = 2  # cache blocks ahead of the one being read whose K/V are prefetched
_PREFILL_TILE = 16  # query rows per prefill task
MIN_PARTITION_SIZE = 128  # tokens: the automatic partitions are never shorter


# --------------------------------------------------------------------------------------------------
# write


@njit(parallel=True, cache=True, nogil=True)
def _write_kv_kernel(key_cache, value_cache, key, value, slot_mapping):
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    # key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[2]
    for i in prange(num_tokens):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                key_cache[blk, h, off, d] = key[i, h, d]
                value_cache[blk, h, off, d] = value[i, h, d]


def write_kv_cache(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatter the new tokens' K/V into their slots; negative slots are padding and are skipped."""
    if key.shape[0] == 0:
        return
    _write_kv_kernel(
        key_cache, value_cache,
        np.ascontiguousarray(key, dtype=key_cache.dtype),
        np.ascontiguousarray(value, dtype=value_cache.dtype),
        np.ascontiguousarray(slot_mapping, dtype=np.int64),
    )


# --------------------------------------------------------------------------------------------------
# decode


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _attend_range(acc, m, l, sco, q, key_cache, value_cache, table, kvh, h0, start, end, scale):
    """Accumulate positions ``[start, end)`` of one sequence for one KV head's query group.

    acc: [G, D] unnormalized output; m, l: [G] running max and sum; sco: [G, block_size] scratch;
    q: [num_heads, D] the sequence's query; table: [max_blocks] its block table; the group is the
    query heads ``h0 .. h0 + G``. ``start`` must be a multiple of the block size.
    """
    group = acc.shape[0]
    head_dim = acc.shape[1]
    block_size = key_cache.shape[2]
    pos = start
    while pos < end:
        blk = table[pos // block_size]
        n = min(block_size, end - pos)
        kb = key_cache[blk, kvh]  # [block_size, D]
        vb = value_cache[blk, kvh]
        # the blocks are scattered, so no hardware prefetcher guesses the next one: prefetch the
        # K/V rows of the block _PREFETCH_AHEAD blocks ahead, one row per row processed here
        ahead = pos + _PREFETCH_AHEAD * block_size
        prefetch = ahead < end
        if prefetch:
            kn = key_cache[table[ahead // block_size], kvh]
            vn = value_cache[table[ahead // block_size], kvh]
        else:
            kn = kb
            vn = vb
        # scores of the block's tokens, each K row loaded once for the whole group
        for t in range(n):
            k = kb[t]
            if prefetch:
                for i in range(0, head_dim, 16):  # one 64-byte line of float32 each
                    _prefetch(kn, t * head_dim + i)
            for g in range(group):
                qg = q[h0 + g]
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
        for t in range(n):
            v = vb[t]
            if prefetch:
                for i in range(0, head_dim, 16):
                    _prefetch(vn, t * head_dim + i)
            for g in range(group):
                p = sco[g, t]
                a = acc[g]
                for d in range(head_dim):
                    a[d] += p * v[d]
        pos += n


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _decode_kernel(out, query, key_cache, value_cache, block_tables, context_lens, scale):
    # out, query: [S, H, D] float32 (out is the accumulator); block_tables: [S, max_blocks] int32;
    # context_lens: [S] int32
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    sc = np.float32(scale)
    # per-task scratch, allocated once outside the parallel loop
    sco = np.empty((num_seqs * num_kv_heads, group, key_cache.shape[2]), np.float32)
    stats = np.empty((num_seqs * num_kv_heads, 2, group), np.float32)
    for task in prange(num_seqs * num_kv_heads):
        s = task // num_kv_heads
        kvh = task - s * num_kv_heads
        h0 = kvh * group
        acc = out[s, h0:h0 + group]  # [G, D]
        m = stats[task, 0]
        l = stats[task, 1]
        for g in range(group):
            m[g] = -np.inf
            l[g] = 0.0
            for d in range(head_dim):
                acc[g, d] = 0.0
        _attend_range(acc, m, l, sco[task], query[s], key_cache, value_cache, block_tables[s],
                      kvh, h0, 0, context_lens[s], sc)
        for g in range(group):
            inv = np.float32(1.0) / l[g]
            for d in range(head_dim):
                acc[g, d] *= inv


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _decode_partitioned_kernel(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                               partition_size, num_parts):
    # out, query: [S, H, D] float32; block_tables: [S, max_blocks] int32; context_lens: [S] int32;
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
    sco = np.empty((tasks, group, key_cache.shape[2]), np.float32)
    # phase 1: every (sequence, KV head, partition) on its own, unnormalized
    for task in prange(num_seqs * num_kv_heads * num_parts):
        p = task % num_parts
        sk = task // num_parts
        s = sk // num_kv_heads
        kvh = sk - s * num_kv_heads
        acc = part_acc[task]
        m = part_stats[task, 0]
        l = part_stats[task, 1]
        for g in range(group):
            m[g] = -np.inf
            l[g] = 0.0
            for d in range(head_dim):
                acc[g, d] = 0.0
        start = p * partition_size
        end = min(start + partition_size, context_lens[s])
        if start < end:
            _attend_range(acc, m, l, sco[task], query[s], key_cache, value_cache, block_tables[s],
                          kvh, kvh * group, start, end, sc)
    # phase 2: log-sum-exp merge of the partitions of each (sequence, KV head); serial, since the
    # entry point partitions small batches only and a second parallel region costs more
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
            o = out[s, kvh * group + g]
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
            for d in range(head_dim):
                o[d] *= inv


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

    ``partition_size``: ``None`` chooses (``auto_partitions``), ``0`` never partitions, a positive
    number forces the partitioned form with partitions of that many tokens (rounded up to a
    multiple of the block size). ``num_threads``: numba's current count, when the caller knows it.
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return
    num_kv_heads = key_cache.shape[1]
    query = np.ascontiguousarray(query, dtype=np.float32)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    context_lens = np.ascontiguousarray(context_lens, dtype=np.int32)
    target = out if (out.flags.c_contiguous and out.dtype == np.float32) else np.empty(
        query.shape, np.float32)
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


# --------------------------------------------------------------------------------------------------
# prefill


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _prefill_kernel(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                    scale, task_seq, task_row):
    # out, query: [T, H, D] float32 (out is the accumulator); block_tables: [S, max_blocks] int32;
    # query_start_loc: [S + 1] int32; context_lens: [S] int32; task_seq, task_row: [num_tiles]
    # int32 (sequence, first query row of each tile of _PREFILL_TILE rows)
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = key_cache.shape[1]
    block_size = key_cache.shape[2]
    group = num_heads // num_kv_heads
    tile = _PREFILL_TILE
    sc = np.float32(scale)
    sco = np.empty((task_seq.shape[0] * num_kv_heads, tile * group, block_size), np.float32)
    stats = np.empty((task_seq.shape[0] * num_kv_heads, 2, tile * group), np.float32)
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
        sc_t = sco[task]
        m = stats[task, 0]
        l = stats[task, 1]
        for r in range(rows):
            for g in range(group):
                m[r * group + g] = -np.inf
                l[r * group + g] = 0.0
                o = out[row0 + r, h0 + g]
                for d in range(head_dim):
                    o[d] = 0.0
        pos = 0
        while pos < end:
            blk = table[pos // block_size]
            n = min(block_size, end - pos)
            kb = key_cache[blk, kvh]
            vb = value_cache[blk, kvh]
            for t in range(n):
                k = kb[t]
                kp = pos + t
                for r in range(rows):
                    if kp > first_pos + r:  # causal: row r sees positions <= first_pos + r
                        for g in range(group):
                            sc_t[r * group + g, t] = -np.inf
                    else:
                        qr = query[row0 + r]
                        for g in range(group):
                            qg = qr[h0 + g]
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
                        o = out[row0 + r, h0 + g]
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
            for t in range(n):
                v = vb[t]
                kp = pos + t
                for r in range(rows):
                    if kp > first_pos + r:
                        continue
                    orow = out[row0 + r]
                    for g in range(group):
                        p = sc_t[r * group + g, t]
                        o = orow[h0 + g]
                        for d in range(head_dim):
                            o[d] += p * v[d]
            pos += n
        for r in range(rows):
            for g in range(group):
                inv = np.float32(1.0) / l[r * group + g]
                o = out[row0 + r, h0 + g]
                for d in range(head_dim):
                    o[d] *= inv


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale) -> None:
    """New tokens attend causally to themselves and their cached prefix; writes ``out`` in place."""
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
    query = np.ascontiguousarray(query, dtype=np.float32)
    target = out if (out.flags.c_contiguous and out.dtype == np.float32) else np.empty(
        query.shape, np.float32)
    _prefill_kernel(
        target, query, key_cache, value_cache, np.ascontiguousarray(block_tables, dtype=np.int32),
        query_start_loc, np.ascontiguousarray(context_lens, dtype=np.int32), float(scale),
        task_seq, task_row,
    )
    if target is not out:
        out[...] = target


# --------------------------------------------------------------------------------------------------
# block copies


@njit(parallel=True, cache=True, nogil=True)
def _copy_rows_kernel(dst, src, mapping):
    # dst: [num_dst_blocks, block_elems], src: [num_src_blocks, block_elems]; mapping: [P, 2] int64
    # (src block, dst block)
    n = dst.shape[1]
    for i in prange(mapping.shape[0]):
        a = src[mapping[i, 0]]
        b = dst[mapping[i, 1]]
        for j in range(n):
            b[j] = a[j]


def _as_rows(cache):
    if not cache.flags.c_contiguous:
        raise ValueError("block pools must be C-contiguous")
    return cache.reshape(cache.shape[0], -1)


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy whole blocks inside each pool (copy-on-write), every layer.

    Like the reference (``cache[dst] = cache[src]``, a gather then a scatter), the sources are read
    before any destination is written: when a block is both a source and a destination the copy
    goes through a temporary.
    """
    mapping = np.ascontiguousarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if mapping.shape[0] == 0:
        return
    overlap = np.intersect1d(mapping[:, 0], mapping[:, 1]).size > 0
    for cache in (*key_caches, *value_caches):
        if overlap:
            cache[mapping[:, 1]] = cache[mapping[:, 0]]
        else:
            rows = _as_rows(cache)
            _copy_rows_kernel(rows, rows, mapping)


def swap_blocks(dst, src, block_mapping) -> None:
    """Copy whole blocks from one pool to another (device pool <-> CPU swap pool)."""
    mapping = np.ascontiguousarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if mapping.shape[0] == 0:
        return
    if dst.dtype != src.dtype:
        dst[mapping[:, 1]] = src[mapping[:, 0]]
        return
    _copy_rows_kernel(_as_rows(dst), _as_rows(src), mapping)


# --------------------------------------------------------------------------------------------------
# the backend of services/executor/attention.py


_thread_state = threading.local()


def sync_threads() -> int:
    """Give numba's parallel loops the same thread count as torch, and return it.

    numba's setting belongs to the calling thread, so this runs on every call (cheaply: numba is
    only told again when torch's count changed since this thread's last call).
    """
    wanted = torch.get_num_threads()
    state = _thread_state.__dict__
    if state.get("torch") != wanted:
        n = max(1, min(wanted, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(n)
        state["torch"], state["numba"] = wanted, n
    return state["numba"]


def _np(t):
    return t.detach().numpy() if t.requires_grad else t.numpy()  # zero-copy either way


class NumbaCPUBackend:
    """Numba CPU kernels behind the dispatch's backend interface (torch CPU tensors, in place).

    float32 KV caches take the Numba kernels; other dtypes (float16, bfloat16: numpy has no
    bfloat16) and non-contiguous caches fall back to the PyTorch reference.
    """

    name = "numba"

    @staticmethod
    def _fast(*tensors) -> bool:
        return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        if not (self._fast(key_cache, value_cache, key, value)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        sync_threads()
        write_kv_cache(_np(key_cache), _np(value_cache), _np(key), _np(value), _np(slot_mapping))

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale) -> None:
        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_decode_attention(
                out, query, key_cache, value_cache, block_tables, context_lens, scale)
        threads = sync_threads()
        paged_decode_attention(_np(out), _np(query), _np(key_cache), _np(value_cache),
                               _np(block_tables), _np(context_lens), scale, num_threads=threads)

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                context_lens, scale) -> None:
        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_prefill_attention(
                out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale)
        sync_threads()
        paged_prefill_attention(_np(out), _np(query), _np(key_cache), _np(value_cache),
                                _np(block_tables), _np(query_start_loc), _np(context_lens), scale)


__all__ = [
    "MIN_PARTITION_SIZE", "NumbaCPUBackend", "auto_partitions", "copy_blocks",
    "paged_decode_attention", "paged_prefill_attention", "swap_blocks", "sync_threads",
    "write_kv_cache",
]
