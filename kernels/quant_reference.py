"""GGUF's quantized blocks in PyTorch: what the quantized matmul kernels (``kernels/cpu/quant_matmul.py``)
must compute, written plainly from llama.cpp's block layouts (``ggml-common.h``; the tests check it
against the ``gguf`` package's own ``gguf.quants.dequantize``).

A quantized weight ``[out, in]`` is stored as ``raw``: ``uint8 [out, in / block * block_bytes]``,
each row its blocks in order (GGUF's blocks run along the input dimension, so rows can be sliced,
permuted and concatenated without touching a block).

Every type served here is decomposed into one of two forms, ``w = scale * q + minv`` per group of
inputs:

- 4-bit (Q4_0, Q4_1, Q4_K): ``q`` in 0..15, groups of 32, ``scale`` and ``minv`` per group
  (Q4_0: ``minv = -8 d``; Q4_K: ``scale = d * sc``, ``minv = -dmin * m`` of its 6-bit sub-scales);
- 8-bit (Q8_0, Q6_K): ``q`` a signed int8 (Q6_K's 6 bits less 32), groups of 32 (Q8_0) or 16
  (Q6_K), ``scale`` per group, no ``minv``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# GGML type id -> (name, elements per block, bytes per block)
TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144),
         14: ("Q6_K", 256, 210)}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


class Decomposed(NamedTuple):
    q: torch.Tensor  # [out, in]: uint8 0..15 (4-bit form) or int8 (8-bit form)
    scale: torch.Tensor  # [out, in / group] float32
    minv: torch.Tensor | None  # [out, in / group] float32 (4-bit form), None (8-bit form)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]


def type_name(ggml_type: int) -> str:
    return TYPES[ggml_type][0]


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:  # [out, row bytes] -> [out, nb, bytes]
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(b: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32 (little-endian half)
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:  # [..., 16] -> [..., 32]: low nibbles, then high
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles_32(b[..., 2:18]), d, -8.0 * d


def _q4_1(b):
    return _nibbles_32(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q8_0(b):
    return b[..., 2:34].contiguous().view(torch.int8), _f16(b[..., 0:2]), None


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., 12] -> 8 scales, 8 mins
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k4_scales(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 elements: low nibbles, then high
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*b.shape[:-1], 256)
    return q, d.unsqueeze(-1) * sc, -(dmin.unsqueeze(-1) * m)


def _q6_k(b):
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64).to(torch.int32)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32).to(torch.int32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210])
    lo = torch.cat([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1)
    hi = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
    q = ((lo | (hi << 4)) - 32).to(torch.int8).reshape(*b.shape[:-1], 256)
    return q, d.unsqueeze(-1) * sc, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decompose(raw: torch.Tensor, ggml_type: int) -> Decomposed:
    """``raw`` (uint8 ``[out, row bytes]``) of ``ggml_type`` as ``(q, scale, minv)`` (see above)."""
    name, block, nbytes = TYPES[ggml_type]
    b = _blocks(raw, nbytes)
    q, scale, minv = _DECODERS[name](b)
    rows = raw.shape[0]
    q = q.reshape(rows, -1)
    scale = scale.reshape(rows, -1).float()
    return Decomposed(q, scale, None if minv is None else minv.reshape(rows, -1).float())


def combine(d: Decomposed) -> torch.Tensor:
    """The float32 weight ``[out, in]`` of a decomposed one."""
    g = d.group
    w = d.q.float().reshape(d.q.shape[0], -1, g) * d.scale.unsqueeze(-1)
    if d.minv is not None:
        w = w + d.minv.unsqueeze(-1)
    return w.reshape(d.q.shape)


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that ``raw``'s blocks hold."""
    return combine(decompose(raw, ggml_type))


def quant_matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``x @ W.T`` in float32 for the quantized ``W``: the oracle of the kernels."""
    return x.float() @ dequantize(raw, ggml_type).T
