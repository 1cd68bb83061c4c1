"""Numba CPU paged attention of query rows over a prefix of their sequence's cache: decode (one
row per sequence, over its whole context), and prefill through it (``kernels/cpu/prefill.py``).

- One task per (row, KV head) in a ``prange``: every K/V row of the context is loaded once for
  the whole group of query heads that share it (grouped-query attention). The group's queries
  and its output accumulators are values held in registers for the whole context
  (``Rows``, ``kernels/cpu/vectors.py``), with ``GroupShape`` (heads per KV head, head_dim)
  compiled in as constants: one specialization per model shape and formats.
- Tiles of up to ``TILE`` (16) tokens of one block. Keys: per key, partial dot products with each
  query of the group (``vdpbf16ps`` on bfloat16 pairs where the CPU has AVX-512 BF16 and query
  and cache are both bfloat16; else widened to float32 and multiplied there), then the tile's 16
  scores per query at once by a transposing tree (``tile_scores``) instead of a horizontal sum
  per key. Softmax: online, one step per tile, in vectors (``tile_softmax``: the ``exp``
  polynomial of ``common.exp_nonpositive``, one rescale per tile, the running sums kept per lane).
  Values: widened once per row for the group, accumulated with FMAs into the registers.
- Software pipelining: the keys of tile i + 1 are read in the same loop as the values of tile i,
  so that the two dependency chains (scores -> softmax -> weights, and the accumulators) overlap.
- Everything accumulates in float32; ``out`` is written once, at the end, in its format (float32
  or the cache's). 16-bit caches are bfloat16 / float16 bits (``kernels/cpu/common.py``).
- Cache blocks are scattered over the pool, so the hardware prefetchers, which follow contiguous
  streams, stall at every block boundary: each row read prefetches the row at the same offset
  ``_PREFETCH_AHEAD`` (2) blocks ahead (``llvm.prefetch``, into L2). Without it the kernel below
  took 1.6x as long at batch 64; 1, 3 or 4 blocks ahead or prefetching into L1 measured within
  5% of it.
  The last blocks of a task prefetch the first blocks of the task the thread runs next (the
  same offsets in its table), so the prefetches do not stop at a task's end: float32, batch 64,
  context 256, 30 layers, 2 threads on a 2-core AMD EPYC Zen 4, 9 interleaved rounds, median
  ratio to prefetching nothing past the end 0.944 (ragged contexts 0.953, bfloat16 0.961).
- The tile loop makes no call: a tile's block and prefetch target come from integers (``_tile``),
  where an inlined helper given the block tables had numba count references on them (an atomic
  increment and decrement, and the accumulators spilled around the calls) at every tile. Against
  that, median of 15 interleaved rounds on Zen 4: 1 x 256 (serial) 0.979, in cache (16 x 256, one
  layer's pool, 30 calls) bfloat16 0.945; 64 x 256, bound by memory, float32 0.999, bf16 0.993.
- What a call runs is planned from the rows' metadata alone (``kernels/cpu/rows_plan.py``: the
  task order, serial or parallel, partitions for few long rows), once per step for all layers
  (``plan_rows``), and run here (``run_plan``).

Measured against the previous kernel (a dot product and a horizontal sum per key and head, the
group's accumulators in memory, a softmax step per block in scalar code), SmolLM2's shapes (9
query heads, 3 KV heads, head_dim 64, block size 16) on a 2-core AMD EPYC Zen 5 (AVX-512 BF16),
a machine shared with other work: a decode step's attention, 30 layers, batch 64, context 256,
randomly placed blocks, 2 threads: bf16 23.2 -> 13.0 ms, fp32 31.8 -> 24.8 ms (about 30 GB/s of
K/V read: bound by memory; torch's sum over 400 MB read 45-55 GB/s in the same hour); one layer
over caches in L3, 1 thread (the compute): bf16 14.7 -> 5.7 ms, fp32 19.3 -> 7.6 ms per 30
calls. Tried and not kept: one task per sequence with the KV heads of a tile one after the other
(contiguous K/V reads: no faster with scattered blocks), widening bfloat16 pairs with one
instruction per 16 lanes (no faster).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.common import _FASTMATH, as_bits, as_input, narrow_like, output_target, tanh_f32
from kernels.cpu.rows_plan import RowsPlan, plan_rows
from kernels.cpu.tiles import tile_scores, tile_softmax
from kernels.cpu.vectors import (
    TILE, GroupShape, add_weighted_row, query_operand, scale_rows, store_partial_dots, store_rows,
    zero_rows,
)

_PREFETCH_AHEAD = 2  # cache blocks ahead of the one being read whose K/V are prefetched


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _scratch(group):
    """One task's float32 scratch: partial dots [G * TILE * 16], the scores of two tiles and the
    running sums per lane [G * TILE] each, rescale factors [G]."""
    buf = np.empty(group * TILE * 16 + 3 * group * TILE + group, np.float32)
    o = group * TILE * 16
    gt = group * TILE
    return buf[:o], buf[o:o + gt], buf[o + gt:o + 2 * gt], buf[o + 2 * gt:o + 3 * gt], \
        buf[o + 3 * gt:]


@njit(cache=True, nogil=True, inline="always")
def _tile(seq, kvh, pos, end, block_size, following):
    """The tile at ``pos`` of (sequence ``seq``, KV head ``kvh``), up to TILE tokens of one block
    (fewer at the block's or the context's end), and the row to prefetch: (tokens, the tile's
    block index, its offset in the block, then (sequence, KV head, block index) of the row at the
    same offset _PREFETCH_AHEAD blocks ahead). Within the last _PREFETCH_AHEAD blocks of the range
    that row is in the first blocks of ``following`` (sequence, KV head, start, end: the range the
    thread attends next, ``_following``), so that the prefetches do not stop at a task's end and
    the next task's first blocks are not read cold; when that range is empty, the tile's own row
    again. Integers only: an array passed to an inlined function costs a reference count
    increment and decrement at each call."""
    bi = pos // block_size
    off = pos - bi * block_size
    n = min(TILE, block_size - off, end - pos)
    a = bi + _PREFETCH_AHEAD
    if a * block_size < end:
        return n, bi, off, seq, kvh, a
    next_seq, next_kvh, next_start, next_end = following
    j = next_start // block_size + a - (end - 1) // block_size - 1
    if next_start < next_end and j * block_size < next_end:
        return n, bi, off, next_seq, next_kvh, j
    return n, bi, off, seq, kvh, bi


@njit(cache=True, nogil=True, inline="always")
def _window_start(length, window):
    """The first position a row attending ``[0, length)`` reads: ``length - window`` (its last
    ``window`` positions) with a sliding window (``window > 0``), else 0."""
    return max(0, length - window) if window > 0 else 0


@njit(cache=True, nogil=True, inline="always")
def _following(seqs, lens, num_kv_heads, task, num_parts=1, partition_size=0, window=0):
    """The range task ``task + 1`` of the rows kernels attends: (sequence, KV head, start, end); after
    the last task an empty range. Tasks run row by row, KV head by KV head, and (the partitioned
    kernel: ``num_parts`` partitions of ``partition_size`` tokens) partition by partition; with
    ``partition_size`` 0 a task is a whole context. numba hands each thread a contiguous share of
    the tasks, so it is the one the thread runs next (or the next thread's first). ``window``: the
    sliding window (``_window_start``), whose blocks before it are never read, prefetches included."""
    nxt = task + 1
    ik = nxt // num_parts
    i = ik // num_kv_heads
    if i >= seqs.shape[0]:
        return seqs[0], 0, 0, 0
    first = _window_start(lens[i], window)
    if partition_size == 0:
        return seqs[i], ik - i * num_kv_heads, first, lens[i]
    start = max((nxt - ik * num_parts) * partition_size, first)
    return seqs[i], ik - i * num_kv_heads, start, min(start + partition_size, lens[i])


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", inline="always")
def _cap_tile(scores, n, scale, softcap):
    """Soft-cap a tile's raw scores ``[G * TILE]`` in place, so that ``tile_softmax``'s
    ``scale * scores`` is ``softcap * tanh(scale * q.k / softcap)`` (Gemma 2's
    ``attn_logit_softcapping``): stored divided by ``scale``, which that product undoes to within
    a rounding. Every lane, the ``n`` valid ones and the rest (which ``tile_softmax`` masks): one
    fixed-length loop of ``tanh_f32`` that vectorizes; only calls with a soft-cap come here. (A
    loop over the valid lanes of each row, not inlined, made Gemma 2's decode attention 1.7x
    Llama's at 64 streams.)"""
    inv_cap = np.float32(1.0) / softcap
    back = softcap / scale
    factor = scale * inv_cap
    for i in range(scores.shape[0]):
        scores[i] = tanh_f32(scores[i] * factor) * back


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _attend_range(acc, m, l, qv, key_cache, value_cache, block_tables, seq, kvh, start, end, scale,
                  following, softcap):
    """Accumulate positions ``[start, end)`` (``start < end``) of one sequence for one KV head's
    query group; returns the new ``acc``. ``following``: the range attended next, whose first
    blocks the last ones prefetch (``_tile``).

    acc: Rows[G x D] unnormalized output; m: [G] float32 running max, ``-inf`` on entry; l: [G]
    float32, set to the softmax denominators (relative to ``m``); qv: the group's query
    (``query_operand``); block_tables: [S, max_blocks], the sequence's row ``seq``.

    Software-pipelined by tiles: a pass of the loop reads the keys of tile i + 1 and the values of
    tile i (the first pass keys only), so the two dependency chains (scores -> softmax -> weights;
    the accumulators) overlap. One place computes a tile (``_tile``), so the loop has no call.

    ``softcap > 0``: each tile's scores are soft-capped before its softmax step (``_cap_tile``);
    0, the default path, costs one branch per tile.
    """
    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    stride = num_kv_heads * block_size * head_dim
    part, sco, sco_next, lanes, alpha = _scratch(m.shape[0])
    lanes[:] = 0.0
    n, row, ahead = 0, 0, 0  # the tile whose values this pass of the loop reads (none at first)
    nxt = start
    while True:
        # the tile at nxt, whose keys this pass reads, and the row to prefetch (``_tile``)
        n1, row1, ahead1 = 0, row, ahead
        if nxt < end:
            n1, bi, off, a_seq, a_kvh, a_bi = _tile(seq, kvh, nxt, end, block_size, following)
            row1 = block_tables[seq, bi] * stride + (kvh * block_size + off) * head_dim
            ahead1 = block_tables[a_seq, a_bi] * stride + (a_kvh * block_size + off) * head_dim
        for t in range(max(n, n1)):
            if t < n1:
                store_partial_dots(part, t, qv, key_cache, row1 + t * head_dim,
                                   ahead1 + t * head_dim)
            if t < n:
                acc = add_weighted_row(acc, sco, t, value_cache, row + t * head_dim,
                                       ahead + t * head_dim)
        if n1 == 0:
            for g in range(m.shape[0]):
                l[g] = lanes[g * TILE:(g + 1) * TILE].sum()
            return acc
        tile_scores(sco_next, part, qv)
        if softcap > 0:
            _cap_tile(sco_next, n1, scale, softcap)
        tile_softmax(sco_next, m, lanes, alpha, n1, scale, qv)
        acc = scale_rows(acc, alpha)
        sco, sco_next = sco_next, sco
        n, row, ahead = n1, row1, ahead1
        nxt += n1


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _row_task(out, query, key_cache, value_cache, block_tables, rows, seqs, lens, scale, shape,
              task, window, softcap):
    """Task ``task`` of the rows kernels: row ``task // num_kv_heads`` of the task order, for KV
    head ``task % num_kv_heads``, written to ``out``. ``window`` > 0: only the row's last
    ``window`` positions (``_window_start``); ``softcap`` > 0: soft-capped scores."""
    group, head_dim = shape.rows, shape.width
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[1]
    i = task // num_kv_heads
    kvh = task - i * num_kv_heads
    r = rows[i]
    h0 = kvh * group
    buf = np.empty(group * (head_dim + 2), np.float32)
    m, l, res = buf[:group], buf[group:2 * group], buf[2 * group:]
    m[:] = -np.inf
    qv = query_operand(query, (r * num_heads + h0) * head_dim, shape, key_cache)
    acc = _attend_range(zero_rows(shape), m, l, qv, key_cache, value_cache, block_tables, seqs[i],
                        kvh, _window_start(lens[i], window), lens[i], scale,
                        _following(seqs, lens, num_kv_heads, task, 1, 0, window), softcap)
    store_rows(res, 0, acc)
    out_rows = out[r, h0:h0 + group]
    for g in range(group):
        inv = np.float32(1.0) / l[g]
        for d in range(head_dim):
            out_rows[g, d] = narrow_like(out_rows, res[g * head_dim + d] * inv)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _rows_kernel(out, query, key_cache, value_cache, block_tables, rows, seqs, lens, scale, shape,
                 window, softcap):
    # out, query: [R, H, D] float32 or the cache's format; key_cache, value_cache: [num_blocks,
    # num_kv_heads, block_size, D] float32 / bf16 bits (uint16) / fp16 bits (int16);
    # block_tables: [S, max_blocks] int32; rows, seqs, lens: [N] int32, in task order: the query
    # (and out) row, its block-table row, and the positions it attends to ([0, lens[i]), >= 1);
    # shape: GroupShape(H / num_kv_heads, D), compile-time constants; window: int, > 0 a sliding
    # window; softcap: float32, > 0 soft-capped scores (``_row_task``).
    # Tasks: (row i, KV head), over the rows in the given order, in parallel.
    sc = np.float32(scale)
    for task in prange(rows.shape[0] * key_cache.shape[1]):
        _row_task(out, query, key_cache, value_cache, block_tables, rows, seqs, lens, sc, shape,
                  task, window, softcap)


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _rows_serial_kernel(out, query, key_cache, value_cache, block_tables, rows, seqs, lens, scale,
                        shape, window, softcap):
    # as _rows_kernel, on the calling thread: for work too small to pay for waking the others
    sc = np.float32(scale)
    for task in range(rows.shape[0] * key_cache.shape[1]):
        _row_task(out, query, key_cache, value_cache, block_tables, rows, seqs, lens, sc, shape,
                  task, window, softcap)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _rows_partitioned_kernel(out, query, key_cache, value_cache, block_tables, rows, seqs, lens,
                             scale, partition_size, shape, window, softcap):
    # out, query, caches, block_tables, rows, seqs, lens, shape, window, softcap: as in
    # _rows_kernel (partitions before a row's window are empty and left out of the merge);
    # partition_size: tokens per partition, a multiple of the block size
    group, head_dim = shape.rows, shape.width
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[1]
    max_len = 0
    for i in range(lens.shape[0]):  # a loop: .max() would be a parallel region of its own
        max_len = max(max_len, lens[i])
    num_parts = (max_len + partition_size - 1) // partition_size
    sc = np.float32(scale)
    tasks = rows.shape[0] * num_kv_heads * num_parts
    part_acc = np.empty((tasks, group, head_dim), np.float32)  # unnormalized partial outputs
    part_stats = np.empty((tasks, 2, group), np.float32)  # running max and sum
    # phase 1: every (row, KV head, partition) on its own, unnormalized
    for task in prange(tasks):
        p = task % num_parts
        ik = task // num_parts
        i = ik // num_kv_heads
        kvh = ik - i * num_kv_heads
        m = part_stats[task, 0]
        l = part_stats[task, 1]
        m[:] = -np.inf
        l[:] = 0.0
        acc = zero_rows(shape)
        start = max(p * partition_size, _window_start(lens[i], window))
        end = min(p * partition_size + partition_size, lens[i])
        if start < end:
            qv = query_operand(query, (rows[i] * num_heads + kvh * group) * head_dim, shape,
                               key_cache)
            acc = _attend_range(acc, m, l, qv, key_cache, value_cache, block_tables, seqs[i], kvh,
                                start, end, sc, _following(seqs, lens, num_kv_heads, task, num_parts,
                                                           partition_size, window), softcap)
        store_rows(part_acc, task * group * head_dim, acc)
    # phase 2: log-sum-exp merge of the partitions of each (row, KV head); serial, since the entry
    # point partitions small batches only and a second parallel region costs more
    o = np.empty(head_dim, np.float32)
    for ik in range(rows.shape[0] * num_kv_heads):
        i = ik // num_kv_heads
        kvh = ik - i * num_kv_heads
        used = (lens[i] + partition_size - 1) // partition_size
        first = _window_start(lens[i], window) // partition_size  # the first non-empty partition
        for g in range(group):
            gmax = np.float32(-np.inf)
            for p in range(first, used):
                gmax = max(gmax, part_stats[ik * num_parts + p, 0, g])
            for d in range(head_dim):  # loops, not o[:] = 0.0: an array expression here would
                o[d] = 0.0  # be a parallel region of its own, one per row and head
            total = np.float32(0.0)
            for p in range(first, used):
                task = ik * num_parts + p
                w = np.exp(part_stats[task, 0, g] - gmax)
                total += w * part_stats[task, 1, g]
                a = part_acc[task, g]
                for d in range(head_dim):
                    o[d] += w * a[d]
            inv = np.float32(1.0) / total
            row = out[rows[i], kvh * group + g]
            for d in range(head_dim):
                row[d] = narrow_like(row, o[d] * inv)


def run_plan(out, query, key_cache, value_cache, plan: RowsPlan | None, scale, window: int = 0,
             softcap: float = 0.0) -> None:
    """``attend_rows`` on a plan made for these rows (``plan_rows``)."""
    if plan is None:
        return
    key_cache, value_cache = as_bits(key_cache), as_bits(value_cache)
    out = out.view(np.int16) if out.dtype == np.float16 else out
    shape = GroupShape.of(query.shape[1] // key_cache.shape[1], query.shape[2])
    query = as_input(query, key_cache)
    target = output_target(out, key_cache)
    rows, seqs, lens, block_tables = plan.rows, plan.seqs, plan.lens, plan.block_tables
    window, softcap = int(window), np.float32(softcap)
    if plan.partition_size:
        _rows_partitioned_kernel(target, query, key_cache, value_cache, block_tables, rows, seqs,
                                 lens, float(scale), plan.partition_size, shape, window, softcap)
    else:
        kernel = _rows_serial_kernel if plan.serial else _rows_kernel
        kernel(target, query, key_cache, value_cache, block_tables, rows, seqs, lens, float(scale),
               shape, window, softcap)
    if target is not out:
        if plan.row_ids is None:
            out[...] = target
        else:
            out[plan.row_ids] = target[plan.row_ids]


def attend_rows(out, query, key_cache, value_cache, block_tables, row_seqs, row_lens, scale,
                partition_size: int | None = None, num_threads: int | None = None,
                partition_threads: int | None = None, row_ids=None, window: int = 0,
                softcap: float = 0.0) -> None:
    """Query row ``r`` attends to positions ``[0, row_lens[r])`` of sequence ``row_seqs[r]``'s
    cache (``row_lens`` >= 1); writes ``out`` in place. What decode (one row per sequence) and
    prefill (one row per new token, causal) both are. ``window`` > 0: to its last ``window``
    positions only, the blocks before them never read (nor their table entries); ``softcap`` > 0:
    scores soft-capped (``kernels/reference.py``).

    Caches: float32, numpy float16, or 16-bit bits (``kernels/cpu/common.py``); ``query`` and
    ``out`` ([R, H, D]) float32 or the cache's format. ``partition_size``: ``None`` chooses
    (``auto_partitions``), ``0`` never partitions, a positive number splits the contexts into
    partitions of that many tokens (rounded up to a multiple of the block size; a context no
    longer than one partition is not split).
    ``num_threads``: numba's current count, when the caller knows it. Calls with little work
    (``MAX_SERIAL_WORK``) or one thread run on the calling thread. ``partition_threads``: the
    count ``auto_partitions`` sizes the partitions for (default ``num_threads``); a caller whose
    count changes from call to call fixes it, so that the partitions, and with them the sums'
    order and every output bit, do not change with it. ``row_ids``: only these rows (indices
    into ``query``, ``out``, ``row_seqs`` and ``row_lens``) are computed, the others' ``out`` left
    as it was; default all.
    """
    if row_ids is None and len(row_lens) != query.shape[0]:
        raise ValueError(f"{query.shape[0]} query rows with {len(row_lens)} lengths")
    plan = plan_rows(block_tables, row_seqs, row_lens, key_cache.shape[1], key_cache.shape[2],
                     partition_size, num_threads, partition_threads, row_ids)
    run_plan(out, query, key_cache, value_cache, plan, scale, window, softcap)


def paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                           partition_size: int | None = None, num_threads: int | None = None,
                           partition_threads: int | None = None, window: int = 0,
                           softcap: float = 0.0) -> None:
    """One query per sequence over its whole context (its last ``window`` positions where
    ``window`` > 0); writes ``out`` in place. Formats and options as in ``attend_rows``."""
    attend_rows(out, query, key_cache, value_cache, block_tables, np.arange(query.shape[0]),
                context_lens, scale, partition_size, num_threads, partition_threads,
                window=window, softcap=softcap)
