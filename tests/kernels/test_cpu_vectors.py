"""The register-vector pieces of the Numba CPU attention kernels (kernels/cpu/vectors.py,
kernels/cpu/tiles.py) on their own, and the decode kernel on the shapes and targets that take
their other paths: head dims whose partial sums are narrower than 16 lanes or that ``vdpbf16ps``
cannot take, a float32 query over a bfloat16 cache, and a CPU without AVX-512 (compiled for
Haswell: AVX2, in a subprocess, since numba's target is fixed per process).

Tolerances: the tree sums and the softmax step against float64 numpy: float32 rounding of sums of
16-32 terms (rtol 1e-5); the vector ``exp`` is ``common.exp_nonpositive``'s polynomial (within 3
ulp of libm's, checked in test_kernels_cpu), so 1e-6. Kernel outputs as in test_kernels_cpu /
test_kernels_cpu_16bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from numba import njit

from kernels import cpu, reference
from kernels.cpu.tiles import tile_scores, tile_softmax
from kernels.cpu.vectors import TILE, GroupShape, partial_lanes, query_operand
from tests.kernels.test_cpu_attention import ATOL, RTOL, _lens_for, _make_cache
from tests.kernels.test_cpu_16bit import OUT_RTOL, _bits


@njit
def _scores(partial, query, shape):
    qv = query_operand(query, 0, shape, query)
    out = np.empty(shape.rows * TILE, np.float32)
    tile_scores(out, partial, qv)
    return out


@pytest.mark.parametrize("head_dim,lanes", [(64, 16), (80, 16), (40, 8), (12, 4), (6, 2), (3, 1)])
def test_tile_scores_sums_each_keys_lanes(head_dim, lanes):
    """Lane t of a row's scores is the sum of key t's partial dot products, whatever their width."""
    assert partial_lanes(head_dim) == lanes
    group = 3
    rng = np.random.default_rng(head_dim)
    partial = rng.standard_normal((group, TILE, lanes)).astype(np.float32)
    query = np.zeros((group, head_dim), np.float32)  # only its type matters here
    got = _scores(partial.reshape(-1), query.reshape(-1), GroupShape(group, head_dim))
    np.testing.assert_allclose(got.reshape(group, TILE), partial.astype(np.float64).sum(-1),
                               rtol=1e-5, atol=1e-5)


@njit
def _softmax_step(scores, m, l, alpha, n, scale, query, shape):
    qv = query_operand(query, 0, shape, query)
    tile_softmax(scores, m, l, alpha, n, np.float32(scale), qv)


@pytest.mark.parametrize("n", [1, 7, 16])
def test_tile_softmax_step_matches_float64(n):
    """Two steps of the online softmax on 3 rows: masked lanes give 0, the first step's factors
    are 0 (max -inf), the second's rescale by the moved max, and the per-lane sums follow."""
    group, head_dim, scale = 3, 64, 0.125
    rng = np.random.default_rng(n)
    shape = GroupShape(group, head_dim)
    query = np.zeros(group * head_dim, np.float32)
    m = np.full(group, -np.inf, np.float32)
    l = np.zeros(group * TILE, np.float32)
    alpha = np.empty(group, np.float32)
    want_m = np.full(group, -np.inf)
    want_l = np.zeros((group, TILE))
    for step in range(2):
        raw = (rng.standard_normal((group, TILE)) * (8 + 16 * step)).astype(np.float32)
        scores = raw.reshape(-1).copy()
        _softmax_step(scores, m, l, alpha, n, scale, query, shape)
        s = raw[:, :n].astype(np.float64) * scale
        new_m = np.maximum(want_m, s.max(axis=1))
        want_alpha = np.exp(want_m - new_m)
        want_p = np.zeros((group, TILE))
        want_p[:, :n] = np.exp(s - new_m[:, None])
        want_l = want_l * want_alpha[:, None] + want_p
        want_m = new_m
        np.testing.assert_allclose(alpha, want_alpha, rtol=1e-6, atol=0)
        np.testing.assert_allclose(scores.reshape(group, TILE), want_p, rtol=1e-6, atol=1e-30)
        np.testing.assert_allclose(m, want_m, rtol=0, atol=0)
        np.testing.assert_allclose(l.reshape(group, TILE), want_l, rtol=1e-6, atol=1e-30)
    assert (scores.reshape(group, TILE)[:, n:] == 0).all()


def _decode(dtype, query_dtype, num_heads, num_kv_heads, head_dim, seed):
    lens = _lens_for(16)
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, head_dim, 16, seed)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype).to(query_dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    expected = torch.empty(query.shape)
    reference.paged_decode_attention(expected, query.float(), key_cache.float(),
                                     value_cache.float(), tables, context_lens, scale)
    out = torch.full(query.shape, float("nan"), dtype=query_dtype)
    cpu.paged_decode_attention(*_bits(out, query, key_cache, value_cache), tables.numpy(),
                               context_lens.numpy(), scale, partition_size=0)
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [40, 80, 96])  # 8-lane partials; not a multiple of 32; 3 x 32
def test_decode_head_dims_off_the_fast_path(dtype, head_dim):
    out, expected = _decode(dtype, dtype, 9, 3, head_dim, seed=21)
    torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=OUT_RTOL[dtype])


def test_decode_float32_query_over_bf16_cache():
    """A float32 query keeps its precision: the keys are widened and multiplied in float32 (no
    vdpbf16ps, which would round the query to bfloat16)."""
    out, expected = _decode(torch.bfloat16, torch.float32, 9, 3, 64, seed=22)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


_AVX2_SCRIPT = textwrap.dedent("""
    import torch
    from kernels.cpu import vectors
    from tests.kernels.test_cpu_vectors import _decode
    from tests.kernels.test_cpu_16bit import OUT_RTOL
    from tests.kernels.test_cpu_attention import ATOL
    assert not vectors.DOT_BF16, vectors.target_features()
    for dtype in (torch.bfloat16, torch.float32):
        out, expected = _decode(dtype, dtype, 9, 3, 64, seed=23)
        torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=OUT_RTOL[dtype])
    print("ok")
""")


@pytest.mark.slow  # compiles the kernels again for another target
def test_decode_compiles_and_matches_on_an_avx2_target(tmp_path):
    """Compiled for Haswell (AVX2, no AVX-512, no BF16), the kernels take the widening paths and
    still match the reference: what a machine without AVX-512 BF16 runs."""
    features = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+sse4.1,+ssse3,+cx16,+movbe"
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
