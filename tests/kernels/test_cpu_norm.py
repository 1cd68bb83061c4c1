"""The fused residual add + RMS norm (kernels/cpu/norm.py, behind ``RMSNorm`` on CPU) against the
torch form of Hugging Face's ``LlamaRMSNorm``: the residual sum bit for bit, the norm equal in
bfloat16 and within a few float32 ulp in float32 (the sum of squares runs in another order)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import NumbaCPUBackend
from kernels.cpu.norm import PARALLEL_FROM_ROWS
from services.executor.layers import RMSNorm

BACKEND = NumbaCPUBackend()


def torch_form(weight, residual, eps):
    x = residual.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(residual.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 64, 300, PARALLEL_FROM_ROWS + 5])  # the last: the parallel kernel
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_add_norm_equals_torch(dtype, num_tokens, with_delta):
    g = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=g).to(dtype)
    residual = (3 * torch.randn(num_tokens, 576, generator=g)).to(dtype)
    delta = torch.randn(num_tokens, 576, generator=g).to(dtype) if with_delta else residual[:0]
    want_residual = residual + delta if with_delta else residual.clone()
    want = torch_form(norm.weight, want_residual, 1e-5)
    with torch.inference_mode():
        got, stream = norm(delta, residual, BACKEND)
        assert BACKEND.add_rms_norm(residual.clone(), delta, norm.weight, 1e-5) is not None  # the kernel ran
    assert stream is residual and torch.equal(residual, want_residual)  # summed in place, exactly
    if dtype == torch.bfloat16:
        # an ulp of the variance can move a rounding of the normalized value or of its product
        # with the weight by one bf16 step (2**-8 relative each), in a few elements only
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=4e-7)  # a few ulp (the variance's order)
    assert not torch.equal(got, torch_form(norm.weight, residual * 1.01, 1e-5))  # the test can fail


def test_float16_takes_the_torch_form():
    norm = RMSNorm(8, 1e-6).to(torch.float16)
    residual, delta = torch.randn(3, 8).half(), torch.randn(3, 8).half()
    want_residual = residual + delta
    with torch.inference_mode():
        assert BACKEND.add_rms_norm(residual, delta, norm.weight, 1e-6) is None  # float16: no kernel
        got, _ = norm(delta, residual, BACKEND)
    assert torch.equal(residual, want_residual)
    assert torch.equal(got, torch_form(norm.weight, want_residual, 1e-6))
