"""Numba CUDA forms of the paged-attention kernels (layouts and semantics: ``kernels/reference.py``).

Importing this package needs no GPU (kernels compile lazily, on first launch);
``NumbaCUDABackend()`` raises ImportError where CUDA is unavailable, so the dispatch's ``auto``
falls back to torch.

Kernels (all module-level ``cuda.jit`` kernels): float32, float16 or bfloat16 caches and queries
(bfloat16 as an int16 view: torch exports bfloat16 as ``<V2``, which numba cannot read), every
element read through ``config.widen``, float32 accumulation and a float32 result. No device
functions, not even the library's: ``min``/``max`` and numba's own ``cuda.shfl_xor_sync`` are device
functions, which ``cuda.compile_ptx`` cannot compile without a current device. User-written ones
cannot either (checked for the score and block-wide max/sum code the decode and prefill kernels
repeat: a ``cuda.jit(device=True)`` or ``register_jitable`` function called from a kernel fails
``compile_ptx`` with "CUDA driver library cannot be found", numba 0.68.1's CUDA dispatcher reading
the current device's compute capability to compile it), so those stay written out in each
kernel, where the PTX tests check them on machines without a GPU. In place of the library's,
the kernels use ``if`` and ``config.shfl_xor``: numba-cuda's ``cuda.shfl_xor_sync`` (an intrinsic there; numba-cuda
is the CUDA target numba defers to when it is installed, as on GPU machines) or, on numba's own
target, an intrinsic over its ``shfl_sync_intrinsic``, which numba-cuda does not have. numba-cuda
0.30.4 cannot compile anything under numpy 2.5 (it registers the removed ``np.row_stack``):
``NumbaCUDABackend()`` refuses it with that advice (``numpy<2.5``) instead of failing at the first
launch.

- ``config``: threads per block, warp-shuffle or shared-memory reductions (the simulator's),
  shared-memory sizes.
- ``cache_ops``: ``write_kv_kernel`` (one thread block per token) and ``copy_blocks_kernel`` (one
  thread block per (src, dst) pair; serves ``copy_blocks`` and ``swap_blocks`` between two device
  pools; host <-> device swaps are plain copies).
- ``decode``: ``decode_kernel``, one thread block per (sequence, query head, partition).
- ``prefill``: ``prefill_kernel``, one thread block per (query token, query head, partition).
- ``merge``: ``merge_kernel``, the log-sum-exp combination of the partitions of decode and prefill.
- ``launch``: the host-side entry points (``paged_decode_attention``, ...), on device arrays.
- ``backend``: ``NumbaCUDABackend``, on torch CUDA tensors.
- ``ptx``: ``ptx_signatures`` for ahead-of-time compilation in the tests.
- ``resources``: registers, spills, shared memory and occupancy of each kernel, from ``ptxas``
  (``python -m loadtest.kernels.attention --ptxas``).
"""

from __future__ import annotations

from kernels.cuda.backend import NumbaCUDABackend
from kernels.cuda.cache_ops import copy_blocks_kernel, write_kv_kernel
from kernels.cuda.config import (
    ATTENTION_MAX_REGISTERS, FULL_MASK, MAX_HEAD_DIM, MAX_PARTITION, NEG_INF, NUM_WARPS, PARTIALS,
    SHFL_XOR, SIMULATOR, THREADS, USE_SHUFFLE, WARP,
)
from kernels.cuda.decode import decode_kernel
from kernels.cuda.launch import (
    choose_partition_size, copy_blocks, paged_decode_attention, paged_prefill_attention,
    swap_blocks, write_kv_cache,
)
from kernels.cuda.merge import merge_kernel
from kernels.cuda.prefill import prefill_kernel
from kernels.cuda.ptx import ptx_signatures

__all__ = [
    "ATTENTION_MAX_REGISTERS", "FULL_MASK", "MAX_HEAD_DIM", "MAX_PARTITION", "NEG_INF", "NUM_WARPS", "NumbaCUDABackend",
    "PARTIALS", "SHFL_XOR", "SIMULATOR", "THREADS", "USE_SHUFFLE", "WARP", "choose_partition_size",
    "copy_blocks", "copy_blocks_kernel", "decode_kernel", "merge_kernel", "paged_decode_attention",
    "paged_prefill_attention", "prefill_kernel", "ptx_signatures", "swap_blocks", "write_kv_cache",
    "write_kv_kernel",
]
