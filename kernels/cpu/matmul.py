"""bfloat16 matmuls ``x @ W.T`` for the model's linear layers on CPUs with AVX-512 BF16 and no AMX:
the weight packed once into pairs, multiplied with ``vdpbf16ps`` (``--linear-kernel numba``,
``services/executor/linear.py``).

Why: a decode step multiplies a few rows by every weight, so its matmuls should take the time of
reading the weights once. oneDNN's bfloat16 kernel (what ``--linear-kernel onednn`` runs) does
not stream them that fast at few rows on a CPU without AMX. Measured on a 2-core AMD EPYC Zen 4
(family 25, model 17; ``avx512_bf16``, no AMX; 2026-12-03) with ``python -m loadtest.kernels.matmul
--rows 1,4,8,16,32,64,2048``: SmolLM2's 210 layer matmuls (30 layers with weights of their own) plus
the LM head, 269 MB of bfloat16 weights, 2 threads, both kernels interleaved in one process, median
of 5 rounds, two runs:

| rows | oneDNN packed | this kernel | ratio |
|---|---|---|---|
| 1 | 20.33 / 22.72 ms | 13.37 / 15.47 ms | 0.66 / 0.68 |
| 4 | 19.07 / 19.57 | 13.96 / 14.28 | 0.73 / 0.73 |
| 8 | 18.02 / 22.26 | 13.97 / 16.72 | 0.78 / 0.75 |
| 16 | 23.90 / 26.46 | 21.24 / 22.76 | 0.89 / 0.86 |
| 32 | 32.31 / 37.53 | 28.96 / 33.11 | 0.90 / 0.88 |
| 64 | 53.81 / 59.44 | 53.70 / 56.08 | 1.00 / 0.94 |
| 2,048 | 1,484.9 / 1,523.8 | 1,600.8 / 1,645.2 | 1.08 / 1.08 |

At one row oneDNN read the weights at 12-13 GB/s, this kernel at 17-20, where a ``torch.sum``
read 28-32 GB/s on this machine (an earlier session). From about 32 rows both are bound by the
CPU's ``vdpbf16ps`` rate; at prefill sizes oneDNN's blocking is the better one.

Layout. The weight ``[out, in]`` (bfloat16) is stored as ``[tiles, in / 2, 64, 2]``: tiles of
``TILE_COLUMNS`` (64) output columns; within a tile, for each pair of inputs ``(2p, 2p + 1)``, the
64 columns' two weights side by side. One tile is one contiguous stream (``in * 128`` bytes), read
once per ``ROW_BLOCK`` rows. Output columns past ``out`` (the last tile's padding) are zero
weights and are not written.

Arithmetic. For each input pair, the pair of ``x``'s row is broadcast and ``vdpbf16ps`` adds both
products to each of 16 float32 lanes (four instructions per tile and row); products of two
bfloat16 values are exact in float32, sums are float32, and the result is rounded to bfloat16
once, to nearest even, as torch rounds. Rows go in chunks of ``ROW_CHUNK`` (6): 24 accumulator
registers plus the tile's four weight vectors, which stay in registers for the chunk's rows
(``Rows``, ``kernels/cpu/vectors.py``). Where numba does not compile for AVX-512 BF16, each pair
is widened to float32 and multiplied with two FMAs: the same products, another rounding of the
sums (the tests run it on any x86 CPU; ``auto`` does not choose this kernel there).

Tasks: (row block of ``ROW_BLOCK`` rows, tile), row-block major, in a ``prange``: a thread's share
keeps one block of ``x`` in its L2 while the tiles stream past. Results do not depend on the
thread count.

Per-call costs, measured while writing it: the results are rounded and stored 16 lanes at a time
(``store_rounded``; an element-by-element store took 10-15% more at 64 rows, where a layer of 576
inputs has only 288 pairs per chunk to amortize it over); the six row counts are six constant
``GroupShape``s in one specialization (a tuple of them as an argument cost about 20 us per call in
numba's dispatch; the call is now about 9 us, 2 of them the kernel's launch).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels.cpu.common import _FASTMATH, narrow_like, sync_threads
from kernels.cpu.vectors import (
    DOT_BF16, I32, I64, F32, GroupShape, Rows, _dot_bf16, c_array, element_ptr, fma, splat,
    store_rows, zero_rows,
)

TILE_COLUMNS = 64  # output columns per tile: four float32 vectors of AVX-512
ROW_CHUNK = 6  # rows multiplied together: 24 accumulators + 4 weight vectors of 32 registers
ROW_BLOCK = 96  # rows of x a task keeps while its tiles stream (a multiple of ROW_CHUNK)
_PAIR_WORDS = 2 * TILE_COLUMNS  # uint16 words of one input pair of one tile

_I16 = ir.IntType(16)
# the accumulators of 1 to ROW_CHUNK rows: constants the kernel reads (an argument of a
# GroupShape tuple cost ~20 us per call in numba's dispatch)
_ROWS1, _ROWS2, _ROWS3, _ROWS4, _ROWS5, _ROWS6 = (GroupShape.of(4 * r, 16) for r in range(1, 7))


def pack_pairs(weight: torch.Tensor) -> np.ndarray:
    """``weight`` (bfloat16 ``[out, in]``, ``in`` even) in this kernel's layout: uint16 bits
    ``[tiles, in / 2, 128]``, the last tile zero-padded to 64 columns."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise TypeError(f"pack_pairs takes a 2-D bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if in_f % 2:
        raise ValueError(f"pack_pairs needs an even number of input features, got {in_f}")
    tiles = -(-out_f // TILE_COLUMNS)
    bits = torch.zeros(tiles * TILE_COLUMNS, in_f, dtype=torch.uint16)
    bits[:out_f] = weight.detach().cpu().view(torch.uint16)
    packed = bits.view(tiles, TILE_COLUMNS, in_f // 2, 2).permute(0, 2, 1, 3)
    return np.ascontiguousarray(packed.reshape(tiles, in_f // 2, _PAIR_WORDS).numpy())


@intrinsic
def add_pair_products(typingctx, acc, packed, offset, x, pair, row_stride, first_row):
    """``acc`` (``Rows[4R x 16]``: R rows of x, four 16-column vectors each) plus the products of
    one input pair: x's rows ``first_row .. first_row + R - 1`` (``x``: int32 words, each a pair
    of bfloat16 inputs, ``row_stride`` words per row; word ``pair`` of each) with the tile's 64
    columns' weights for that pair (``packed``'s 128 uint16 words from flat index ``offset``)."""
    if not (isinstance(acc, Rows) and not acc.bits and acc.width == 16 and acc.rows % 4 == 0
            and c_array(packed, types.uint16) and c_array(x, types.int32)
            and all(isinstance(i, types.Integer) for i in (offset, pair, row_stride, first_row))):
        return None
    rows = acc.rows // 4

    def codegen(context, builder, sig, args):
        acc_v, packed_v, offset_v, x_v, pair_v, stride_v, first_v = args
        base = element_ptr(context, builder, packed, packed_v, offset_v, offset)
        words = ir.VectorType(_I16, 32)
        weights = [builder.load(builder.bitcast(builder.gep(base, [ir.Constant(I64, c * 32)]),
                                                words.as_pointer()), align=2)
                   for c in range(4)]
        if not DOT_BF16:
            weights = [_widen_pairs(builder, w) for w in weights]
        pair64 = context.cast(builder, pair_v, pair, types.intp)
        stride64 = context.cast(builder, stride_v, row_stride, types.intp)
        first64 = context.cast(builder, first_v, first_row, types.intp)
        for r in range(rows):
            index = builder.add(builder.mul(builder.add(first64, ir.Constant(I64, r)), stride64),
                                pair64)
            word = builder.load(element_ptr(context, builder, x, x_v, index), align=4)
            if DOT_BF16:
                both = builder.bitcast(splat(builder, word, 16), words)
            else:
                even, odd = _widen_pairs(builder, builder.bitcast(splat(builder, word, 16), words))
            for c in range(4):
                k = r * 4 + c
                vec = builder.extract_value(acc_v, k)
                if DOT_BF16:
                    vec = _dot_bf16(builder, vec, both, weights[c])
                else:
                    vec = fma(builder, odd, weights[c][1], fma(builder, even, weights[c][0], vec))
                acc_v = builder.insert_value(acc_v, vec, k)
        return acc_v

    return acc(acc, packed, offset, x, pair, row_stride, first_row), codegen


@intrinsic
def store_rounded(typingctx, out, first_row, col, acc, bias):
    """Store ``acc`` (``Rows[4R x 16]``) plus ``bias[col : col + 64]`` (float32) into ``out``'s rows
    ``first_row ..`` (uint16 bfloat16 bits ``[M, N]``, ``col + 64 <= N``), columns ``col ..``,
    rounded to nearest even as torch rounds (a NaN becomes 0xFFFF), 16 lanes at a time."""
    if not (c_array(out, types.uint16) and isinstance(acc, Rows) and not acc.bits and acc.width == 16
            and c_array(bias, types.float32)
            and all(isinstance(i, types.Integer) for i in (first_row, col))):
        return None
    rows = acc.rows // 4

    def codegen(context, builder, sig, args):
        out_v, first_v, col_v, acc_v, bias_v = args
        first64 = context.cast(builder, first_v, first_row, types.intp)
        col64 = context.cast(builder, col_v, col, types.intp)
        width = builder.extract_value(context.make_array(out)(context, builder, out_v).shape, 1)
        b_base = element_ptr(context, builder, bias, bias_v, col64)
        vec, ivec = ir.VectorType(F32, 16), ir.VectorType(I32, 16)
        biases = [builder.load(builder.bitcast(builder.gep(b_base, [ir.Constant(I64, c * 16)]),
                                               vec.as_pointer()), align=4) for c in range(4)]

        def const(v):
            return ir.Constant(ivec, [v] * 16)

        for r in range(rows):
            index = builder.add(builder.mul(builder.add(first64, ir.Constant(I64, r)), width), col64)
            o_base = element_ptr(context, builder, out, out_v, index)
            for c in range(4):
                value = builder.fadd(builder.extract_value(acc_v, r * 4 + c), biases[c])
                bits = builder.bitcast(value, ivec)
                lsb = builder.and_(builder.lshr(bits, const(16)), const(1))
                rounded = builder.lshr(builder.add(bits, builder.add(lsb, const(0x7FFF))), const(16))
                is_nan = builder.fcmp_unordered("uno", value, value)
                rounded = builder.select(is_nan, const(0xFFFF), rounded)
                narrow = builder.trunc(rounded, ir.VectorType(_I16, 16))
                ptr = builder.bitcast(builder.gep(o_base, [ir.Constant(I64, c * 16)]),
                                      ir.VectorType(_I16, 16).as_pointer())
                builder.store(narrow, ptr, align=2)
        return context.get_dummy_value()

    return types.void(out, first_row, col, acc, bias), codegen


def _widen_pairs(builder, words):
    """32 bfloat16 bits (16 pairs) as two float32 vectors: the pairs' first and second elements."""
    pairs = builder.bitcast(words, ir.VectorType(I32, 16))
    even = builder.shl(pairs, ir.Constant(ir.VectorType(I32, 16), [16] * 16))
    odd = builder.and_(pairs, ir.Constant(ir.VectorType(I32, 16), [-65536] * 16))
    vec = ir.VectorType(F32, 16)
    return builder.bitcast(even, vec), builder.bitcast(odd, vec)


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _chunk(out, x, packed, bias, shape, tile, first, rows, scratch):
    # rows first .. first + rows - 1 of out's columns of this tile; shape: Rows[4R x 16], R >= rows
    pairs = packed.shape[1]
    acc = zero_rows(shape)
    base = tile * pairs * 128
    for p in range(pairs):
        acc = add_pair_products(acc, packed, base + p * 128, x, p, pairs, first)
    col0 = tile * TILE_COLUMNS
    if col0 + TILE_COLUMNS <= out.shape[1]:
        store_rounded(out, first, col0, acc, bias)
    else:  # the last tile of a layer whose outputs are not a multiple of 64
        store_rows(scratch, 0, acc)
        for r in range(rows):
            for c in range(out.shape[1] - col0):
                out[first + r, col0 + c] = narrow_like(out, scratch[r * TILE_COLUMNS + c] + bias[col0 + c])


@njit(fastmath=_FASTMATH, cache=True, nogil=True, inline="always")
def _rows(out, x, packed, bias, tile, first, rows, scratch):
    # _chunk for 1 to ROW_CHUNK (6) rows, each count compiled with its own accumulators
    if rows == 6:
        _chunk(out, x, packed, bias, _ROWS6, tile, first, rows, scratch)
    elif rows == 5:
        _chunk(out, x, packed, bias, _ROWS5, tile, first, rows, scratch)
    elif rows == 4:
        _chunk(out, x, packed, bias, _ROWS4, tile, first, rows, scratch)
    elif rows == 3:
        _chunk(out, x, packed, bias, _ROWS3, tile, first, rows, scratch)
    elif rows == 2:
        _chunk(out, x, packed, bias, _ROWS2, tile, first, rows, scratch)
    else:
        _chunk(out, x, packed, bias, _ROWS1, tile, first, rows, scratch)


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _matmul_kernel(out, x, packed, bias):
    # out: uint16 [M, out_features] (bfloat16 bits); x: int32 [M, in / 2] (pairs of bfloat16 bits);
    # packed: uint16 [tiles, in / 2, 128] (pack_pairs); bias: float32 [tiles * 64] (pad_bias);
    num_tiles, num_rows = packed.shape[0], x.shape[0]
    blocks = (num_rows + ROW_BLOCK - 1) // ROW_BLOCK
    for task in prange(blocks * num_tiles):
        block = task // num_tiles
        tile = task - block * num_tiles
        scratch = np.empty(ROW_CHUNK * TILE_COLUMNS, np.float32)
        first, end = block * ROW_BLOCK, min(num_rows, (block + 1) * ROW_BLOCK)
        while first < end:
            rows = min(ROW_CHUNK, end - first)
            _rows(out, x, packed, bias, tile, first, rows, scratch)
            first += rows




def pad_bias(bias: torch.Tensor | None, packed: np.ndarray) -> np.ndarray:
    """The kernel's bias for ``packed``'s layer: float32 ``[tiles * 64]``, zeros past the layer's
    outputs (and everywhere for a layer without one)."""
    padded = np.zeros(packed.shape[0] * TILE_COLUMNS, np.float32)
    if bias is not None:
        padded[:bias.shape[0]] = bias.detach().float().cpu().numpy()
    return padded


def matmul_bf16(x: torch.Tensor, packed: np.ndarray, out_features: int, bias: np.ndarray) -> torch.Tensor:
    """``x @ W.T + b`` for ``packed = pack_pairs(W)`` and ``bias = pad_bias(b, packed)``: x bfloat16
    ``[..., in]``; returns bfloat16 ``[..., out_features]``."""
    in_f = 2 * packed.shape[1]
    if x.dtype != torch.bfloat16 or x.shape[-1] != in_f:
        raise ValueError(f"matmul_bf16 takes bfloat16 [..., {in_f}], got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, in_f)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    if rows.shape[0]:
        sync_threads()
        _matmul_kernel(out.view(torch.uint16).numpy(), rows.view(torch.int32).numpy(), packed,
                       bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)
