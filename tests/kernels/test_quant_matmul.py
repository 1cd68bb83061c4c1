"""GGUF quantized weights: the torch reference (``kernels/quant_reference.py``) dequantizes every
served type as the ``gguf`` package does, and the Numba kernels (``kernels/cpu/quant_matmul.py``)
equal the reference's matmul within float32 rounding, at odd shapes, decode rows and prefill rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from kernels.cpu.quant_matmul import PREFILL_ROWS, Int4Pack, dequantize_rows, int4_supported, pack, quant_matmul
from kernels.quant_reference import quant_matmul as reference_matmul
from kernels.quant_reference import FOUR_BIT, decompose, dequantize
from tests.doubles.gguf_blocks import SERVED, random_quantized

# odd output rows; inputs a few blocks (32 for the simple types, 256 for the K types)
SHAPES = {"Q8_0": (37, 96), "Q4_0": (37, 160), "Q4_1": (53, 96), "Q4_K": (37, 512), "Q6_K": (29, 768)}


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_reference_dequantizes_as_the_gguf_package(qtype):
    raw = random_quantized(qtype, *SHAPES[qtype.name], seed=1)
    got = dequantize(torch.from_numpy(raw), int(qtype)).numpy()
    want = gguf_dequantize(raw, qtype)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 11])  # both forms' Numba pass and tiles (PREFILL_ROWS)
def test_kernel_equals_reference(qtype, rows):
    raw = torch.from_numpy(random_quantized(qtype, *SHAPES[qtype.name], seed=2))
    x = torch.randn(rows, SHAPES[qtype.name][1], generator=torch.Generator().manual_seed(rows))
    want = reference_matmul(x, raw, int(qtype))
    got = quant_matmul(x, pack(raw, int(qtype)))
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", SERVED, ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(qtype):
    raw = torch.from_numpy(random_quantized(qtype, *SHAPES[qtype.name], seed=3))
    ids = np.array([5, 0, 5, SHAPES[qtype.name][0] - 1], dtype=np.int64)
    got = dequantize_rows(pack(raw, int(qtype)), ids)
    torch.testing.assert_close(got, dequantize(raw, int(qtype))[torch.from_numpy(ids)], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [t for t in SERVED if t.name in FOUR_BIT], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7])
def test_torch_int4_kernel_equals_the_reference_with_bf16_scales(qtype, rows):
    """The bfloat16 path: the same 4-bit values; its ``(scale, zero)`` pairs are bfloat16, so the
    reference is the decomposed weight with those pairs rounded so, and the output bfloat16."""
    raw = torch.from_numpy(random_quantized(qtype, 48, SHAPES[qtype.name][1], seed=4))
    p = pack(raw, int(qtype))
    assert int4_supported(p)
    d = decompose(raw, int(qtype))
    scale = d.scale.bfloat16().float().unsqueeze(-1)
    zero = (d.minv + 8 * d.scale).bfloat16().float().unsqueeze(-1)
    w = ((d.q.float().reshape(48, -1, 32) - 8) * scale + zero).reshape(48, -1)
    x = torch.randn(rows, w.shape[1]).bfloat16()
    got = quant_matmul(x, Int4Pack(p))
    assert got.dtype == torch.bfloat16
    want = x.float() @ w.T
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
