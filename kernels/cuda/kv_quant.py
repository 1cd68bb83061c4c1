"""Numba CUDA kernels over quantized KV caches (``kernels/kv_quant.py``: layout, formats, the
reference): the write that quantizes each (token, KV head) row with its own scale, and paged
attention that dequantizes as it reads, for decode and prefill alike (a prefill token is a row
attending to a prefix of its sequence, as in ``kernels/cpu/kv_quant.py``).

Bytes are read as ``uint8`` through a 256-entry float32 table (``kv_quant.byte_table``); fp8 is
encoded by a binary search over the 127 non-negative e4m3 values, ties to the even code (torch's
cast). Written out inline, no device functions (see ``kernels/cuda/__init__.py``).

Simple first: one thread per (query row, query head) walking the row's context with an online
softmax, its accumulator in a local array of ``MAX_HEAD_DIM``. Tested under the simulator at tiny
shapes; not tuned for a GPU.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from kernels.cuda.config import MAX_HEAD_DIM
from kernels.kv_quant import QMAX, byte_table

TABLES = {fmt: byte_table(fmt) for fmt in QMAX}
E4M3_POSITIVE = TABLES["fp8_e4m3"][:127].copy()


# grid: (num_tokens,); block: (num_kv_heads,)
@cuda.jit
def write_quant_kernel(data, scales, x, slot_mapping, qmax, is_int8, positive):
    # data: [num_blocks, Hkv, bs, D] uint8; scales: [num_blocks, Hkv, bs] float32;
    # x: [T, Hkv, D] float32; slot_mapping: [T] int64
    i = cuda.blockIdx.x
    h = cuda.threadIdx.x
    slot = slot_mapping[i]
    if slot < 0 or h >= x.shape[1]:
        return
    head_dim = x.shape[2]
    block_size = data.shape[2]
    blk = slot // block_size
    off = slot - blk * block_size
    amax = np.float32(0.0)
    for d in range(head_dim):
        a = abs(x[i, h, d])
        if a > amax:
            amax = a
    s = np.float32(amax / qmax)
    scales[blk, h, off] = s
    for d in range(head_dim):
        q = np.float32(0.0)
        if s > 0:
            q = np.float32(x[i, h, d] / s)
        if is_int8:
            v = np.float32(math.floor(q))
            frac = q - v  # exact: |q| <= 127
            if frac > 0.5 or (frac == 0.5 and v % 2 != 0):  # to nearest, a tie to the even one
                v += 1
            if v > 127:
                v = 127
            if v < -127:
                v = -127
            data[blk, h, off, d] = np.uint8(np.int32(v) & 0xFF)
        else:
            a = abs(q)
            if a > 448:
                a = np.float32(448.0)
            lo = 0
            hi = positive.shape[0] - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if positive[mid] <= a:
                    lo = mid
                else:
                    hi = mid - 1
            c = lo
            if c < positive.shape[0] - 1:
                below = a - positive[c]
                above = positive[c + 1] - a
                if above < below or (above == below and c % 2 == 1):
                    c += 1
            if q < 0 and c > 0:
                c |= 0x80
            data[blk, h, off, d] = np.uint8(c)


# grid: (num_rows,); block: (num_heads,)
@cuda.jit
def attend_quant_kernel(out, query, kdata, kscale, vdata, vscale, table, block_tables, seqs, lens,
                        scale, window, softcap):
    # out, query: [R, H, D] float32; kdata, vdata: [num_blocks, Hkv, bs, D] uint8; kscale, vscale:
    # [num_blocks, Hkv, bs] float32; table: [256] float32; block_tables: [S, max_blocks] int32;
    # seqs, lens: [R] int64: row r attends to positions [0, lens[r]) of sequence seqs[r]
    r = cuda.blockIdx.x
    h = cuda.threadIdx.x
    num_heads, head_dim = query.shape[1], query.shape[2]
    if h >= num_heads:
        return
    kvh = h // (num_heads // kdata.shape[1])
    block_size = kdata.shape[2]
    seq = seqs[r]
    length = lens[r]
    acc = cuda.local.array(MAX_HEAD_DIM, np.float32)
    for d in range(head_dim):
        acc[d] = 0.0
    m = np.float32(-1e30)
    total = np.float32(0.0)
    pos = 0
    if window > 0 and length > window:
        pos = length - window
    while pos < length:
        bi = pos // block_size
        off = pos - bi * block_size
        blk = block_tables[seq, bi]
        dot = np.float32(0.0)
        for d in range(head_dim):
            dot += query[r, h, d] * table[kdata[blk, kvh, off, d]]
        x = dot * kscale[blk, kvh, off] * scale
        if softcap > 0:
            x = softcap * math.tanh(x / softcap)
        top = m
        if x > top:
            top = x
        alpha = math.exp(m - top)
        p = math.exp(x - top)
        total = total * alpha + p
        w = p * vscale[blk, kvh, off]
        for d in range(head_dim):
            acc[d] = acc[d] * alpha + w * table[vdata[blk, kvh, off, d]]
        m = top
        pos += 1
    for d in range(head_dim):
        out[r, h, d] = acc[d] / total


def write_kv_cache(data, scales, x, slot_mapping, fmt: str, table_positive) -> None:
    """One of keys or values: ``x`` ``[T, Hkv, D]`` float32 quantized into ``data``/``scales``
    (device arrays, or numpy under the simulator); ``table_positive``: ``E4M3_POSITIVE`` on the
    device."""
    if x.shape[0] == 0:
        return
    write_quant_kernel[(x.shape[0],), (x.shape[1],)](data, scales, x, slot_mapping, np.float32(QMAX[fmt]),
                                                     fmt == "int8", table_positive)


def attend_rows(out, query, kdata, kscale, vdata, vscale, table, block_tables, seqs, lens, scale,
                window: int = 0, softcap: float = 0.0) -> None:
    """Row ``r`` of ``query`` ``[R, H, D]`` over positions ``[0, lens[r])`` of ``seqs[r]``."""
    if query.shape[0] == 0:
        return
    if query.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {query.shape[2]} > {MAX_HEAD_DIM}")
    attend_quant_kernel[(query.shape[0],), (query.shape[1],)](
        out, query, kdata, kscale, vdata, vscale, table, block_tables, seqs, lens, np.float32(scale),
        int(window), np.float32(softcap))


def prefill_rows(query_start_loc, context_lens) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, length) of each new token's row, from host arrays (``kernels/cpu/prefill.py``)."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = starts[1:] - starts[:-1]
    num_tokens = int(q_lens.sum())
    seqs = np.repeat(np.arange(len(q_lens)), q_lens)
    first = np.repeat(np.asarray(context_lens, dtype=np.int64) - q_lens - starts[:-1], q_lens)
    return seqs, first + np.arange(starts[0], starts[0] + num_tokens) + 1


_ON_DEVICE: dict = {}  # the byte tables, copied to the GPU once


def _table(key: str, host: np.ndarray):
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = cuda.to_device(host)
    return _ON_DEVICE[key]


def _dev(t):
    return cuda.as_cuda_array(t.detach(), sync=False)


def torch_write_kv_cache(key_cache, value_cache, key, value, slot_mapping) -> None:
    """``kv_quant.write_kv_cache``'s signature on torch CUDA tensors (``QuantCache`` pools)."""
    import torch

    if key.shape[0] == 0:
        return
    slots = _dev(slot_mapping.to(torch.int64).contiguous())
    for cache, x in ((key_cache, key), (value_cache, value)):
        write_kv_cache(_dev(cache.data.view(torch.uint8)), _dev(cache.scale), _dev(x.float().contiguous()), slots,
                       cache.fmt, _table("positive", E4M3_POSITIVE))


