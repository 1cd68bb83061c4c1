"""Numba CPU forms of the paged-attention kernels (layouts and semantics: ``kernels/reference.py``).

The entry points take numpy arrays, in the reference's argument order, and write their output
argument in place. ``NumbaCPUBackend`` adapts them to the torch tensors of the attention dispatch
(``services/executor/attention.py``), zero-copy through ``Tensor.numpy()``.

- ``common``: the 16-bit storage formats (bfloat16 / float16 as raw bits, widened to float32 in
  registers), the prefetch intrinsic and the fastmath flags the kernels share.
- ``decode``: ``paged_decode_attention``, one task per (sequence, KV head), partitioned for small
  batches (``auto_partitions``, ``MIN_PARTITION_SIZE``).
- ``prefill``: ``paged_prefill_attention``, one task per (sequence, KV head, tile of query rows).
- ``cache_ops``: ``write_kv_cache``, ``copy_blocks``, ``swap_blocks``.
- ``norm``, ``rotary``, ``activation``: the model's elementwise chains fused (residual add + RMS
  norm; rotary + the q/k/v split; SiLU(gate) * up), which the backend offers as ``add_rms_norm``,
  ``rope_split`` and ``silu_mul``.
- ``argmax``: the first largest logit of each row (float32 or bfloat16), which greedy sampling
  calls directly (``services/executor/sampler.py``), ``torch.argmax`` for other tensors.
- ``backend``: ``NumbaCPUBackend`` and ``sync_threads`` (numba follows torch's thread count).

Compilation: ``cache=True`` (the cache lives in ``kernels/cpu/__pycache__``, or
``NUMBA_CACHE_DIR``). The wrappers pass C-contiguous arrays (caches, queries and outputs in
float32 or 16-bit bits, indices int32 / int64) and a Python float, so each kernel has one
specialization per combination of formats: one for a float32 model, one for a bf16 model.
"""

from __future__ import annotations

from kernels.cpu.backend import NumbaCPUBackend, sync_threads
from kernels.cpu.cache_ops import copy_blocks, swap_blocks, write_kv_cache
from kernels.cpu.decode import MIN_PARTITION_SIZE, auto_partitions, paged_decode_attention
from kernels.cpu.prefill import paged_prefill_attention

__all__ = [
    "MIN_PARTITION_SIZE", "NumbaCPUBackend", "auto_partitions", "copy_blocks",
    "paged_decode_attention", "paged_prefill_attention", "swap_blocks", "sync_threads",
    "write_kv_cache",
]
