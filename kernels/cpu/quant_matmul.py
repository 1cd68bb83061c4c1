"""Matmuls ``x @ W.T`` over GGUF-quantized weights kept quantized in memory (``--quantization gguf``
on a GGUF file; ``services/executor/quantized.py``), and the embedding rows of such a weight.

Layout (``QuantPack``, made once at load from the file's blocks by ``pack``; the same bits, laid out
for the kernels, with each block's float16 scale widened to float32 and Q4_K's 6-bit sub-scales
multiplied out, as ``kernels/quant_reference.py`` decomposes them):

- 4-bit form (Q4_0, Q4_1, Q4_K): ``qs`` uint8 ``[out, in / 2]``, per group of 32 inputs 16 bytes,
  byte ``j`` holding input ``j`` in its low nibble and ``j + 16`` in its high one (Q4_0's own
  order; Q4_K's nibbles are regrouped into it); ``scale``, ``minv`` float32 ``[out, in / 32]``:
  ``w = scale * q + minv``. 0.75 bytes a weight (the file's Q4_1: 0.625, Q4_K: 0.5625).
- 8-bit form (Q8_0, Q6_K): ``q`` int8 ``[out, in]`` (Q6_K's 6-bit values less 32, widened to a
  byte), ``scale`` float32 ``[out, in / group]`` (group 32 or 16). 1.125 or 1.25 bytes a weight.

Kernels: at few rows (a decode step, below ``PREFILL_ROWS``) one Numba pass over the weights,
parallel over output rows, each block's ``sum(x * q)`` in float32, scaled once per block
(``minv`` times the block's precomputed sum of ``x``); at more rows (prefill) the weight is
dequantized ``TILE_ROWS`` output rows at a time into float32 and multiplied by torch.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from kernels.cpu.common import sync_threads

# rows from which the dequantized tiles and torch's matmul are used, by form (4-bit, 8-bit): measured
# with ``python -m loadtest.kernels.quant_matmul`` (docs/benchmarks.md)
PREFILL_ROWS = {True: 3, False: 6}
TILE_ROWS = 1024  # output rows dequantized at a time for prefill


class Int4Pack:
    """A 4-bit ``QuantPack`` in torch's int4 CPU layout (``torch.ops.aten._weight_int4pack_mm_for_cpu``):
    the same 4-bit values, ``(scale, minv + 8 scale)`` per group of 32 in bfloat16 (torch's form
    is ``w = (q - 8) * scale + zero``). For bfloat16 models: at one row it took a fifth of the
    Numba pass's time, and at 128 rows 1.2x the tiles' (docs/benchmarks.md). 0.625 bytes a weight."""

    def __init__(self, p: QuantPack) -> None:
        q = torch.from_numpy(p.q).reshape(p.out_features, -1, 16)
        values = torch.cat([q & 15, q >> 4], dim=-1).reshape(p.out_features, -1).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        scale, minv = torch.from_numpy(p.scale), torch.from_numpy(p.minv)
        self.scales_zeros = torch.stack([scale, minv + 8 * scale], dim=-1).transpose(0, 1).contiguous().bfloat16()
        self.type_name, self.out_features, self.in_features = p.type_name, p.out_features, p.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


def int4_supported(p: QuantPack) -> bool:
    """Whether torch's int4 CPU kernel can hold ``p``: a 4-bit form, output rows a multiple of 16."""
    return (p.four_bit and p.out_features % 16 == 0 and p.group == 32
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def int4_matmul(x: torch.Tensor, p: Int4Pack) -> torch.Tensor:
    """``x @ W.T`` in bfloat16 by torch's int4 CPU kernel."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16().contiguous(), p.packed, 32, p.scales_zeros)


class QuantPack:
    """One quantized weight ``[out, in]`` in a kernel's layout (see the module's docstring)."""

    def __init__(self, type_name: str, q: np.ndarray, scale: np.ndarray, minv: np.ndarray | None) -> None:
        self.type_name, self.q, self.scale, self.minv = type_name, q, scale, minv
        self.four_bit = minv is not None
        self.out_features = q.shape[0]
        self.in_features = q.shape[1] * (2 if self.four_bit else 1)
        self.group = self.in_features // scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.minv is None else self.minv.nbytes)


def pack(raw: torch.Tensor, ggml_type: int) -> QuantPack:
    """The ``QuantPack`` of a GGUF weight's blocks (``raw``: uint8 ``[out, row bytes]``)."""
    from kernels.quant_reference import decompose, type_name

    d = decompose(raw, ggml_type)
    scale = np.ascontiguousarray(d.scale.numpy(), dtype=np.float32)
    if d.minv is None:
        return QuantPack(type_name(ggml_type), np.ascontiguousarray(d.q.numpy()), scale, None)
    q = d.q.reshape(d.q.shape[0], -1, 2, 16)  # each group of 32: inputs 0..15, then 16..31
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(d.q.shape[0], -1)
    minv = np.ascontiguousarray(d.minv.numpy(), dtype=np.float32)
    return QuantPack(type_name(ggml_type), np.ascontiguousarray(qs.numpy()), scale, minv)