def _torch_rows(out, query, key_cache, value_cache, block_tables, seqs, lens, scale, window, softcap):
    import torch

    res = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    u8 = torch.uint8
    attend_rows(_dev(res), _dev(query.float().contiguous()), _dev(key_cache.data.view(u8)), _dev(key_cache.scale),
                _dev(value_cache.data.view(u8)), _dev(value_cache.scale), _table(key_cache.fmt, TABLES[key_cache.fmt]),
                _dev(block_tables.to(torch.int32).contiguous()), cuda.to_device(np.ascontiguousarray(seqs, np.int64)),
                cuda.to_device(np.ascontiguousarray(lens, np.int64)), scale, window, softcap)
    out.copy_(res)


def torch_paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                                 window: int = 0, softcap: float = 0.0) -> None:
    lens = context_lens.cpu().numpy().astype(np.int64)
    if len(lens):
        _torch_rows(out, query, key_cache, value_cache, block_tables, np.arange(len(lens)), lens, scale, window,
                    softcap)


def torch_paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                  scale, window: int = 0, softcap: float = 0.0) -> None:
    seqs, lens = prefill_rows(query_start_loc.cpu().numpy(), context_lens.cpu().numpy())
    if len(lens):
        _torch_rows(out, query, key_cache, value_cache, block_tables, seqs, lens, scale, window, softcap)
