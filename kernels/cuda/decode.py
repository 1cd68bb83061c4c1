"""Numba CUDA paged decode kernel: one query per sequence over its whole context.

One thread block per (sequence, query head, partition). Grouped-query heads of one KV head read
the same K/V rows, from L1/L2, in their own blocks: simpler than one block per KV head, and the
grid is ``num_heads`` times larger, which fills the GPU at small batches. A partition is at most
``MAX_PARTITION`` tokens whose logits stay in shared memory: scores (one warp per token, lanes
split ``head_dim``), block-wide max, ``exp``, block-wide sum, then the weighted V sum (threads
split ``head_dim`` and the partition's tokens). With one partition the kernel writes the
normalized output; with several (long contexts, or a forced ``partition_size``) it writes each
partition's normalized output, max logit and exp-sum, and ``merge_kernel`` combines them.

Registers: token walks carry (table index, offset in block) forward instead of dividing each
position by the block size (a 64-bit division costs a dozen registers), and the kernel is held to
``ATTENTION_MAX_REGISTERS``, which keeps half the SM's warps resident (``kernels/cuda/resources.py``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from kernels.cuda.config import (
    ATTENTION_MAX_REGISTERS, FULL_MASK, MAX_HEAD_DIM, MAX_PARTITION, NEG_INF, NUM_WARPS, PARTIALS,
    THREADS, USE_SHUFFLE, WARP, jit_options, shfl_xor, widen,
)


# grid: (num_seqs, num_heads, num_partitions); block: (THREADS,)
@cuda.jit(fastmath=False, **jit_options(ATTENTION_MAX_REGISTERS))
def decode_kernel(part_out, part_max, part_sum, query, key_cache, value_cache, block_tables,
                  context_lens, scale, partition_size, window, softcap):
    # part_out: [num_seqs, num_heads, num_partitions, head_dim] float32 (normalized per partition;
    #   with one partition, a view of the output)
    # part_max, part_sum: [num_seqs, num_heads, num_partitions] float32
    # query: [num_seqs, num_heads, head_dim] in the cache's format
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] float32, float16
    #   or bfloat16 bits (int16), read through widen: float32 arithmetic throughout
    # block_tables: [num_seqs, max_blocks] int32; context_lens: [num_seqs] int32
    # scale: float32; partition_size: int32, <= MAX_PARTITION
    # window: int32, > 0 a sliding window: the last ``window`` positions only, partitions counted
    #   from its start (blocks before it are never read); softcap: float32, > 0 logits become
    #   softcap * tanh(logit / softcap) (Gemma 2)
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
    if window > 0 and length > window:
        start += length - window
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
        q_sh[d] = widen(query[s, h, d])
    cuda.syncthreads()

    # 1. logits[i] = scale * q . k[start + i]
    if USE_SHUFFLE:
        tok = start + warp  # one warp per token, lanes split head_dim
        bi = tok // block_size  # the token's block in the table, and its offset there
        off = tok - bi * block_size
        while tok < end:
            blk = block_tables[s, bi]
            acc = float32(0.0)
            d = lane
            while d < head_dim:
                acc += q_sh[d] * widen(key_cache[blk, kvh, off, d])
                d += WARP
            step = np.int32(WARP // 2)
            while step > 0:
                acc += shfl_xor(FULL_MASK, acc, step)
                step //= 2
            if lane == 0:
                x = acc * scale
                if softcap > 0:
                    x = softcap * math.tanh(x / softcap)
                logits[tok - start] = x
            tok += NUM_WARPS
            off += NUM_WARPS
            while off >= block_size:
                off -= block_size
                bi += 1
    else:
        for base in range(start, end, THREADS):  # rounds of THREADS tokens, block-uniform
            for j in range(warp, THREADS, NUM_WARPS):
                tok = base + j
                acc = float32(0.0)
                if tok < end:
                    blk = block_tables[s, tok // block_size]
                    off = tok - (tok // block_size) * block_size
                    d = lane
                    while d < head_dim:
                        acc += q_sh[d] * widen(key_cache[blk, kvh, off, d])
                        d += WARP
                partials[j * WARP + lane] = acc
            cuda.syncthreads()
            tok = base + tid
            if tok < end:
                acc = float32(0.0)
                for k in range(WARP):
                    acc += partials[tid * WARP + k]
                x = acc * scale
                if softcap > 0:
                    x = softcap * math.tanh(x / softcap)
                logits[tok - start] = x
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
            other = shfl_xor(FULL_MASK, m, step)
            if other > m:
                m = other
            step //= 2
        if lane == 0:
            red[warp] = m
        cuda.syncthreads()
        m = red[lane] if lane < NUM_WARPS else NEG_INF
        step = np.int32(WARP // 2)
        while step > 0:
            other = shfl_xor(FULL_MASK, m, step)
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
            total += shfl_xor(FULL_MASK, total, step)
            step //= 2
        if lane == 0:
            red[warp] = total
        cuda.syncthreads()
        total = red[lane] if lane < NUM_WARPS else float32(0.0)
        step = np.int32(WARP // 2)
        while step > 0:
            total += shfl_xor(FULL_MASK, total, step)
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
            i = g
            bi = (start + g) // block_size
            off = start + g - bi * block_size
            while i < n:
                acc += logits[i] * widen(value_cache[block_tables[s, bi], kvh, off, d])
                i += groups
                off += groups
                while off >= block_size:
                    off -= block_size
                    bi += 1
        red[tid] = acc  # groups * head_dim <= THREADS
        cuda.syncthreads()
        if tid < head_dim:
            acc = float32(0.0)
            for k in range(groups):
                acc += red[k * head_dim + tid]
            part_out[s, h, p, tid] = acc * inv
    else:
        d = tid
        while d < head_dim:
            acc = float32(0.0)
            bi = start // block_size
            off = start - bi * block_size
            for i in range(n):
                acc += logits[i] * widen(value_cache[block_tables[s, bi], kvh, off, d])
                off += 1
                if off == block_size:
                    off = 0
                    bi += 1
            part_out[s, h, p, d] = acc * inv
            d += THREADS
    if tid == 0:
        part_max[s, h, p] = m
        part_sum[s, h, p] = total
