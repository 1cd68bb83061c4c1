"""Numba CPU kernels over quantized KV caches (``kernels/kv_quant.py``: layout, formats, the
reference): the write that quantizes each (token, KV head) row with its own scale, and paged
decode and prefill attention that dequantize as they read.

int8 is read as int8 and widened; fp8 travels as its bits (``uint8``: numba has no float8 type)
and is widened by placing them in a float32's exponent and mantissa bits (``_widen``: shifts that
vectorize, where a lookup in the 256-entry table ``kv_quant.e4m3_table`` is a gather; both tested
against torch's cast). A key row's scale multiplies its dot products (one product per query head,
not per element), a value row's its softmax weight. The write encodes e4m3 from the float32's bits,
ties to the even code (torch's rounding; ``_encode_e4m3``).

The attention is one task per (query row, KV head) in a ``prange``: the group of query heads that
share the KV head read each K/V row once; online softmax one step per block-sized tile; float32
throughout, the output cast by the caller. Plain loops over ``head_dim`` (no register tiling as in
``decode.py``): measured on the 2-core Xeon, one thread, batch 64 x 256 tokens of SmolLM2's shapes,
one layer: int8 2.7 ms, fp8 3.2 ms, against 0.9 ms for the bf16 kernel of ``decode.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload

from kernels.kv_quant import QMAX, QuantCache

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # as kernels/cpu/common.py: no nnan/ninf


@njit(cache=True, nogil=True)
def _encode_e4m3(q, bits):
    """The e4m3 bits nearest ``q`` (|q| <= 448), ties to the even code: torch's cast. Normal
    values (|q| >= 2**-6) round the float32's mantissa to 3 bits in its bits (the carry moves into
    the exponent as it should) and rebias the exponent from 127 to 7; below, e4m3's subnormals
    are multiples of 2**-9, rounded half to even (``np.rint``). ``bits``: those of ``|q|``."""
    a = np.float32(abs(q))
    if a < np.float32(2.0 ** -6):
        c = np.uint32(np.rint(a * np.float32(512.0)))
    else:
        c = ((bits + np.uint32(0x7FFFF) + ((bits >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    return np.uint8(c | 0x80) if q < 0 and c > 0 else np.uint8(c)


@njit(cache=True, nogil=True)
def _write_quant_kernel(data, scales, x, slot_mapping, qmax, is_int8):
    # data: [num_blocks, Hkv, bs, D] uint8 view; scales: [num_blocks, Hkv, bs] float32;
    # x: [T, Hkv, D] float32; slot_mapping: [T] int64. Serial, as cache_ops._write_kv_kernel.
    num_tokens, num_kv_heads, head_dim = x.shape
    block_size = data.shape[2]
    mag = np.empty(head_dim, np.float32)  # |q| of a row, and its bits
    mag_bits = mag.view(np.uint32)
    for i in range(num_tokens):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(num_kv_heads):
            amax = np.float32(0.0)
            for d in range(head_dim):
                amax = max(amax, abs(x[i, h, d]))
            s = np.float32(amax / qmax)
            scales[blk, h, off] = s
            for d in range(head_dim):
                q = np.float32(x[i, h, d] / s) if s > 0 else np.float32(0.0)
                if is_int8:
                    v = min(max(np.rint(q), -127.0), 127.0)
                    data[blk, h, off, d] = np.uint8(np.int8(v) & 0xFF)
                else:
                    mag[d] = min(abs(q), np.float32(448.0))
                    data[blk, h, off, d] = _encode_e4m3(q, mag_bits[d])


def _bytes(cache: QuantCache) -> np.ndarray:
    return cache.data.numpy().view(np.uint8)


def write_kv_cache(key_cache: QuantCache, value_cache: QuantCache, key, value, slot_mapping) -> None:
    """Quantize the new tokens' K/V (torch tensors, any float dtype) into their slots."""
    if key.shape[0] == 0:
        return
    slots = np.ascontiguousarray(slot_mapping.numpy() if isinstance(slot_mapping, torch.Tensor)
                                 else slot_mapping, dtype=np.int64)
    for cache, x in ((key_cache, key), (value_cache, value)):
        xs = x.detach().float().contiguous().numpy()
        _write_quant_kernel(_bytes(cache), cache.scale.numpy(), xs, slots, np.float32(QMAX[cache.fmt]),
                            cache.fmt == "int8")


