"""Numba CUDA kernels that move K/V without attending: the write of new tokens into their slots,
and whole-block copies (``copy_blocks``, and ``swap_blocks`` between two device pools)."""

from __future__ import annotations

from numba import cuda


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
