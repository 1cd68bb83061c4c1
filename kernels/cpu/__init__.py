"""Numba CPU forms of the paged-attention kernels (layouts and semantics: ``kernels/reference.py``).

The entry points take numpy arrays, in the reference's argument order, and write their output
argument in place. ``NumbaCPUBackend`` adapts them to the torch tensors of the attention dispatch
(``services/executor/attention.py``), zero-copy through ``Tensor.numpy()``.

- ``common``: the 16-bit storage formats (bfloat16 / float16 as raw bits, widened to float32 in
  registers), the prefetch intrinsic, the softmax's ``exp`` and the fastmath flags.
- ``vectors``, ``tiles``: LLVM IR for the attention kernels: a KV head's group of queries and
  accumulators held in registers (``Rows``, ``GroupShape``), keys' partial dot products
  (``vdpbf16ps`` on AVX-512 BF16), a tile's scores and online softmax step in vectors.
- ``decode``: ``attend_rows`` (query rows over a prefix of their sequence's cache, one task per
  row and KV head, partitioned for few long rows) and ``paged_decode_attention`` on it;
  ``run_plan`` runs a plan.
- ``rows_plan``: ``plan_rows``, the plan of such a call (task order, serial or parallel,
  partitions: ``auto_partitions``, ``MIN_PARTITION_SIZE``), which depends on the metadata only:
  the backend makes a decode step's once for all its layers.
- ``decode_qkv``: a decode-only step's rotary embedding, cache write and attention in one call,
  straight from the fused q/k/v projection (the backend's ``decode_qkv``).
- ``prefill``: ``paged_prefill_attention``, each new token a row of ``attend_rows``.
- ``cache_ops``: ``write_kv_cache``, ``copy_blocks``, ``swap_blocks``.
- ``norm``, ``rotary``, ``activation``: the model's elementwise chains fused (residual add + RMS
  norm; rotary + the q/k/v split; SiLU(gate) * up), which the backend offers as ``add_rms_norm``,
  ``rope_split`` and ``silu_mul``.
- ``matmul``: bfloat16 ``x @ W.T`` on weights packed in input pairs, multiplied with ``vdpbf16ps``
  (``--linear-kernel numba``, what ``auto`` runs on CPUs with AVX-512 BF16 and no AMX).
- ``argmax``: the first largest logit of each row (float32 or bfloat16), which greedy sampling
  calls directly (``services/executor/sampler.py``), ``torch.argmax`` for other tensors.
- ``pass_view``: ``ForwardPass``, the backend for one forward pass (``NumbaCPUBackend.for_pass``):
  what the layers' norm, activation and fused decode calls share, checked and made once.
- ``backend``: ``NumbaCPUBackend``. ``common`` has ``sync_threads`` (numba follows torch's thread
  count) and ``by_rows`` (the elementwise kernels' serial-or-parallel choice by rows).

Compilation: ``cache=True`` (the cache lives in ``kernels/cpu/__pycache__``, or
``NUMBA_CACHE_DIR``). The wrappers pass C-contiguous arrays (caches, queries and outputs in
float32 or 16-bit bits, indices int32 / int64) and a Python float, so each kernel has one
specialization per combination of formats: one for a float32 model, one for a bf16 model (and the
attention kernels one per ``GroupShape``, the model's heads per KV head and head dimension).
"""

from __future__ import annotations

from kernels.cpu.backend import NumbaCPUBackend
from kernels.cpu.cache_ops import copy_blocks, swap_blocks, write_kv_cache
from kernels.cpu.common import sync_threads
from kernels.cpu.decode import paged_decode_attention
from kernels.cpu.rows_plan import MIN_PARTITION_SIZE, auto_partitions
from kernels.cpu.prefill import paged_prefill_attention

__all__ = [
    "MIN_PARTITION_SIZE", "NumbaCPUBackend", "auto_partitions", "copy_blocks",
    "paged_decode_attention", "paged_prefill_attention", "swap_blocks", "sync_threads",
    "write_kv_cache",
]
