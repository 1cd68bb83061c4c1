"""Numba CPU rotary embedding fused with the split of a fused q/k/v projection's output.

``rope_split(q, k, v, qkv, cos, sin)``: ``qkv`` ``[T, (H + 2 Hkv) * D]`` (the ``qkv_proj``
output), ``cos``/``sin`` ``[T, D]``; writes the rotated queries ``q`` ``[T, H, D]``, the rotated
keys ``k`` ``[T, Hkv, D]`` and the values ``v`` ``[T, Hkv, D]``, all contiguous, in one pass. The
rotation is the non-interleaved (``rotate_half``) one, ``x * cos + rotate_half(x) * sin``, with
each product and the sum rounded to the dtype as torch's three elementwise ops round them: the
results are bit for bit those of ``services/executor/layers.py``'s torch form (no fastmath here,
so nothing is contracted into an FMA). At a decode batch it replaces eight torch calls per layer.

Tokens run serially below ``PARALLEL_FROM_ROWS`` (a decode batch: a parallel region costs more than
the work) and in parallel from there (a prefill chunk). Measured on the 2-core AMD EPYC (Zen 5),
bfloat16, SmolLM2's 9 + 3 + 3 heads, right after a torch matmul (``OMP_WAIT_POLICY=PASSIVE``, as
in a step), median of 41, quiet machine: 128 tokens 39 us serial, 71 parallel; 256 tokens 78 and
82; 512 tokens 154 and 109; 2,048 tokens 617 and 270.

Arrays: float32, or bfloat16 as raw bits (``uint16``), all of one format, C-contiguous.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from kernels.cpu.common import by_rows, kernel_array, narrow_like, widen
from kernels.cpu.live_arrays import live_array

PARALLEL_FROM_ROWS = 512  # tokens; below, a parallel region costs more than it saves (see the docstring)


@njit(cache=True, nogil=True, inline="always")
def _rounded(like, x):
    """``x`` rounded to the format of ``like``'s elements, as float32."""
    return widen(narrow_like(like, x))


@njit(cache=True, nogil=True, inline="always")
def rotate_head(dst, x, c, s):
    """``dst`` [D] = one head ``x`` [D] rotated by the token's ``c``/``s`` [D], rounded to the format
    of ``dst`` as the torch form rounds it (also the fused decode's, ``kernels/cpu/decode_qkv.py``)."""
    half = x.shape[0] // 2
    for d in range(half):  # both halves per iteration: no branch, so it vectorizes
        lo, hi = widen(x[d]), widen(x[d + half])
        dst[d] = narrow_like(dst, _rounded(dst, lo * widen(c[d])) + _rounded(dst, -hi * widen(s[d])))
        dst[d + half] = narrow_like(
            dst, _rounded(dst, hi * widen(c[d + half])) + _rounded(dst, lo * widen(s[d + half])))


@njit(cache=True, nogil=True, inline="always")
def _rope_split_row(q, k, v, qkv, cos, sin, i):
    """Token ``i``: its rotated queries and keys, and its values."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    row, c, s = qkv[i], cos[i], sin[i]
    for h in range(num_heads + num_kv_heads):
        dst = q[i, h] if h < num_heads else k[i, h - num_heads]
        rotate_head(dst, row[h * head_dim:(h + 1) * head_dim], c, s)
    base = (num_heads + num_kv_heads) * head_dim
    for h in range(num_kv_heads):
        for d in range(head_dim):
            v[i, h, d] = row[base + h * head_dim + d]


@njit(cache=True, nogil=True)
def _rope_split_serial(q, k, v, qkv, cos, sin):
    for i in range(q.shape[0]):
        _rope_split_row(q, k, v, qkv, cos, sin, i)


@njit(cache=True, nogil=True, parallel=True)
def _rope_split_parallel(q, k, v, qkv, cos, sin):
    for i in prange(q.shape[0]):
        _rope_split_row(q, k, v, qkv, cos, sin, i)


def rope_split(q, k, v, qkv, cos, sin, parallel_from_rows: int = PARALLEL_FROM_ROWS) -> None:
    """Serial below ``parallel_from_rows`` tokens (a decode batch), parallel from there."""
    by_rows(q.shape[0], parallel_from_rows, _rope_split_serial, _rope_split_parallel, q, k, v, qkv, cos, sin)


def rope_split_(qkv, cos, sin, num_heads: int, num_kv_heads: int,
                parallel_from_rows: int = PARALLEL_FROM_ROWS):
    """The torch form: (q, k, v) new contiguous tensors from ``qkv`` ``[T, (H + 2 Hkv) * D]`` and
    ``cos``/``sin`` ``[T, 1, D]`` (``RotaryEmbedding.at``); CPU, float32 or bfloat16, one dtype."""
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype)
    v = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype)
    if num_tokens:
        # cos and sin are the step's tables, the same tensors in every layer: viewed once
        rope_split(kernel_array(q), kernel_array(k), kernel_array(v), kernel_array(qkv),
                   live_array(cos).reshape(num_tokens, head_dim), live_array(sin).reshape(num_tokens, head_dim),
                   parallel_from_rows)
    return q, k, v
