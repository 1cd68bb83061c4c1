"""Numba CPU kernels that move K/V without attending: the write of new tokens into their slots,
and whole-block copies (copy-on-write inside a pool, swaps between pools).

Formats (``kernels/cpu/common.py``): a write stores float32 keys/values into a 16-bit cache
rounded to nearest even (as torch's ``.to``) and 16-bit ones of the cache's format bit for bit;
copies and swaps move raw bits, whatever the format.

The write is serial (a step's new tokens are too few for a parallel region to pay, see
``_write_kv_kernel``); the block copies run in parallel, one block per task.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.common import as_bits, as_input, narrow_like


@njit(cache=True, nogil=True)
def _write_kv_kernel(key_cache, value_cache, key, value, slot_mapping):
    # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] float32 / bf16 bits
    # (uint16) / fp16 bits (int16); key, value: [num_tokens, num_kv_heads, head_dim] float32 or the
    # cache's format; slot_mapping: [num_tokens] int64.
    # Serial: a parallel region costs more than the work. Measured with SmolLM2's shapes (bf16,
    # OMP_WAIT_POLICY=PASSIVE, after a torch matmul, as in a model step): 64 tokens 3 us serial
    # against 52 us in parallel (waking the sleeping threads), 512 tokens 20 us against 57 us.
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[2]
    for i in range(num_tokens):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                key_cache[blk, h, off, d] = narrow_like(key_cache, key[i, h, d])
                value_cache[blk, h, off, d] = narrow_like(value_cache, value[i, h, d])


def write_kv_cache(key_cache, value_cache, key, value, slot_mapping) -> None:
    """Scatter the new tokens' K/V into their slots; negative slots are padding and are skipped."""
    if key.shape[0] == 0:
        return
    key_cache, value_cache = as_bits(key_cache), as_bits(value_cache)
    _write_kv_kernel(key_cache, value_cache, as_input(key, key_cache), as_input(value, value_cache),
                     np.ascontiguousarray(slot_mapping, dtype=np.int64))


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
            rows = _as_rows(as_bits(cache))
            _copy_rows_kernel(rows, rows, mapping)


def swap_blocks(dst, src, block_mapping) -> None:
    """Copy whole blocks from one pool to another (device pool <-> CPU swap pool)."""
    mapping = np.ascontiguousarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if mapping.shape[0] == 0:
        return
    dst, src = as_bits(dst), as_bits(src)
    if dst.dtype != src.dtype:
        raise TypeError(f"swap_blocks: both pools must have one format, got {dst.dtype} and "
                        f"{src.dtype}")
    _copy_rows_kernel(_as_rows(dst), _as_rows(src), mapping)
