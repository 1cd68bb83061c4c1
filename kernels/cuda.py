"""Numba CUDA forms of the paged-attention kernels (layouts and semantics: ``kernels/reference.py``).

Importing this module needs no GPU (kernels compile lazily, on first launch); ``NumbaCUDABackend()``
raises ImportError where CUDA is unavailable, so the dispatch's ``auto`` falls back to torch.

Kernels (all module-level ``cuda.jit`` kernels, float32 in, float32 accumulation). No device
functions, not even the library's: ``min``/``max`` and ``cuda.shfl_xor_sync`` are device functions
in numba, which ``cuda.compile_ptx`` cannot compile without a current device, so the kernels use
``if`` and ``cuda.shfl_sync_intrinsic``.

- ``write_kv_kernel``: one thread block per token.
- ``decode_kernel``: one thread block per (sequence, query head, partition). Grouped-query heads
  of one KV head read the same K/V rows, from L1/L2, in their own blocks: simpler than one block
  per KV head, and the grid is ``num_heads`` times larger, which fills the GPU at small batches.
  A partition is at most ``MAX_PARTITION`` tokens whose logits stay in shared memory: scores
  (one warp per token, lanes split ``head_dim``), block-wide max, ``exp``, block-wide sum, then
  the weighted V sum (threads split ``head_dim`` and the partition's tokens).
  With one partition the kernel writes the normalized output; with several (long contexts, or a
  forced ``partition_size``) it writes each partition's normalized output, max logit and
  exp-sum, and ``merge_kernel`` combines them with the log-sum-exp rule.
- ``prefill_kernel``: one thread block per (query token, query head, partition): the decode
  algorithm for each new token, over positions ``[0, its position]`` (causal), sharing
  ``merge_kernel``.
- ``copy_blocks_kernel``: one thread block per (src, dst) pair; serves ``copy_blocks`` and
  ``swap_blocks`` between two device pools (host <-> device swaps are plain copies).

Reductions: on a GPU, warp shuffles (``shfl_sync_intrinsic`` in xor mode) and a shared array of
one value per warp; the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) has no warp shuffles, so there
the same kernels reduce through shared memory (``USE_SHUFFLE`` is fixed when this module is
imported, and the simulator runs 64-thread blocks, two warps, instead of 128).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda, float32

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
USE_SHUFFLE = not SIMULATOR
WARP = 32
THREADS = 64 if SIMULATOR else 128  # threads per block (the simulator runs each as a Python thread)
NUM_WARPS = THREADS // WARP
MAX_HEAD_DIM = 256
MAX_PARTITION = 512  # tokens per partition: the logits of one partition live in shared memory
# per-token partial dot products of the shared-memory (simulator) reduction; 1 when unused
PARTIALS = 1 if USE_SHUFFLE else THREADS * WARP
# warp shuffles go through the intrinsic: cuda.shfl_xor_sync is a device function, which
# cannot be compiled ahead of time without a current device
FULL_MASK = np.int32(-1)  # all 32 lanes
SHFL_XOR = 3  # shfl_sync_intrinsic mode: lane ^ offset
NEG_INF = np.float32(-np.inf)


# --------------------------------------------------------------------------------------------------
# kernels


# grid: (num_tokens,); block: (THREADS,)
@cuda.jit
def write_kv_kernel(key_cache, value_cache, key, value, slot_mapping):
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] float32
    # key, value: [num_tokens, num_kv_heads, head_dim] float32; slot_mapping: [num_tokens] int64
    i = cuda.blockIdx.x
    slot = slot_mapping[i]
    if slot < 0:
        return
    num_kv_heads = key.shape[1]
    head_dim = key.shape[2]
    block_size = key_cache.shape[2]
    blk = slot // block_size
    off = slot - blk * block_size
    for e in range(cuda.threadIdx.x, num_kv_heads * head_dim, cuda.blockDim.x):
        h = e // head_dim
        d = e - h * head_dim
        key_cache[blk, h, off, d] = key[i, h, d]
        value_cache[blk, h, off, d] = value[i, h, d]


# grid: (num_seqs, num_heads, num_partitions); block: (THREADS,)
@cuda.jit(fastmath=False)
def decode_kernel(part_out, part_max, part_sum, query, key_cache, value_cache, block_tables,
                  context_lens, scale, partition_size):
    # part_out: [num_seqs, num_heads, num_partitions, head_dim] float32 (normalized per partition;
    #   with one partition, a view of the output)
    # part_max, part_sum: [num_seqs, num_heads, num_partitions] float32
    # query: [num_seqs, num_heads, head_dim] float32
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] float32
    # block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32
    # scale: float32; partition_size: int32, <= MAX_PARTITION
    s = cuda.blockIdx.x
    h = cuda.blockIdx.y
    p = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid - warp * WARP
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = key_cache.shape[1]
    block_size = key_cache.shape[2]
    kvh = h // (num_heads // num_kv_heads)
    length = context_lens[s]
    start = p * partition_size
    if start >= length:
        return  # the whole block: this partition is past the sequence's end
    end = start + partition_size
    if end > length:
        end = length
    n = end - start

    q_sh = cuda.shared.array(MAX_HEAD_DIM, float32)
    logits = cuda.shared.array(MAX_PARTITION, float32)
    red = cuda.shared.array(THREADS, float32)
    partials = cuda.shared.array(PARTIALS, float32)
    for d in range(tid, head_dim, THREADS):
        q_sh[d] = query[s, h, d]
    cuda.syncthreads()

    # 1. logits[i] = scale * q . k[start + i]
    if USE_SHUFFLE:
        for tok in range(start + warp, end, NUM_WARPS):  # one warp per token, lanes split head_dim
            blk = block_tables[s, tok // block_size]
            off = tok - (tok // block_size) * block_size
            acc = float32(0.0)
            for d in range(lane, head_dim, WARP):
                acc += q_sh[d] * key_cache[blk, kvh, off, d]
            step = np.int32(WARP // 2)
            while step > 0:
                acc += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, acc, step, 0x1F)[0]
                step //= 2
            if lane == 0:
                logits[tok - start] = acc * scale
    else:
        for base in range(start, end, THREADS):  # rounds of THREADS tokens, block-uniform
            for j in range(warp, THREADS, NUM_WARPS):
                tok = base + j
                acc = float32(0.0)
                if tok < end:
                    blk = block_tables[s, tok // block_size]
                    off = tok - (tok // block_size) * block_size
                    for d in range(lane, head_dim, WARP):
                        acc += q_sh[d] * key_cache[blk, kvh, off, d]
                partials[j * WARP + lane] = acc
            cuda.syncthreads()
            tok = base + tid
            if tok < end:
                acc = float32(0.0)
                for k in range(WARP):
                    acc += partials[tid * WARP + k]
                logits[tok - start] = acc * scale
            cuda.syncthreads()
    cuda.syncthreads()

    # 2. block-wide max of the logits
    m = NEG_INF
    for i in range(tid, n, THREADS):
        if logits[i] > m:
            m = logits[i]
    if USE_SHUFFLE:
        step = np.int32(WARP // 2)
        while step > 0:
            other = cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, m, step, 0x1F)[0]
            if other > m:
                m = other
            step //= 2
        if lane == 0:
            red[warp] = m
        cuda.syncthreads()
        m = red[lane] if lane < NUM_WARPS else NEG_INF
        step = np.int32(WARP // 2)
        while step > 0:
            other = cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, m, step, 0x1F)[0]
            if other > m:
                m = other
            step //= 2
    else:
        red[tid] = m
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                if red[tid + step] > red[tid]:
                    red[tid] = red[tid + step]
            cuda.syncthreads()
            step //= 2
        m = red[0]
    cuda.syncthreads()

    # 3. exponentials (in place) and their block-wide sum
    total = float32(0.0)
    for i in range(tid, n, THREADS):
        e = math.exp(logits[i] - m)
        logits[i] = e
        total += e
    if USE_SHUFFLE:
        step = np.int32(WARP // 2)
        while step > 0:
            total += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, total, step, 0x1F)[0]
            step //= 2
        if lane == 0:
            red[warp] = total
        cuda.syncthreads()
        total = red[lane] if lane < NUM_WARPS else float32(0.0)
        step = np.int32(WARP // 2)
        while step > 0:
            total += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, total, step, 0x1F)[0]
            step //= 2
    else:
        red[tid] = total
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                red[tid] = red[tid] + red[tid + step]
            cuda.syncthreads()
            step //= 2
        total = red[0]
    cuda.syncthreads()  # every thread holds the logits' exps, the max and the sum

    # 4. weighted sum of the values: thread (group g, dim d) over tokens g, g + groups, ...
    inv = float32(1.0) / total
    if head_dim <= THREADS:
        groups = THREADS // head_dim
        g = tid // head_dim
        d = tid - g * head_dim
        acc = float32(0.0)
        if g < groups:
            for i in range(g, n, groups):
                tok = start + i
                blk = block_tables[s, tok // block_size]
                acc += logits[i] * value_cache[blk, kvh, tok - (tok // block_size) * block_size, d]
        red[tid] = acc  # groups * head_dim <= THREADS
        cuda.syncthreads()
        if tid < head_dim:
            acc = float32(0.0)
            for k in range(groups):
                acc += red[k * head_dim + tid]
            part_out[s, h, p, tid] = acc * inv
    else:
        for d in range(tid, head_dim, THREADS):
            acc = float32(0.0)
            for i in range(n):
                tok = start + i
                blk = block_tables[s, tok // block_size]
                acc += logits[i] * value_cache[blk, kvh, tok - (tok // block_size) * block_size, d]
            part_out[s, h, p, d] = acc * inv
    if tid == 0:
        part_max[s, h, p] = m
        part_sum[s, h, p] = total


# grid: (num_tokens, num_heads, num_partitions); block: (THREADS,)
@cuda.jit(fastmath=False)
def prefill_kernel(part_out, part_max, part_sum, row_lens, query, key_cache, value_cache,
                   block_tables, query_start_loc, context_lens, scale, partition_size):
    # part_out: [num_tokens, num_heads, num_partitions, head_dim] float32 (as in decode_kernel)
    # part_max, part_sum: [num_tokens, num_heads, num_partitions] float32
    # row_lens: [num_tokens] int32, written here: positions each query row attends to
    # query: [num_tokens, num_heads, head_dim] float32
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] float32
    # block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
    # context_lens: [num_seqs] int32; scale: float32; partition_size: int32 <= MAX_PARTITION
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    p = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid - warp * WARP
    num_heads = query.shape[1]
    head_dim = query.shape[2]
    num_kv_heads = key_cache.shape[1]
    block_size = key_cache.shape[2]
    kvh = h // (num_heads // num_kv_heads)
    # the sequence of row r: the last s with query_start_loc[s] <= r (binary search)
    lo = 0
    hi = context_lens.shape[0] - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if query_start_loc[mid] <= r:
            lo = mid
        else:
            hi = mid - 1
    s = lo
    q_len = query_start_loc[s + 1] - query_start_loc[s]
    length = context_lens[s] - q_len + (r - query_start_loc[s]) + 1  # causal: [0, position]
    if h == 0 and p == 0 and tid == 0:
        row_lens[r] = length
    start = p * partition_size
    if start >= length:
        return
    end = start + partition_size
    if end > length:
        end = length
    n = end - start

    q_sh = cuda.shared.array(MAX_HEAD_DIM, float32)
    logits = cuda.shared.array(MAX_PARTITION, float32)
    red = cuda.shared.array(THREADS, float32)
    partials = cuda.shared.array(PARTIALS, float32)
    for d in range(tid, head_dim, THREADS):
        q_sh[d] = query[r, h, d]
    cuda.syncthreads()

    # 1. logits (as in decode_kernel)
    if USE_SHUFFLE:
        for tok in range(start + warp, end, NUM_WARPS):
            blk = block_tables[s, tok // block_size]
            off = tok - (tok // block_size) * block_size
            acc = float32(0.0)
            for d in range(lane, head_dim, WARP):
                acc += q_sh[d] * key_cache[blk, kvh, off, d]
            step = np.int32(WARP // 2)
            while step > 0:
                acc += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, acc, step, 0x1F)[0]
                step //= 2
            if lane == 0:
                logits[tok - start] = acc * scale
    else:
        for base in range(start, end, THREADS):
            for j in range(warp, THREADS, NUM_WARPS):
                tok = base + j
                acc = float32(0.0)
                if tok < end:
                    blk = block_tables[s, tok // block_size]
                    off = tok - (tok // block_size) * block_size
                    for d in range(lane, head_dim, WARP):
                        acc += q_sh[d] * key_cache[blk, kvh, off, d]
                partials[j * WARP + lane] = acc
            cuda.syncthreads()
            tok = base + tid
            if tok < end:
                acc = float32(0.0)
                for k in range(WARP):
                    acc += partials[tid * WARP + k]
                logits[tok - start] = acc * scale
            cuda.syncthreads()
    cuda.syncthreads()

    # 2. block-wide max
    m = NEG_INF
    for i in range(tid, n, THREADS):
        if logits[i] > m:
            m = logits[i]
    if USE_SHUFFLE:
        step = np.int32(WARP // 2)
        while step > 0:
            other = cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, m, step, 0x1F)[0]
            if other > m:
                m = other
            step //= 2
        if lane == 0:
            red[warp] = m
        cuda.syncthreads()
        m = red[lane] if lane < NUM_WARPS else NEG_INF
        step = np.int32(WARP // 2)
        while step > 0:
            other = cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, m, step, 0x1F)[0]
            if other > m:
                m = other
            step //= 2
    else:
        red[tid] = m
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                if red[tid + step] > red[tid]:
                    red[tid] = red[tid + step]
            cuda.syncthreads()
            step //= 2
        m = red[0]
    cuda.syncthreads()

    # 3. exponentials and their block-wide sum
    total = float32(0.0)
    for i in range(tid, n, THREADS):
        e = math.exp(logits[i] - m)
        logits[i] = e
        total += e
    if USE_SHUFFLE:
        step = np.int32(WARP // 2)
        while step > 0:
            total += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, total, step, 0x1F)[0]
            step //= 2
        if lane == 0:
            red[warp] = total
        cuda.syncthreads()
        total = red[lane] if lane < NUM_WARPS else float32(0.0)
        step = np.int32(WARP // 2)
        while step > 0:
            total += cuda.shfl_sync_intrinsic(FULL_MASK, SHFL_XOR, total, step, 0x1F)[0]
            step //= 2
    else:
        red[tid] = total
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                red[tid] = red[tid] + red[tid + step]
            cuda.syncthreads()
            step //= 2
        total = red[0]
    cuda.syncthreads()

    # 4. weighted sum of the values
    inv = float32(1.0) / total
    if head_dim <= THREADS:
        groups = THREADS // head_dim
        g = tid // head_dim
        d = tid - g * head_dim
        acc = float32(0.0)
        if g < groups:
            for i in range(g, n, groups):
                tok = start + i
                blk = block_tables[s, tok // block_size]
                acc += logits[i] * value_cache[blk, kvh, tok - (tok // block_size) * block_size, d]
        red[tid] = acc
        cuda.syncthreads()
        if tid < head_dim:
            acc = float32(0.0)
            for k in range(groups):
                acc += red[k * head_dim + tid]
            part_out[r, h, p, tid] = acc * inv
    else:
        for d in range(tid, head_dim, THREADS):
            acc = float32(0.0)
            for i in range(n):
                tok = start + i
                blk = block_tables[s, tok // block_size]
                acc += logits[i] * value_cache[blk, kvh, tok - (tok // block_size) * block_size, d]
            part_out[r, h, p, d] = acc * inv
    if tid == 0:
        part_max[r, h, p] = m
        part_sum[r, h, p] = total


# grid: (num_rows, num_heads); block: (THREADS,)
@cuda.jit(fastmath=False)
def merge_kernel(out, part_out, part_max, part_sum, row_lens, partition_size):
    # out: [num_rows, num_heads, head_dim] float32
    # part_out: [num_rows, num_heads, num_partitions, head_dim] float32, normalized per partition
    # part_max, part_sum: [num_rows, num_heads, num_partitions] float32
    # row_lens: [num_rows] int32 (positions of each row: decode context_lens, prefill row_lens)
    # out = sum_p w_p part_out_p / sum_p w_p, w_p = part_sum_p * exp(part_max_p - max_p part_max_p)
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    head_dim = out.shape[2]
    used = (row_lens[r] + partition_size - 1) // partition_size
    gmax = NEG_INF
    for p in range(used):
        if part_max[r, h, p] > gmax:
            gmax = part_max[r, h, p]
    for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
        acc = float32(0.0)
        wsum = float32(0.0)
        for p in range(used):
            w = part_sum[r, h, p] * math.exp(part_max[r, h, p] - gmax)
            wsum += w
            acc += w * part_out[r, h, p, d]
        out[r, h, d] = acc / wsum


# grid: (num_pairs,); block: (THREADS,)
@cuda.jit
def copy_blocks_kernel(dst, src, block_mapping):
    # dst: [num_dst_blocks, block_elems], src: [num_src_blocks, block_elems] (same dtype; the same
    # array for copy-on-write inside one pool); block_mapping: [num_pairs, 2] int64 (src, dst)
    i = cuda.blockIdx.x
    a = block_mapping[i, 0]
    b = block_mapping[i, 1]
    for e in range(cuda.threadIdx.x, dst.shape[1], cuda.blockDim.x):
        dst[b, e] = src[a, e]


# --------------------------------------------------------------------------------------------------
# signatures for ahead-of-time PTX compilation (tests/test_kernels_ptx.py); C-contiguous arrays


def ptx_signatures():
    """``{name: (python function, signature)}`` for ``cuda.compile_ptx``."""
    from numba import int32, int64

    f4 = float32[:, :, :, ::1]
    f3 = float32[:, :, ::1]
    i32_2 = int32[:, ::1]
    i32_1 = int32[::1]
    return {
        "write_kv_kernel": (write_kv_kernel, (f4, f4, f3, f3, int64[::1])),
        "decode_kernel": (decode_kernel, (f4, f3, f3, f3, f4, f4, i32_2, i32_1, float32, int32)),
        "prefill_kernel": (prefill_kernel, (f4, f3, f3, i32_1, f3, f4, f4, i32_2, i32_1, i32_1,
                                            float32, int32)),
        "merge_kernel": (merge_kernel, (f3, f4, f3, f3, i32_1, int32)),
        "copy_blocks_kernel": (copy_blocks_kernel, (float32[:, ::1], float32[:, ::1], int64[:, ::1])),
    }


# --------------------------------------------------------------------------------------------------
# launchers: arguments are device arrays (anything ``cuda.as_cuda_array`` made, ``cuda.to_device``
# or, under the simulator, numpy arrays), in the reference's order


def _device_empty(shape, dtype):
    return cuda.device_array(shape, dtype=dtype)


def _launch(kernel, grid, stream):
    return kernel[grid, THREADS, stream] if stream is not None else kernel[grid, THREADS]


def write_kv_cache(key_cache, value_cache, key, value, slot_mapping, stream=None) -> None:
    if key.shape[0] == 0:
        return
    _launch(write_kv_kernel, (key.shape[0],), stream)(key_cache, value_cache, key, value, slot_mapping)


def choose_partition_size(rows: int, num_heads: int, max_len: int) -> int:
    """``MAX_PARTITION``, or half of it when the grid would otherwise be small (< 512 blocks)."""
    if max_len > MAX_PARTITION // 2 and rows * num_heads * -(-max_len // MAX_PARTITION) < 512:
        return MAX_PARTITION // 2
    return MAX_PARTITION


def _attention(kind, out, query, key_cache, value_cache, block_tables, query_start_loc,
               context_lens, max_len, scale, partition_size, empty, stream):
    rows, num_heads, head_dim = query.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM}")
    if partition_size is None:
        partition_size = choose_partition_size(rows, num_heads, max_len)
    if not 0 < partition_size <= MAX_PARTITION:
        raise ValueError(f"partition_size must be in 1..{MAX_PARTITION}, got {partition_size}")
    num_parts = max(1, -(-max_len // partition_size))
    if num_parts == 1:
        part_out = out.reshape(rows, num_heads, 1, head_dim)  # writes go straight to out
    else:
        part_out = empty((rows, num_heads, num_parts, head_dim), np.float32)
    part_max = empty((rows, num_heads, num_parts), np.float32)
    part_sum = empty((rows, num_heads, num_parts), np.float32)
    grid = (rows, num_heads, num_parts)  # rows on x: up to 2**31 - 1 blocks
    if kind == "decode":
        row_lens = context_lens
        _launch(decode_kernel, grid, stream)(
            part_out, part_max, part_sum, query, key_cache, value_cache, block_tables,
            context_lens, np.float32(scale), np.int32(partition_size))
    else:
        row_lens = empty((rows,), np.int32)
        _launch(prefill_kernel, grid, stream)(
            part_out, part_max, part_sum, row_lens, query, key_cache, value_cache, block_tables,
            query_start_loc, context_lens, np.float32(scale), np.int32(partition_size))
    if num_parts > 1:
        _launch(merge_kernel, (rows, num_heads), stream)(
            out, part_out, part_max, part_sum, row_lens, np.int32(partition_size))


def paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                           partition_size: int | None = None, max_len: int | None = None,
                           empty=_device_empty, stream=None) -> None:
    """One query per sequence over its whole context; writes ``out`` (C-contiguous) in place.

    ``partition_size``: ``None`` chooses (``choose_partition_size``); a number up to
    ``MAX_PARTITION`` forces it. ``max_len`` (the longest context) is read back from the device
    when not given. ``empty(shape, dtype)`` allocates the partition workspace.
    """
    if query.shape[0] == 0:
        return
    if max_len is None:
        max_len = int(np.asarray(_host(context_lens)).max())
    _attention("decode", out, query, key_cache, value_cache, block_tables, None, context_lens,
               max_len, scale, partition_size, empty, stream)


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, partition_size: int | None = None,
                            max_len: int | None = None, empty=_device_empty, stream=None) -> None:
    """New tokens attend causally to themselves and their cached prefix; writes ``out`` in place."""
    if query.shape[0] == 0:
        return
    if max_len is None:
        max_len = int(np.asarray(_host(context_lens)).max())
    _attention("prefill", out, query, key_cache, value_cache, block_tables, query_start_loc,
               context_lens, max_len, scale, partition_size, empty, stream)


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a


def _rows(cache):
    return cache.reshape(cache.shape[0], int(np.prod(cache.shape[1:])))


def copy_blocks(key_caches, value_caches, block_mapping, stream=None) -> None:
    """Copy whole blocks inside each device pool, every layer; ``block_mapping`` [P, 2] int64 on
    the device. A block must not be both a source and a destination (the blocks of one launch run
    in any order)."""
    if block_mapping.shape[0] == 0:
        return
    for cache in (*key_caches, *value_caches):
        rows = _rows(cache)
        # a host (numpy) pool goes over once: passed twice, its two copies would come back twice
        dev = cuda.to_device(rows) if isinstance(rows, np.ndarray) else rows
        _launch(copy_blocks_kernel, (block_mapping.shape[0],), stream)(dev, dev, block_mapping)
        if dev is not rows:
            dev.copy_to_host(rows)


def swap_blocks(dst, src, block_mapping, stream=None) -> None:
    """Copy whole blocks from ``src`` to ``dst``. Two device pools: one kernel (``block_mapping``
    on the device); a host (numpy) pool on either side: one copy per block (``block_mapping``
    a numpy array)."""
    if block_mapping.shape[0] == 0:
        return
    dst_host, src_host = isinstance(dst, np.ndarray), isinstance(src, np.ndarray)
    if SIMULATOR or not (dst_host or src_host):
        _launch(copy_blocks_kernel, (block_mapping.shape[0],), stream)(
            _rows(dst), _rows(src), block_mapping)
        return
    mapping = np.asarray(block_mapping)
    for a, b in mapping.tolist():
        if dst_host and src_host:
            dst[b] = src[a]
        elif dst_host:  # device -> host
            src[a].copy_to_host(dst[b], stream=stream or 0)
        else:  # host -> device
            dst[b].copy_to_device(src[a], stream=stream or 0)


# --------------------------------------------------------------------------------------------------
# the backend of services/executor/attention.py


class NumbaCUDABackend:
    """Numba CUDA kernels behind the dispatch's backend interface (torch CUDA tensors, in place).

    Launches go on torch's current stream, workspaces come from torch's caching allocator; float32
    caches only (other dtypes fall back to the PyTorch reference).
    """

    name = "cuda"

    def __init__(self) -> None:
        if SIMULATOR or not cuda.is_available():
            raise ImportError("Numba CUDA backend: no CUDA device available to numba"
                              + (" (the CUDA simulator is enabled)" if SIMULATOR else ""))
        import torch

        self._torch = torch

    def _fast(self, *tensors) -> bool:
        return all(t.is_cuda and t.dtype == self._torch.float32 for t in tensors)

    @staticmethod
    def _dev(t):
        return cuda.as_cuda_array(t.detach(), sync=False)  # ordering: same stream as torch

    def _stream(self, t):
        handle = self._torch.cuda.current_stream(t.device).cuda_stream
        # torch's default stream is the legacy default stream (handle 0)
        return cuda.default_stream() if handle == 0 else cuda.external_stream(handle)

    def _empty(self, device):
        torch = self._torch
        dtypes = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}
        keep = self._keep = []  # workspaces live until the next call (stream-ordered reuse)

        def empty(shape, dtype):
            t = torch.empty(shape, dtype=dtypes[np.dtype(dtype)], device=device)
            keep.append(t)
            return cuda.as_cuda_array(t, sync=False)

        return empty

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        from kernels import reference

        if not (self._fast(key_cache, value_cache, key, value)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        with cuda.gpus[key_cache.device.index or 0]:
            write_kv_cache(self._dev(key_cache), self._dev(value_cache),
                           self._dev(key.contiguous()), self._dev(value.contiguous()),
                           self._dev(slot_mapping.to(self._torch.int64).contiguous()),
                           stream=self._stream(key_cache))

    def _attention(self, kind, out, query, key_cache, value_cache, block_tables, query_start_loc,
                   context_lens, scale):
        torch = self._torch
        target = out if out.is_contiguous() else torch.empty_like(out)
        device = query.device
        args = [self._dev(query.contiguous()), self._dev(key_cache), self._dev(value_cache),
                self._dev(block_tables.to(torch.int32).contiguous())]
        if kind == "prefill":
            args.append(self._dev(query_start_loc.to(torch.int32).contiguous()))
        lens = context_lens.to(torch.int32).contiguous()
        if lens.is_cuda:  # no device-to-host sync: the block table's width bounds every context
            max_len = block_tables.shape[1] * key_cache.shape[2]
        else:
            max_len = int(lens.max())
            lens = lens.to(device)
        with cuda.gpus[device.index or 0]:
            fn = paged_decode_attention if kind == "decode" else paged_prefill_attention
            fn(self._dev(target), *args, self._dev(lens), scale, max_len=max_len,
               empty=self._empty(device), stream=self._stream(query))
        if target is not out:
            out.copy_(target)

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale) -> None:
        from kernels import reference

        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_decode_attention(
                out, query, key_cache, value_cache, block_tables, context_lens, scale)
        if query.shape[0]:
            self._attention("decode", out, query, key_cache, value_cache, block_tables, None,
                            context_lens, scale)

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                context_lens, scale) -> None:
        from kernels import reference

        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_prefill_attention(
                out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale)
        if query.shape[0]:
            self._attention("prefill", out, query, key_cache, value_cache, block_tables,
                            query_start_loc, context_lens, scale)
