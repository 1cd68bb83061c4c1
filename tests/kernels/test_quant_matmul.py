"""GGUF quantized weights: the torch reference (``kernels/quant_reference.py``) dequantizes every
served type as the ``gguf`` package does, and the Numba kernels (``kernels/cpu/quant_matmul.py``)
equal the reference's matmul within float32 rounding, at odd shapes, decode rows and prefill rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from kernels.cpu.quant_matmul import PREFILL_ROWS, dequantize_rows, pack, quant_matmul
from kernels.quant_reference import quant_matmul as reference_matmul
from kernels.quant_reference import dequantize
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
@pytest.mark.parametrize("rows", [1, 3, PREFILL_ROWS + 5])
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
