"""Numba CUDA merge of partitioned attention: the log-sum-exp rule over the partitions of a row."""

from __future__ import annotations

import math

from numba import cuda, float32

from kernels.cuda.config import NEG_INF


# grid: (num_rows, num_heads); block: (THREADS,)
@cuda.jit(fastmath=False)
def merge_kernel(out, part_out, part_max, part_sum, row_lens, partition_size, window):
    # out: [num_rows, num_heads, head_dim] float32
    # part_out: [num_rows, num_heads, num_partitions, head_dim] float32, normalized per partition
    # part_max, part_sum: [num_rows, num_heads, num_partitions] float32
    # row_lens: [num_rows] int32 (positions of each row: decode context_lens, prefill row_lens)
    # window: int32, > 0 a sliding window: a row's partitions cover its last ``window`` positions
    # out = sum_p w_p part_out_p / sum_p w_p, w_p = part_sum_p * exp(part_max_p - max_p part_max_p)
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y
    head_dim = out.shape[2]
    span = row_lens[r]
    if window > 0 and span > window:
        span = window
    used = (span + partition_size - 1) // partition_size
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
