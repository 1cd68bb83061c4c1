"""The Numba bfloat16 matmul (kernels/cpu/matmul.py) against float32 arithmetic on the same
bfloat16 values, on both of its code paths (``vdpbf16ps`` where numba compiles for AVX-512 BF16,
widened pairs and FMAs elsewhere), and ``--linear-kernel numba`` in the model's linear layers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from kernels.cpu import vectors
from kernels.cpu.matmul import ROW_BLOCK, ROW_CHUNK, TILE_COLUMNS, matmul_bf16, pack_pairs, pad_bias
from services.executor.linear import (
    PackedLinear, PairLinear, choose_linear_kernel, linear_kernel_name, onednn_supported, pack_linears,
)
from shared.cpu_features import CpuFeatures

CPU = torch.device("cpu")


def _case(rows, in_f, out_f, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g) if bias else None
    return x, w, b


def _reference(x, w, b):
    """float64 sums of the bfloat16 values' products: the kernel's float32 sums differ from it by
    float32 rounding only, before the result's one rounding to bfloat16."""
    ref = x.double() @ w.double().T
    return ref if b is None else ref + b.double()


def assert_matches(got, x, w, b):
    ref = _reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = (got.double() - ref).abs()
    # half a bfloat16 step of the value (the final rounding) plus float32 summation error
    bound = ref.abs() * 2.0 ** -8 + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, ROW_CHUNK, 7, 13, ROW_BLOCK, ROW_BLOCK + 1, 200])