@njit(parallel=True, fastmath=True, cache=True)
def _q4_rows(x, xsum, qs, scale, minv, out):  # pragma: no cover - compiled
    n_out, nb = scale.shape
    for n in prange(n_out):
        for m in range(x.shape[0]):
            acc = np.float32(0.0)
            for b in range(nb):
                s = np.float32(0.0)
                for j in range(16):
                    byte = qs[n, b * 16 + j]
                    s += x[m, b * 32 + j] * np.float32(byte & 15) + x[m, b * 32 + j + 16] * np.float32(byte >> 4)
                acc += scale[n, b] * s + minv[n, b] * xsum[m, b]
            out[m, n] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _q8_rows(x, q, scale, out):  # pragma: no cover - compiled
    n_out, nb = scale.shape
    g = q.shape[1] // nb
    for n in prange(n_out):
        for m in range(x.shape[0]):
            acc = np.float32(0.0)
            for b in range(nb):
                s = np.float32(0.0)
                for j in range(g):
                    s += x[m, b * g + j] * np.float32(q[n, b * g + j])
                acc += scale[n, b] * s
            out[m, n] = acc


@njit(parallel=True, cache=True)
def _q4_dequant(qs, scale, minv, rows, out):  # pragma: no cover - compiled
    nb = scale.shape[1]
    for i in prange(rows.shape[0]):
        n = rows[i]
        for b in range(nb):
            s, mn = scale[n, b], minv[n, b]
            for j in range(16):
                byte = qs[n, b * 16 + j]
                out[i, b * 32 + j] = s * np.float32(byte & 15) + mn
                out[i, b * 32 + j + 16] = s * np.float32(byte >> 4) + mn


@njit(parallel=True, cache=True)
def _q8_dequant(q, scale, rows, out):  # pragma: no cover - compiled
    nb = scale.shape[1]
    g = q.shape[1] // nb
    for i in prange(rows.shape[0]):
        n = rows[i]
        for b in range(nb):
            s = scale[n, b]
            for j in range(g):
                out[i, b * g + j] = s * np.float32(q[n, b * g + j])


def dequantize_rows(p: QuantPack, rows: np.ndarray) -> torch.Tensor:
    """float32 ``[len(rows), in]``: the weight's output rows ``rows`` (int64), dequantized (the
    embedding lookup of a quantized table, and the prefill tiles)."""
    out = np.empty((len(rows), p.in_features), dtype=np.float32)
    sync_threads()
    if p.four_bit:
        _q4_dequant(p.q, p.scale, p.minv, rows, out)
    else:
        _q8_dequant(p.q, p.scale, rows, out)
    return torch.from_numpy(out)


def matmul_rows(x: torch.Tensor, p: QuantPack) -> torch.Tensor:
    """``x @ W.T`` (float32 ``[M, out]``) by the Numba kernel: one pass over the weight."""
    xf = x.detach().float().contiguous().numpy()
    out = np.empty((xf.shape[0], p.out_features), dtype=np.float32)
    sync_threads()
    if p.four_bit:
        xsum = np.ascontiguousarray(xf.reshape(xf.shape[0], -1, 32).sum(axis=2, dtype=np.float32))
        _q4_rows(xf, xsum, p.q, p.scale, p.minv, out)
    else:
        _q8_rows(xf, p.q, p.scale, out)
    return torch.from_numpy(out)


def matmul_tiles(x: torch.Tensor, p: QuantPack) -> torch.Tensor:
    """``x @ W.T`` (float32 ``[M, out]``) through float32 tiles of the weight and torch's matmul."""
    xf = x.detach().float()
    out = torch.empty((xf.shape[0], p.out_features), dtype=torch.float32)
    for start in range(0, p.out_features, TILE_ROWS):
        stop = min(start + TILE_ROWS, p.out_features)
        tile = dequantize_rows(p, np.arange(start, stop, dtype=np.int64))
        out[:, start:stop] = xf @ tile.T
    return out


def quant_matmul(x: torch.Tensor, p) -> torch.Tensor:
    """``x @ W.T``: torch's int4 kernel for an ``Int4Pack`` (bfloat16), else in float32 the Numba
    pass at few rows, dequantized tiles at many."""
    if isinstance(p, Int4Pack):
        return int4_matmul(x, p)
    return matmul_rows(x, p) if x.shape[0] < PREFILL_ROWS[p.four_bit] else matmul_tiles(x, p)
