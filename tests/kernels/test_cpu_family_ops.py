"""The Numba CPU kernels of the families' own elementwise steps against their torch forms
(``services/executor/layers.py``): Qwen3's and Gemma 3's query/key head norms in place on the fused
projection's output, and Gemma's GELU-tanh gated product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu import activation, norm
from services.executor.layers import HeadNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_head_rms_norm_equals_the_torch_form(dtype, rows):
    heads, kv_heads, dim = 6, 2, 16
    gen = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    q_norm, k_norm = HeadNorm(dim, 1e-6), HeadNorm(dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim, generator=gen))
        k_norm.weight.copy_(torch.randn(dim, generator=gen))
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    want = qkv.clone()
    q_norm.apply_(want[:, :heads * dim].view(rows, heads, dim))
    k_norm.apply_(want[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim))
    got = qkv.clone()
    norm.head_rms_norm_(got, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, heads, kv_heads)
    assert torch.equal(got[:, (heads + kv_heads) * dim:], qkv[:, (heads + kv_heads) * dim:])  # values untouched
    # the sum of squares runs in another order: an ulp of the variance, as add_rms_norm's
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    assert not torch.equal(got, qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_tanh_mul_equals_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(37, 2 * 96, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(96, dim=-1)
    want = nn.functional.gelu(gate, approximate="tanh") * up
    got = activation.gelu_tanh_mul_(gate_up)
    # tanh_f32 is within about 3e-7 of libm's tanh; times gate and up (up to ~16 each here), float32
    # products differ from torch's by up to ~2e-5 absolutely
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softcap_equals_torch_within_a_rounding(dtype):
    x = (torch.randn(9, 1000, generator=torch.Generator().manual_seed(5)) * 40).to(dtype)
    want = (torch.tanh(x.float() / 30.0) * 30.0).to(dtype)
    got = activation.softcap_(x.clone(), 30.0)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    assert got.abs().max() <= 30.0 and not torch.equal(got, x)