@pytest.mark.parametrize(("in_f", "out_f"), [(64, 64), (96, 200), (576, 960), (2, 1), (130, 65)])
def test_matmul_matches_float_arithmetic_on_the_same_values(rows, in_f, out_f):
    x, w, b = _case(rows, in_f, out_f, bias=(rows % 2 == 1), seed=rows * 1000 + out_f)
    packed = pack_pairs(w)
    assert packed.shape == (-(-out_f // TILE_COLUMNS), in_f // 2, 2 * TILE_COLUMNS)
    assert_matches(matmul_bf16(x, packed, out_f, pad_bias(b, packed)), x, w, b)


def test_leading_dims_strided_input_and_no_rows():
    x, w, b = _case(12, 128, 192, bias=True, seed=5)
    packed = pack_pairs(w)
    bias = pad_bias(b, packed)
    got = matmul_bf16(x.view(3, 4, 128), packed, 192, bias)
    assert got.shape == (3, 4, 192)
    assert_matches(got.reshape(12, 192), x, w, b)
    wide = torch.cat([x, x], dim=1)[:, ::2]  # a strided view: the kernel copies it first
    assert not wide.is_contiguous()
    assert_matches(matmul_bf16(wide, packed, 192, bias), wide.contiguous(), w, b)
    assert matmul_bf16(x[:0], packed, 192, bias).shape == (0, 192)


def test_results_do_not_depend_on_the_thread_count():
    x, w, b = _case(70, 256, 640, bias=False, seed=9)
    packed = pack_pairs(w)
    bias = pad_bias(None, packed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matmul_bf16(x, packed, 640, bias)
        torch.set_num_threads(max(2, before))
        many = matmul_bf16(x, packed, 640, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.view(torch.int16), many.view(torch.int16))


def test_rounding_and_nan_as_torch():
    # one input pair, one column: x = [a, 0], w = [1, 0]: the output is a's sum with the bias,
    # rounded once to bfloat16 (to nearest even) as torch rounds float32, NaN as torch's 0xFFFF
    values = torch.tensor([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, float("nan")])
    x = torch.zeros(len(values), 2, dtype=torch.bfloat16)
    x[:, 0] = values.bfloat16()
    w = torch.zeros(64, 2, dtype=torch.bfloat16)
    w[:, 0] = 1.0
    bias = torch.full((64,), 2 ** -9)
    packed = pack_pairs(w)
    got = matmul_bf16(x, packed, 64, pad_bias(bias, packed))
    expected = (x.float()[:, :1] + bias).bfloat16().expand(-1, 64)
    assert torch.equal(got[:4].view(torch.int16), expected[:4].view(torch.int16))
    assert bool((got[4].view(torch.uint16).int() == 0xFFFF).all())


def test_pack_pairs_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="even number of input features"):
        pack_pairs(torch.zeros(8, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        pack_pairs(torch.zeros(8, 4))
    packed = pack_pairs(torch.zeros(8, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        matmul_bf16(torch.zeros(1, 6, dtype=torch.bfloat16), packed, 8, pad_bias(None, packed))


_AVX2_SCRIPT = textwrap.dedent("""
    from kernels.cpu import vectors
    assert not vectors.DOT_BF16, vectors.target_features()
    from tests.kernels.test_cpu_matmul import _case, assert_matches
    from kernels.cpu.matmul import matmul_bf16, pack_pairs, pad_bias
    for rows, in_f, out_f in [(1, 576, 960), (13, 130, 65), (200, 96, 200)]:
        x, w, b = _case(rows, in_f, out_f, bias=True, seed=rows)
        packed = pack_pairs(w)
        assert_matches(matmul_bf16(x, packed, out_f, pad_bias(b, packed)), x, w, b)
    print("ok")
""")


@pytest.mark.slow  # compiles the kernels again for another target
def test_matmul_compiles_and_matches_on_an_avx2_target(tmp_path):
    """Compiled for Haswell (no AVX-512 BF16), the kernel widens the pairs and multiplies them with
    FMAs; the same bound holds."""
    features = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+sse4.1,+ssse3,+cx16,+movbe"
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_pair_linear_replaces_nn_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 100, bias=False), nn.Linear(100, 7),
                          nn.Linear(5, 4)).to(torch.bfloat16)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model[:4](x)
        assert pack_linears(model, "numba") == 3  # the last one (5 inputs: no pairs) stays
        got = model[:4](x)
    assert [type(m) for m in model] == [PairLinear, nn.SiLU, PairLinear, PairLinear, nn.Linear]
    assert linear_kernel_name(model) == "numba"
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)


def _features(flags, amx_permitted=None):
    return CpuFeatures("test CPU", frozenset(flags), "AVX512", None, None, amx_permitted)


ZEN4 = _features({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
SAPPHIRE_RAPIDS = _features({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}, True)


def test_which_kernel_auto_chooses(monkeypatch):
    bf16, fp32 = torch.bfloat16, torch.float32
    onednn = "onednn" if onednn_supported(CPU, bf16) else "torch"
    monkeypatch.setattr(vectors, "DOT_BF16", True)
    assert choose_linear_kernel("auto", CPU, bf16, ZEN4) == "numba"  # AVX-512 BF16, no AMX
    assert choose_linear_kernel("auto", CPU, bf16, SAPPHIRE_RAPIDS) == onednn  # oneDNN on AMX tiles
    assert choose_linear_kernel("auto", CPU, bf16, _features({"avx2"})) == onednn
    assert choose_linear_kernel("auto", CPU, fp32, ZEN4) == "torch"  # float32: transformers' kernel
    assert choose_linear_kernel("auto", torch.device("meta"), bf16, ZEN4) == "torch"
    monkeypatch.setattr(vectors, "DOT_BF16", False)  # numba not compiling for AVX-512 BF16
    assert choose_linear_kernel("auto", CPU, bf16, ZEN4) == onednn
    assert choose_linear_kernel("numba", CPU, bf16, _features({"avx2"})) == "numba"  # asked for: runs
    with pytest.raises(ValueError, match="--linear-kernel numba needs a CPU and bfloat16"):
        choose_linear_kernel("numba", CPU, fp32)
    with pytest.raises(ValueError, match="must be one of auto, onednn, numba, torch"):
        choose_linear_kernel("fast", CPU, bf16)


@pytest.mark.skipif(not onednn_supported(CPU, torch.bfloat16), reason="torch without oneDNN here")
def test_numba_and_onednn_agree_in_a_layer():
    torch.manual_seed(3)
    linear = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    x = torch.randn(37, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        ours, theirs = PairLinear(linear)(x), PackedLinear(linear)(x)
    # both sum the same exact products in float32 and round once: at most one bfloat16 step apart
    step = ours.float().abs().clamp_min(2.0 ** -120) * 2.0 ** -7
    assert bool(((ours.float() - theirs.float()).abs() <= step + 1e-6).all())