def _widen(row, data, blk, kvh, off):
    """``row[:] = `` the float32 values of ``data[blk, kvh, off]``, before scaling (``_row_scale``).
    Row by row: widening a whole tile first into a [tile, head_dim] scratch measured 2.5x slower."""


@overload(_widen, inline="always")
def _widen_impl(row, data, blk, kvh, off):
    if data.dtype == types.int8:
        def widen_int8(row, data, blk, kvh, off):
            for d in range(row.shape[0]):
                row[d] = np.float32(data[blk, kvh, off, d])
        return widen_int8

    def widen_e4m3(row, data, blk, kvh, off):
        # e4m3 bits placed where float32 keeps its exponent and mantissa (bits 20-26, the sign at
        # 31) are the same value times 2**-120, subnormals included (float32 subnormals then):
        # integer shifts that vectorize, where a table lookup is a gather. 0x7F (NaN) would read
        # as 480: the write never stores it (it clamps to 448).
        bits = row.view(np.uint32)
        for d in range(row.shape[0]):
            b = np.uint32(data[blk, kvh, off, d])
            bits[d] = ((b & np.uint32(0x80)) << np.uint32(24)) | ((b & np.uint32(0x7F)) << np.uint32(20))
    return widen_e4m3


def _row_scale(data):
    """What ``_widen``'s values are multiplied by, beside the row's scale."""


@overload(_row_scale, inline="always")
def _row_scale_impl(data):
    if data.dtype == types.int8:
        return lambda data: np.float32(1.0)
    return lambda data: np.float32(2.0 ** 120)


@njit(fastmath=_FASTMATH, cache=True, nogil=True)
def _row_task(out, query, kdata, kscale, vdata, vscale, block_tables, seq, length, r, kvh, scale,
              window, softcap):
    """Query row ``r``'s heads of KV head ``kvh`` over positions [0, length) of sequence ``seq``
    (its last ``window`` with a window), an online softmax step per block-sized tile: each key row
    widened and its dot products with the group's queries taken (times the row's scale), then each
    value row widened and accumulated with the weights times its scale."""
    num_heads = query.shape[1]
    num_kv_heads, block_size, head_dim = kdata.shape[1], kdata.shape[2], kdata.shape[3]
    group = num_heads // num_kv_heads
    h0 = kvh * group
    acc = np.zeros((group, head_dim), np.float32)
    qg = np.empty((group, head_dim), np.float32)
    for g in range(group):
        for d in range(head_dim):
            qg[g, d] = query[r, h0 + g, d]
    m = np.full(group, np.float32(-1e30))
    lsum = np.zeros(group, np.float32)
    row = np.empty(head_dim, np.float32)  # a key or value row, widened
    sco = np.empty((group, block_size), np.float32)
    kfix = _row_scale(kdata) * scale
    vfix = _row_scale(vdata)
    pos = max(0, length - window) if window > 0 else 0
    while pos < length:
        bi = pos // block_size
        off = pos - bi * block_size
        n = min(block_size - off, length - pos)
        blk = block_tables[seq, bi]
        for t in range(n):
            ks = kscale[blk, kvh, off + t] * kfix
            _widen(row, kdata, blk, kvh, off + t)
            for g in range(group):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += qg[g, d] * row[d]
                x = dot * ks
                if softcap > 0:
                    x = softcap * np.tanh(x / softcap)
                sco[g, t] = x
        for g in range(group):
            top = m[g]
            for t in range(n):
                top = max(top, sco[g, t])
            alpha = np.exp(m[g] - top)
            m[g] = top
            total = lsum[g] * alpha
            for t in range(n):
                p = np.exp(sco[g, t] - top)
                sco[g, t] = p
                total += p
            lsum[g] = total
            if alpha != 1.0:
                for d in range(head_dim):
                    acc[g, d] *= alpha
        for t in range(n):
            vs = vscale[blk, kvh, off + t] * vfix
            _widen(row, vdata, blk, kvh, off + t)
            for g in range(group):
                w = sco[g, t] * vs
                for d in range(head_dim):
                    acc[g, d] += w * row[d]
        pos += n
    for g in range(group):
        inv = np.float32(1.0) / lsum[g]
        for d in range(head_dim):
            out[r, h0 + g, d] = acc[g, d] * inv


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _rows_kernel(out, query, kdata, kscale, vdata, vscale, block_tables, seqs, lens, scale, window,
                 softcap):
    # out, query: [R, H, D] float32; kdata, vdata: [num_blocks, Hkv, bs, D] int8 (int8) or uint8
    # (e4m3 bits); kscale, vscale: [num_blocks, Hkv, bs] float32; block_tables: [S, max_blocks] int32;
    # seqs, lens: [R] int64: row r attends to positions [0, lens[r]) of sequence seqs[r]
    num_kv_heads = kdata.shape[1]
    for task in prange(query.shape[0] * num_kv_heads):
        r = task // num_kv_heads
        _row_task(out, query, kdata, kscale, vdata, vscale, block_tables, seqs[r], lens[r], r,
                  task - r * num_kv_heads, scale, window, softcap)


