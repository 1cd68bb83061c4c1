"""The fused SiLU(gate) * up (kernels/cpu/activation.py, behind ``MLP`` on CPU) against torch's
``silu`` and ``mul``: bfloat16 bit for bit, float16 within an ulp of ``silu`` (a few elements),
float32 within a few ulp; and the MLP's float32 exactness mode runs torch's ops, bit for bit
those of transformers' ``LlamaMLP``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cpu import NumbaCPUBackend
from kernels.cpu.activation import PARALLEL_FROM_ROWS, silu_mul_
from services.executor.layers import MLP
from services.executor.linear import PackedLinear, onednn_supported
from services.executor.parallel.base import SingleRank
from services.executor.parallel.sharding import ShardPlan

BACKEND = NumbaCPUBackend()
F = nn.functional


def torch_form(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.contiguous()) * up


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place (same-sign values; a sign change counts as large)."""
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    return (got.view(bits).long() - want.view(bits).long()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, PARALLEL_FROM_ROWS + 3])  # serial and parallel rows
@pytest.mark.parametrize("num_columns", [1536, 37])  # SmolLM2's I, and a ragged one
def test_silu_mul_equals_torch(dtype, num_tokens, num_columns):
    g = torch.Generator().manual_seed(num_tokens * num_columns)
    gate_up = (4 * torch.randn(num_tokens, 2 * num_columns, generator=g)).to(dtype)
    got = BACKEND.silu_mul(gate_up)
    want = torch_form(gate_up)
    assert got is not None and got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    distance = ulps(got, want)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    elif dtype == torch.float16:
        # an ulp of silu where its float32 value lies next to a rounding boundary, times up
        assert distance.max() <= 2 and (distance > 0).float().mean() < 1e-3
    else:
        assert distance.max() <= 4  # exponentials of another order of accuracy (SLEEF's vs ours)
    assert not torch.equal(got, torch_form(gate_up * 1.01))  # the comparison can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_edge_values(dtype):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 60.0, -60.0, 1e4, -1e4, -87.5, -90.0, -87.0,
                         float("inf"), -float("inf"), float("nan")])
    up = torch.full_like(gate, 1.5)
    gate_up = torch.cat([gate, up]).view(1, -1).to(dtype)
    got, want = silu_mul_(gate_up), torch_form(gate_up)
    finite = ~want.isnan()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[finite].signbit(), want[finite].signbit())
    if dtype == torch.float16:  # silu(-87.5) is 0 in float16 too
        assert torch.equal(got[finite], want[finite])
    else:
        # -90: torch's silu overflows exp(90) to inf and gives -0, as ours; -87.5: ours is -0 (below
        # exp_nonpositive's floor), torch's about -1e-36; -87: both about -1e-36
        assert got[0, 10] == 0 and abs(want[0, 10].float()) < 1e-35
        keep = finite.clone()
        keep[0, 10] = False
        assert (ulps(got[keep], want[keep]) <= (4 if dtype == torch.float32 else 0)).all()


def test_silu_mul_rejects_a_wrong_shape_and_leaves_strided_input_to_torch():
    import numpy as np

    from kernels.cpu.activation import silu_mul

    with pytest.raises(ValueError, match=r"needs gate_up of \[2, 8\], got \(2, 7\)"):
        silu_mul(np.zeros((2, 4), np.float32), np.zeros((2, 7), np.float32))
    strided = torch.randn(3, 16)[:, ::2]
    assert BACKEND.silu_mul(strided) is None
    assert BACKEND.silu_mul(torch.randn(3, 8, dtype=torch.float64)) is None


def mlp_and_hf(dtype: torch.dtype, num_columns: int = 40, hidden: int = 24):
    """Our MLP and transformers' ``LlamaMLP`` with the same weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from services.executor.architectures import model_config

    torch.manual_seed(num_columns)
    hf_cfg = LlamaConfig(hidden_size=hidden, intermediate_size=num_columns, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=16)
    hf = LlamaMLP(hf_cfg).to(dtype).eval()
    cfg = model_config(hf_cfg)
    ours = MLP(cfg, ShardPlan.for_model(cfg), SingleRank()).to(dtype)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([hf.gate_proj.weight, hf.up_proj.weight]))
        ours.down_proj.weight.copy_(hf.down_proj.weight)
    return ours, hf


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_float32_on_nn_linear_is_transformers_bit_for_bit(num_tokens):
    # 37 columns: a ragged shape, where the fused matmul sums in another order than the two
    # separate ones at a few rows, and torch's silu has a scalar tail
    ours, hf = mlp_and_hf(torch.float32, num_columns=37)
    x = torch.randn(num_tokens, 24)
    with torch.inference_mode():
        got, want = ours(x, BACKEND), hf(x)
        gate_up = ours.gate_up_proj(x)
    assert torch.equal(got, want)
    assert not torch.equal(BACKEND.silu_mul(gate_up), torch_form(gate_up))  # the kernel would not have been


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_runs_in_bfloat16_and_on_packed_weights(dtype):
    if dtype == torch.float32 and not onednn_supported(torch.device("cpu"), dtype):
        pytest.skip("torch without oneDNN here: float32 has no packed weights")
    ours, hf = mlp_and_hf(dtype, num_columns=1536, hidden=64)
    if dtype == torch.float32:
        ours.gate_up_proj = PackedLinear(ours.gate_up_proj)
    x = torch.randn(64, 64).to(dtype)
    with torch.inference_mode():
        gate_up = ours.gate_up_proj(x)
        got = ours.activation(gate_up, BACKEND)
        assert torch.equal(got, BACKEND.silu_mul(gate_up))  # the kernel's result
        if dtype == torch.float32:
            assert not torch.equal(got, torch_form(gate_up))  # not torch's
        out, want = ours(x, BACKEND).float(), hf(x).float()
    torch.testing.assert_close(out, want, rtol=0.05, atol=0.05 * want.abs().max().item())
