"""Quantized KV cache blocks (``--kv-cache-dtype int8|fp8_e4m3``): the formats, the pool's
layout, and the PyTorch reference forms of the write, the paged attentions and the block moves
over them (the oracle the Numba CPU and CUDA forms are tested against).

Layout: one layer's keys (or values) are a ``QuantCache``: ``data`` ``[num_blocks, num_kv_heads,
block_size, head_dim]`` of one byte per element (``int8`` for int8; ``uint8`` holding
``float8_e4m3fn`` bits for fp8_e4m3, since numba has no float8 type and torch's float8 tensors
cannot be indexed on every device) and ``scale`` ``[num_blocks, num_kv_heads, block_size]``
float32, one per (token, KV head), in the same block layout: a block's scales move with its bytes
(copy-on-write, swaps), and a token's scale is set once, when it is written, so appending to a
partial block or sharing a full one never rescales the tokens before it.

Quantization of a (token, head) row ``x`` (float32, ``head_dim`` values), every form the same bits:
``scale = max|x| / QMAX`` (float32 division; ``QMAX`` 127 for int8, 448 for e4m3, its largest
finite value), ``q = x / scale`` (0 where ``scale`` is 0), then int8: ``round`` half to even,
clamped to [-127, 127]; fp8: clamped to [-448, 448] and rounded to nearest even by torch's
``float8_e4m3fn`` cast. Dequantized value: ``decode(q) * scale``. Error bounds: int8
``|x - x'| <= scale / 2``; fp8 the cast's (3 mantissa bits: half an ulp of ``q``, times ``scale``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import reference

KV_CACHE_DTYPES = ("int8", "fp8_e4m3")  # quantized formats; "auto" is the model's dtype, unquantized
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
SCALE_BYTES = 4  # float32, one per (token, KV head)


@dataclass
class QuantCache:
    """One layer's quantized keys or values (see the module's docstring)."""

    data: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim] int8 / uint8 (e4m3 bits)
    scale: torch.Tensor  # [num_blocks, num_kv_heads, block_size] float32
    fmt: str  # "int8" or "fp8_e4m3"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    @classmethod
    def zeros(cls, shape, fmt: str, device) -> "QuantCache":
        return cls(torch.zeros(shape, dtype=STORAGE[fmt], device=device),
                   torch.zeros(shape[:3], dtype=torch.float32, device=device), fmt)


def e4m3_table() -> np.ndarray:
    """The float32 value of each of the 256 ``float8_e4m3fn`` bit patterns, decoded from the bits
    (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 subnormal; 0x7F and 0xFF NaN,
    no infinities). Numba's kernels read fp8 through it (tested against torch's own cast)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


def byte_table(fmt: str) -> np.ndarray:
    """float32 of each byte value 0..255 as the kernels read it: int8's two's complement, or e4m3."""
    if fmt == "int8":
        return np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
    return e4m3_table()


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (bytes ``[..., head_dim]`` in ``STORAGE[fmt]``, scales ``[...]``
    float32), one scale per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX[fmt]
    q = torch.where(scale[..., None] > 0, x / scale[..., None], torch.zeros((), device=x.device))
    if fmt == "int8":
        return torch.round(q).clamp(-127, 127).to(torch.int8), scale
    return q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of ``data`` ``[..., head_dim]`` with its row scales ``[...]``."""
    values = data.float() if fmt == "int8" else data.view(torch.float8_e4m3fn).float()
    return values * scale[..., None]


def write_kv_cache(key_cache: QuantCache, value_cache: QuantCache, key: torch.Tensor,
                   value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``reference.write_kv_cache`` into quantized caches: each (token, head) quantized with its
    own scale; negative slots are padding and are skipped."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x in ((key_cache, key), (value_cache, value)):
        q, s = quantize(x[keep], cache.fmt)
        cache.data[blocks, :, offsets] = q
        cache.scale[blocks, :, offsets] = s


def _compact(key_cache: QuantCache, value_cache: QuantCache, block_tables: torch.Tensor):
    """The blocks ``block_tables`` names, dequantized into a float32 pool of their own, and the
    tables renumbered into it (garbage entries, -1 or stale, become some block never read)."""
    used = block_tables.long().clamp(min=0)
    ids, inverse = torch.unique(used, return_inverse=True)
    pools = [dequantize(c.data[ids], c.scale[ids], c.fmt) for c in (key_cache, value_cache)]
    return pools[0], pools[1], inverse.to(torch.int32).reshape(block_tables.shape)


def paged_decode_attention(out, query, key_cache: QuantCache, value_cache: QuantCache, block_tables,
                           context_lens, scale: float, window: int = 0, softcap: float = 0.0) -> None:
    """``reference.paged_decode_attention`` reading the quantized caches, dequantized."""
    if query.shape[0] == 0:
        return
    keys, values, tables = _compact(key_cache, value_cache, block_tables)
    reference.paged_decode_attention(out, query, keys, values, tables, context_lens, scale, window, softcap)


def paged_prefill_attention(out, query, key_cache: QuantCache, value_cache: QuantCache, block_tables,
                            query_start_loc, context_lens, scale: float, window: int = 0,
                            softcap: float = 0.0) -> None:
    """``reference.paged_prefill_attention`` reading the quantized caches, dequantized."""
    if query.shape[0] == 0 or block_tables.shape[0] == 0:
        return
    keys, values, tables = _compact(key_cache, value_cache, block_tables)
    reference.paged_prefill_attention(out, query, keys, values, tables, query_start_loc, context_lens,
                                      scale, window, softcap)


def copy_blocks(key_caches: list[QuantCache], value_caches: list[QuantCache], block_mapping) -> None:
    """Copy whole blocks, bytes and scales, inside each layer's pools (copy-on-write)."""
    caches = [*key_caches, *value_caches]
    reference.copy_blocks([c.data for c in caches], [c.scale for c in caches], block_mapping)


def swap_blocks(dst: QuantCache, src: QuantCache, block_mapping) -> None:
    """Move whole blocks, bytes and scales, between the device pool and the CPU swap pool."""
    if dst.fmt != src.fmt:
        raise TypeError(f"swap_blocks: both pools must have one format, got {dst.fmt} and {src.fmt}")
    reference.swap_blocks(dst.data, src.data, block_mapping)
    reference.swap_blocks(dst.scale, src.scale, block_mapping)