def attend_rows(out, query, key_cache: QuantCache, value_cache: QuantCache, block_tables, seqs, lens,
                scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """Query row ``r`` (torch ``[R, H, D]``, any float dtype) attends to positions ``[0, lens[r])``
    of sequence ``seqs[r]``; writes ``out`` (torch, cast from float32) in place."""
    if query.shape[0] == 0:
        return
    if key_cache.fmt != value_cache.fmt:
        raise TypeError(f"key and value caches in {key_cache.fmt} and {value_cache.fmt}")
    q = query.detach().float().contiguous().numpy()
    res = np.empty_like(q)
    tables = np.ascontiguousarray(block_tables.numpy() if isinstance(block_tables, torch.Tensor)
                                  else block_tables, dtype=np.int32)
    _rows_kernel(res, q, key_cache.data.numpy(), key_cache.scale.numpy(), value_cache.data.numpy(),
                 value_cache.scale.numpy(), tables,
                 np.ascontiguousarray(seqs, dtype=np.int64), np.ascontiguousarray(lens, dtype=np.int64),
                 np.float32(scale), int(window), np.float32(softcap))
    out.copy_(torch.from_numpy(res))


def paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                           window: int = 0, softcap: float = 0.0) -> None:
    """One query per sequence over its context (``reference.paged_decode_attention``)."""
    lens = np.asarray(context_lens, dtype=np.int64)
    attend_rows(out, query, key_cache, value_cache, block_tables, np.arange(len(lens)), lens, scale,
                window, softcap)


def paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, window: int = 0, softcap: float = 0.0) -> None:
    """New tokens attend causally to themselves and their prefix (``reference.paged_prefill_attention``):
    each a row of ``attend_rows``, as ``kernels/cpu/prefill.py`` maps them."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = starts[1:] - starts[:-1]
    num_tokens = int(q_lens.sum())
    if num_tokens == 0:
        return
    seqs = np.repeat(np.arange(len(q_lens)), q_lens)
    first = np.repeat(np.asarray(context_lens, dtype=np.int64) - q_lens - starts[:-1], q_lens)
    lens = first + np.arange(starts[0], starts[0] + num_tokens) + 1
    rows = slice(int(starts[0]), int(starts[0]) + num_tokens)
    attend_rows(out[rows], query[rows], key_cache, value_cache, block_tables, seqs, lens, scale,
                window, softcap)
