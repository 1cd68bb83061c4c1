"""Host-side launchers of the Numba CUDA kernels, in the reference's argument order.

Arguments are device arrays (anything ``cuda.as_cuda_array`` made, ``cuda.to_device`` or, under
the simulator, numpy arrays). ``stream``: the CUDA stream to launch on (``None``: the default).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from kernels.cuda.cache_ops import copy_blocks_kernel, write_kv_kernel
from kernels.cuda.config import MAX_HEAD_DIM, MAX_PARTITION, SIMULATOR, THREADS
from kernels.cuda.decode import decode_kernel
from kernels.cuda.merge import merge_kernel
from kernels.cuda.prefill import prefill_kernel


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
               context_lens, max_len, scale, partition_size, empty, stream, window=0, softcap=0.0):
    rows, num_heads, head_dim = query.shape
    window = max(0, int(window))
    if window:  # a row's partitions cover its last ``window`` positions
        max_len = min(max_len, window)
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
            context_lens, np.float32(scale), np.int32(partition_size), np.int32(window),
            np.float32(softcap))
    else:
        row_lens = empty((rows,), np.int32)
        _launch(prefill_kernel, grid, stream)(
            part_out, part_max, part_sum, row_lens, query, key_cache, value_cache, block_tables,
            query_start_loc, context_lens, np.float32(scale), np.int32(partition_size),
            np.int32(window), np.float32(softcap))
    if num_parts > 1:
        _launch(merge_kernel, (rows, num_heads), stream)(
            out, part_out, part_max, part_sum, row_lens, np.int32(partition_size), np.int32(window))


def paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                           partition_size: int | None = None, max_len: int | None = None,
                           empty=_device_empty, stream=None, window: int = 0,
                           softcap: float = 0.0) -> None:
    """One query per sequence over its whole context; writes ``out`` (C-contiguous) in place.
    ``window`` > 0: its last ``window`` positions only (the blocks before them never read);
    ``softcap`` > 0: soft-capped logits (``kernels/reference.py``).

    ``partition_size``: ``None`` chooses (``choose_partition_size``); a number up to
    ``MAX_PARTITION`` forces it. ``max_len`` (the longest context) is read back from the device
    when not given. ``empty(shape, dtype)`` allocates the partition workspace.
    """
    if query.shape[0] == 0:
        return
    if max_len is None:
        max_len = int(np.asarray(_host(context_lens)).max())
    _attention("decode", out, query, key_cache, value_cache, block_tables, None, context_lens,
               max_len, scale, partition_size, empty, stream, window, softcap)


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, partition_size: int | None = None,
                            max_len: int | None = None, empty=_device_empty, stream=None,
                            window: int = 0, softcap: float = 0.0) -> None:
    """New tokens attend causally to themselves and their cached prefix; writes ``out`` in place.
    ``window``, ``softcap``: as in ``paged_decode_attention``."""
    if query.shape[0] == 0:
        return
    if max_len is None:
        max_len = int(np.asarray(_host(context_lens)).max())
    _attention("prefill", out, query, key_cache, value_cache, block_tables, query_start_loc,
               context_lens, max_len, scale, partition_size, empty, stream, window, softcap)


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
