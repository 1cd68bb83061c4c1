"""``--linear-kernel``: oneDNN-packed weights (services/executor/linear.py) multiply like
``nn.Linear`` up to float rounding, replace every linear layer, and are chosen only where they run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.executor.linear import PackedLinear, onednn_supported, pack_linears, use_onednn

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
    assert not use_onednn("torch", CPU, torch.float32)
    assert not use_onednn("auto", CPU, torch.float16)  # oneDNN packing here only for fp32 and bf16
    assert not use_onednn("auto", torch.device("meta"), torch.float32)  # not a CPU
    assert not use_onednn("auto", CPU, torch.float32)  # float32 stays token-identical to transformers
    assert use_onednn("auto", CPU, torch.bfloat16) == onednn_supported(CPU, torch.bfloat16)
    assert use_onednn("onednn", CPU, torch.float32) == onednn_supported(CPU, torch.float32)
    with pytest.raises(ValueError, match="--linear-kernel onednn needs a CPU"):
        use_onednn("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="--linear-kernel must be one of auto, onednn, torch, got 'fast'"):
        use_onednn("fast", CPU, torch.float32)
