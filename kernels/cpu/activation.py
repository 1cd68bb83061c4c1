"""Numba CPU SiLU-gated product of a fused gate/up projection: the MLP's elementwise step, fused.

``silu_mul(out, gate_up)``: ``gate_up`` ``[T, 2 I]`` (the ``gate_up_proj`` output: the gate's
``I`` columns, then the up projection's), ``out`` ``[T, I]`` = ``silu(gate) * up``, in one pass
over the rows, where torch runs two ops (``silu``, then ``mul``) and allocates twice.

Rounding, as torch's CPU ops round it: the gate widened to float32, ``silu`` computed in float32
and rounded to the dtype, then its product with ``up`` computed in float32 and rounded to the
dtype (torch's ``silu`` and ``mul`` do the same for bfloat16 and float16). The exponential is
``exp_nonpositive`` (within 3 ulp of libm's; ``kernels/cpu/common.py``) where torch's is SLEEF's
(vector lanes) or libm's (the scalar tail). Measured against torch on 983,040 random elements
(gate and up ~ N(0, 16)): bfloat16 all equal; float16 147 products differ, by at most 2 ulp (an
ulp of ``silu`` where the float32 value lies next to a float16 rounding boundary, then scaled by
``up``); float32 about half differ, by at most 4 ulp. So the model keeps torch's two ops in its
float32 exactness mode (``services/executor/layers.py``) and uses this kernel elsewhere. One range
differs on purpose: gates below -87.3 (``exp_nonpositive``'s floor, where torch's ``silu`` is
already smaller than 1e-36 in magnitude) give -0.

Arrays: float32, bfloat16 bits (``uint16``) or float16 bits (``int16``), both of one format,
C-contiguous. Rows run serially below ``PARALLEL_FROM_ROWS`` (a parallel region costs more than
the work at decode batches) and in parallel from there. Measured on a 2-core AMD EPYC (Zen 5) at
SmolLM2's I = 1536, loaded machine, median of 100: 64 rows float32 27 us serial, 55 us parallel,
113 us torch; bfloat16 44, 64, 106 us; 544 rows bfloat16 332 us serial, 214 us parallel, 288 us
torch.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from kernels.cpu.common import _FASTMATH, by_rows, exp_nonpositive, kernel_array, narrow_like, tanh_f32, widen

PARALLEL_FROM_ROWS = 256

# error_model="numpy": a float division raises no ZeroDivisionError check, which kept the row loop
# from vectorizing (measured 12x slower)


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", inline="always")
def _silu_mul_row(dst, row, inter):
    for j in range(inter):
        g = widen(row[j])
        e = exp_nonpositive(-abs(g))  # exp(-|g|) in (0, 1]: no overflow on either side
        sigmoid = np.float32(1.0) / (np.float32(1.0) + e)
        sigmoid = sigmoid if g >= 0 else e * sigmoid  # 1 / (1 + exp(-g)) for negative g
        silu = narrow_like(dst, g * sigmoid)  # rounded to the dtype, as torch's silu returns it
        dst[j] = narrow_like(dst, widen(silu) * widen(row[inter + j]))


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy")
def _silu_mul_serial(out, gate_up):
    for i in range(out.shape[0]):
        _silu_mul_row(out[i], gate_up[i], out.shape[1])


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", parallel=True)
def _silu_mul_parallel(out, gate_up):
    for i in prange(out.shape[0]):
        _silu_mul_row(out[i], gate_up[i], out.shape[1])


_GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", inline="always")
def _gelu_tanh_mul_row(dst, row, inter):
    for j in range(inter):
        g = widen(row[j])
        inner = _GELU_C * (g + np.float32(0.044715) * g * g * g)
        gelu = narrow_like(dst, np.float32(0.5) * g * (np.float32(1.0) + tanh_f32(inner)))
        dst[j] = narrow_like(dst, widen(gelu) * widen(row[inter + j]))


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy")
def _gelu_tanh_mul_serial(out, gate_up):
    for i in range(out.shape[0]):
        _gelu_tanh_mul_row(out[i], gate_up[i], out.shape[1])


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", parallel=True)
def _gelu_tanh_mul_parallel(out, gate_up):
    for i in prange(out.shape[0]):
        _gelu_tanh_mul_row(out[i], gate_up[i], out.shape[1])


def gelu_tanh_mul_(gate_up, parallel_from_rows: int = PARALLEL_FROM_ROWS):
    """Gemma's MLP step, as ``silu_mul_`` with the tanh-approximated GELU (torch's
    ``gelu(approximate="tanh")``, computed in float32 and rounded to the dtype, then the product):
    a new ``[T, I]`` tensor from ``gate_up`` ``[T, 2 I]``."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    by_rows(out.shape[0], parallel_from_rows, _gelu_tanh_mul_serial, _gelu_tanh_mul_parallel,
            kernel_array(out), kernel_array(gate_up))
    return out


def silu_mul(out, gate_up, parallel_from_rows: int = PARALLEL_FROM_ROWS) -> None:
    """``out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]`` (numpy arrays, one format)."""
    if out.shape[0] != gate_up.shape[0] or gate_up.shape[1] != 2 * out.shape[1]:
        raise ValueError(f"silu_mul: out {out.shape} needs gate_up of [{out.shape[0]}, {2 * out.shape[1]}], "
                         f"got {gate_up.shape}")
    by_rows(out.shape[0], parallel_from_rows, _silu_mul_serial, _silu_mul_parallel, out, gate_up)


def silu_mul_(gate_up, parallel_from_rows: int = PARALLEL_FROM_ROWS):
    """The torch form: a new ``[T, I]`` tensor ``silu(gate) * up`` from ``gate_up`` ``[T, 2 I]``
    (CPU, C-contiguous, float32, bfloat16 or float16)."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    silu_mul(kernel_array(out), kernel_array(gate_up), parallel_from_rows)
    return out


@njit(fastmath=_FASTMATH, cache=True, nogil=True, error_model="numpy", parallel=True)
def _softcap_rows(x, cap, inv_cap):
    for i in prange(x.shape[0]):
        row = x[i]
        for j in range(row.shape[0]):
            row[j] = narrow_like(row, tanh_f32(widen(row[j]) * inv_cap) * cap)


def softcap_(x, cap: float):
    """``x = cap * tanh(x / cap)`` in place, in one pass (Gemma 2's final logit soft-capping; torch's
    three ops took 3.3 ms at 64 rows of a 49,152-token vocabulary in bfloat16 on a 2-core AMD EPYC
    Zen 4). ``x``: a CPU tensor ``[N, V]``, C-contiguous, float32, bfloat16 or float16; computed in
    float32 and rounded once (torch rounds after each op: an ulp of the dtype apart)."""
    _softcap_rows(kernel_array(x), np.float32(cap), np.float32(1.0) / np.float32(cap))
    return x
