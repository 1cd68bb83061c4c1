"""Numba CPU decode attention straight from a fused q/k/v projection's output: the rotary
embedding, the write of the new key and value into their cache slots and the paged attention of a
decode batch in one kernel call.

``decode_qkv(out, qkv, cos, sin, slot_mapping, key_cache, value_cache, plan, scale)``: ``qkv``
``[T, (H + 2 Hkv) * D]`` (the ``qkv_proj`` output), ``cos``/``sin`` ``[T, D]``, one decode row per
sequence (``plan``: ``rows_plan.plan_rows`` of the step's block tables and context lengths, which
count the new token). Each (row, KV head) task rotates its group's queries into ``out``'s rows
(``rotary.rotate_head``, rounded as the torch form rounds them), rotates the new key into its slot
and copies the new value into its slot, then attends over the whole context with the queries read
back from ``out`` (``decode._row_task``), which it then overwrites with the result. The bits are
those of ``rotary.rope_split``, ``cache_ops.write_kv_cache`` and ``decode.run_plan`` one after the
other: the same rounding and the same sums, with ``qkv``, ``out`` and the caches in one format.

What it saves, per layer of a decode step: two kernel calls, three fresh tensors (q, k, v) and
their views, and the Python between the calls. A task owns its (sequence, KV head) slot: the
scheduler gives a decoding sequence a block of its own before a token is written into it
(copy-on-write), and no other task reads that slot before the step ends.

Partitioned plans (long contexts at a small batch, ``rows_plan.auto_partitions``) are not taken: the
partitions of one row run as separate tasks, which would read the slot before its write.

Arrays: float32, or bfloat16 as raw bits (``uint16``), all of one format, C-contiguous.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu.decode import _row_task
from kernels.cpu.rows_plan import RowsPlan
from kernels.cpu.rotary import rotate_head
from kernels.cpu.vectors import GroupShape


@njit(cache=True, nogil=True)
def _rope_write(out, qkv, cos, sin, slots, key_cache, value_cache, r, kvh, group):
    """Row ``r``, KV head ``kvh``: its group's rotated queries into ``out``, its rotated key and its
    value into their slot. Without fastmath, as ``rotary.py``'s kernels, and so are the task and the
    kernels around it (``decode._row_task`` keeps its own fastmath): compiled into a fastmath
    function, a product and a sum were contracted into one FMA, and float32 keys came out an ulp
    off the torch form's."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    row, c, s = qkv[r], cos[r], sin[r]
    for h in range(kvh * group, (kvh + 1) * group):
        rotate_head(out[r, h], row[h * head_dim:(h + 1) * head_dim], c, s)
    slot = slots[r]
    if slot < 0:
        return
    blk = slot // block_size
    off = slot - blk * block_size
    k = (num_heads + kvh) * head_dim
    rotate_head(key_cache[blk, kvh, off], row[k:k + head_dim], c, s)
    v = (num_heads + num_kv_heads + kvh) * head_dim
    dst = value_cache[blk, kvh, off]
    for d in range(head_dim):
        dst[d] = row[v + d]


@njit(cache=True, nogil=True)
def _qkv_task(out, qkv, cos, sin, slots, key_cache, value_cache, block_tables, rows, seqs, lens,
              scale, shape, task, window, softcap):
    """Task ``task``: row ``task // num_kv_heads`` of the task order, KV head ``task % num_kv_heads``."""
    num_kv_heads = key_cache.shape[1]
    i = task // num_kv_heads
    kvh = task - i * num_kv_heads
    _rope_write(out, qkv, cos, sin, slots, key_cache, value_cache, rows[i], kvh, shape.rows)
    _row_task(out, out, key_cache, value_cache, block_tables, rows, seqs, lens, scale, shape, task,
              window, softcap)


@njit(parallel=True, cache=True, nogil=True)
def _qkv_kernel(out, qkv, cos, sin, slots, key_cache, value_cache, block_tables, rows, seqs, lens,
                scale, shape, window, softcap):
    sc = np.float32(scale)
    cap = np.float32(softcap)
    for task in prange(rows.shape[0] * key_cache.shape[1]):
        _qkv_task(out, qkv, cos, sin, slots, key_cache, value_cache, block_tables, rows, seqs,
                  lens, sc, shape, task, window, cap)


@njit(cache=True, nogil=True)
def _qkv_serial_kernel(out, qkv, cos, sin, slots, key_cache, value_cache, block_tables, rows, seqs,
                       lens, scale, shape, window, softcap):
    # as _qkv_kernel, on the calling thread: for work too small to pay for waking the others
    sc = np.float32(scale)
    cap = np.float32(softcap)
    for task in range(rows.shape[0] * key_cache.shape[1]):
        _qkv_task(out, qkv, cos, sin, slots, key_cache, value_cache, block_tables, rows, seqs,
                  lens, sc, shape, task, window, cap)


def plan_ok(plan: RowsPlan | None) -> bool:
    """Whether ``decode_qkv`` runs this plan (one made for all the rows, unpartitioned)."""
    return plan is not None and plan.partition_size == 0 and plan.row_ids is None


def kernel_for(plan: RowsPlan):
    """The kernel that runs ``plan`` (one ``plan_ok`` accepts): on the calling thread or in parallel."""
    return _qkv_serial_kernel if plan.serial else _qkv_kernel


def decode_qkv(out, qkv, cos, sin, slot_mapping, key_cache, value_cache, plan: RowsPlan,
               scale, window: int = 0, softcap: float = 0.0) -> None:
    """Writes the new keys and values into the caches and the attention into ``out`` ``[T, H, D]``
    (see the module's docstring); ``plan`` must be one ``plan_ok`` accepts. ``window`` > 0: a
    sliding window, ``softcap`` > 0: soft-capped scores (``decode.attend_rows``)."""
    if not plan_ok(plan):
        raise ValueError("decode_qkv runs unpartitioned plans of all the rows (rows_plan.plan_rows)")
    num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
    if not (out.dtype == qkv.dtype == key_cache.dtype == value_cache.dtype
            and qkv.shape[1] == (out.shape[1] + 2 * num_kv_heads) * head_dim):
        raise ValueError(f"decode_qkv: out {out.shape} {out.dtype}, qkv {qkv.shape} {qkv.dtype}, "
                         f"caches {key_cache.shape} {key_cache.dtype}")
    shape = GroupShape.of(out.shape[1] // num_kv_heads, head_dim)
    kernel_for(plan)(out, qkv, cos, sin, slot_mapping, key_cache, value_cache, plan.block_tables,
                     plan.rows, plan.seqs, plan.lens, float(scale), shape, int(window), float(softcap))
