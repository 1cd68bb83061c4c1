"""``--linear-kernel``: oneDNN-packed weights (services/executor/linear.py) multiply like
``nn.Linear`` up to float rounding, replace every linear layer, and are chosen only where they run
(the Numba kernel's own tests: tests/kernels/test_cpu_matmul.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.executor.linear import PackedLinear, choose_linear_kernel, onednn_supported, pack_linears
from shared.cpu_features import CpuFeatures

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_supported(CPU, torch.float32), reason="torch without oneDNN here")


@needs_onednn
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(dtype, tol, rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        expected, got = linear(x), PackedLinear(linear)(x)
    assert got.shape == expected.shape and got.dtype == dtype
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= tol * max(scale, 1.0)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_the_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Sequential(nn.Linear(64, 64, bias=False)), nn.Linear(64, 8))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        expected = model(x)
        assert pack_linears(model) == 3
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.allclose(got, expected, atol=1e-5)


def test_which_kernel_runs():
    avx2 = CpuFeatures("test CPU", frozenset({"avx2"}), "AVX2", None, None)  # auto's bf16 here: oneDNN
    onednn_bf16 = "onednn" if onednn_supported(CPU, torch.bfloat16) else "torch"
    assert choose_linear_kernel("torch", CPU, torch.float32) == "torch"
    assert choose_linear_kernel("torch", CPU, torch.bfloat16) == "torch"
    assert choose_linear_kernel("auto", CPU, torch.float16) == "torch"  # oneDNN packing only for fp32 and bf16
    assert choose_linear_kernel("auto", torch.device("meta"), torch.float32) == "torch"  # not a CPU
    assert choose_linear_kernel("auto", CPU, torch.float32) == "torch"  # float32 stays token-identical to transformers
    assert choose_linear_kernel("auto", CPU, torch.bfloat16, avx2) == onednn_bf16
    if onednn_supported(CPU, torch.float32):
        assert choose_linear_kernel("onednn", CPU, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="--linear-kernel onednn needs a CPU"):
        choose_linear_kernel("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="--linear-kernel must be one of auto, onednn, numba, torch, got 'fast'"):
        choose_linear_kernel("fast", CPU, torch.float32)
