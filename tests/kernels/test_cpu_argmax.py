"""Greedy sampling's argmax (kernels/cpu/argmax.py, behind ``Sampler`` on CPU) against
``torch.argmax``: the same index on random rows, ties, signed zeros, infinities and NaNs, in
float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cpu.argmax import CHUNK, argmax_, argmax_rows
from kernels.cpu.common import kernel_array

DTYPES = [torch.float32, torch.bfloat16]


def kernel(logits: torch.Tensor) -> torch.Tensor:
    out = np.full(logits.shape[0], -1, np.int64)
    argmax_rows(out, kernel_array(logits))
    return torch.from_numpy(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 64])
@pytest.mark.parametrize("size", [1, 7, CHUNK, CHUNK + 1, 49152])
def test_argmax_equals_torch_on_random_rows(dtype, num_rows, size):
    g = torch.Generator().manual_seed(num_rows * size)
    logits = (5 * torch.randn(num_rows, size, generator=g)).to(dtype)
    assert torch.equal(kernel(logits), torch.argmax(logits, dim=-1))
    assert torch.equal(argmax_(logits), torch.argmax(logits.float(), dim=-1))  # as its float32 cast's
    # rows whose maximum is repeated: quantized values, many ties
    coarse = torch.randint(-3, 4, (num_rows, size), generator=g).to(dtype)
    assert torch.equal(kernel(coarse), torch.argmax(coarse, dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_edge_values_as_torch(dtype):
    inf, nan = float("inf"), float("nan")
    rows = [
        [-inf] * 4,  # all -inf: index 0
        [-1.0, -0.0, 0.0, -2.0],  # -0.0 equals 0.0: the first one
        [-3.0, 0.0, -0.0, 0.0],
        [1.0, inf, 2.0, inf],  # the first +inf
        [1.0, nan, 5.0, nan],  # a NaN is larger than everything: the first NaN
        [inf, -nan, 1.0, 0.0],  # a NaN with the sign bit too
        [-5.0, -4.0, -4.0, -6.0],  # all negative, tied maximum
        [3e38, -3e38, 1e-40, -1e-40],  # large finite values, subnormals
    ]
    logits = torch.tensor(rows).to(dtype)
    logits[5, 1] = -logits[5, 1].abs()  # make sure that NaN has its sign bit set
    assert torch.equal(kernel(logits), torch.argmax(logits, dim=-1))
    assert kernel(logits).tolist() == [0, 1, 1, 1, 1, 1, 1, 0]
    # the same values far apart: the maximum and its tie in different chunks, a NaN in the last one
    wide = torch.full((3, 3 * CHUNK + 5), -1.0, dtype=dtype)
    wide[0, [CHUNK + 2, 2 * CHUNK + 9]] = 7.0
    wide[1, [CHUNK - 1, 3 * CHUNK + 4]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    wide[1, :CHUNK - 1] = -2.0
    wide[2, 3 * CHUNK + 1] = nan
    assert torch.equal(kernel(wide), torch.argmax(wide, dim=-1))
    assert kernel(wide).tolist() == [CHUNK + 2, CHUNK - 1, 3 * CHUNK + 1]


def test_the_torch_form_takes_every_tensor():
    logits = torch.randn(4, 100)
    assert torch.equal(argmax_(logits), torch.argmax(logits, dim=-1))
    # float64 and ints to torch.argmax; float16 widened and strided rows copied for the kernel
    for other in (logits.double(), (10 * logits).int(), logits.half(), logits[:, ::2], logits.bfloat16()[:, 3:],
                  logits[:0]):
        assert torch.equal(argmax_(other), torch.argmax(other, dim=-1))
    with pytest.raises(ValueError, match=r"logits \[N, V > 0\] and out \[N\], got \(2, 0\) and \(2,\)"):
        argmax_rows(np.zeros(2, np.int64), np.zeros((2, 0), np.float32))
    with pytest.raises(TypeError, match="float32 or bfloat16 bits .uint16., got float64"):
        argmax_rows(np.zeros(2, np.int64), np.zeros((2, 3), np.float64))
