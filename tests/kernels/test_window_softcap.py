"""Sliding windows and logit soft-capping in the paged-attention kernels.

The reference (``kernels/reference.py``) against an independent dense computation (each sequence's
keys and values kept contiguous beside the pools, an explicit mask, plain torch); the Numba CPU
kernels against the reference. Every case poisons the blocks that lie wholly before every query
row's window: their pool rows are NaN and their block-table entries -1, so an output that is
finite and right proves those blocks are never read.

The CUDA kernels' cases are in ``tests/kernels/test_cuda.py`` (the simulator runs in its own
invocation); they use ``make_case`` and ``dense_attention`` from here.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu, reference

ATOL, RTOL = 2e-5, 1e-4


def make_case(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, window, seed,
              dtype=torch.float32, query_scale=1.0, dropped=-1):
    """Pools, tables and queries for sequences of ``ctx_lens`` tokens whose last ``q_lens`` are
    queried (decode: all 1), plus the dense per-sequence K/V for ``dense_attention``. Blocks
    wholly before every row's window are NaN, their table entries ``dropped`` (-1 as the block
    manager writes; None: left pointing at the NaN blocks, for readers that would wrap a -1
    around, as numpy indexing does under the CUDA simulator)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(ctx_lens), max(needed) + 1), generator=g).to(torch.int32)
    dense = []
    used = 0
    for s, (n, q_len) in enumerate(zip(ctx_lens, q_lens)):
        ids = perm[used:used + needed[s]]
        used += needed[s]
        tables[s, :needed[s]] = ids
        k = key_cache[ids].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n].clone()
        v = value_cache[ids].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :n].clone()
        dense.append((k, v))
        first = max(0, n - q_len - window + 1) if window > 0 else 0  # the earliest row's window
        for b in range(first // block_size):  # wholly out of every row's window
            key_cache[ids[b]] = float("nan")
            value_cache[ids[b]] = float("nan")
            if dropped is not None:
                tables[s, b] = dropped
    total = sum(q_lens)
    query = (torch.randn(total, num_heads, head_dim, generator=g) * query_scale).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return key_cache, value_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), qsl, query, dense


def dense_attention(query, dense, ctx_lens, q_lens, scale, window, softcap):
    """Independent float64 attention, row by row with an explicit position mask."""
    out = torch.empty(query.shape, dtype=torch.float64)
    row = 0
    for (k, v), n, q_len in zip(dense, ctx_lens, q_lens):
        group = query.shape[1] // k.shape[0]
        k64, v64 = k.double(), v.double()
        for j in range(q_len):
            p = n - q_len + j
            pos = torch.arange(n)
            keep = pos <= p
            if window > 0:
                keep &= pos > p - window
            for h in range(query.shape[1]):
                scores = (k64[h // group] @ query[row, h].double()) * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                scores[~keep] = -math.inf
                out[row, h] = torch.softmax(scores, 0) @ v64[h // group]
            row += 1
    return out


# (ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size): decodes, prefills of whole
# prompts and chunks after a cached prefix, grouped-query heads
DECODE_SHAPES = [([40, 9, 23, 1], 4, 2, 32, 4), ([37, 16, 5], 3, 1, 64, 16)]
PREFILL_SHAPES = [([40, 9, 23], [12, 9, 5], 4, 2, 32, 4), ([37, 20], [37, 6], 3, 1, 64, 16)]
# (window, softcap): window < context, window > context (= none), softcap alone, both, neither
SETTINGS = [(5, 0.0), (7, 0.0), (1000, 0.0), (0, 5.0), (7, 5.0), (0, 0.0)]
QUERY_SCALE = 4.0  # scores of several tens before capping: a cap at 5 changes them


@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_reference_decode_matches_dense(shape, window, softcap):
    lens, h, hkv, d, bs = shape
    kc, vc, tables, ctx, _, q, dense = make_case(lens, [1] * len(lens), h, hkv, d, bs, window, 0,
                                                 query_scale=QUERY_SCALE)
    out = torch.empty_like(q)
    reference.paged_decode_attention(out, q, kc, vc, tables, ctx, d ** -0.5, window, softcap)
    want = dense_attention(q, dense, lens, [1] * len(lens), d ** -0.5, window, softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_reference_prefill_matches_dense(shape, window, softcap):
    lens, q_lens, h, hkv, d, bs = shape
    kc, vc, tables, ctx, qsl, q, dense = make_case(lens, q_lens, h, hkv, d, bs, window, 1,
                                                   query_scale=QUERY_SCALE)
    out = torch.empty_like(q)
    reference.paged_prefill_attention(out, q, kc, vc, tables, qsl, ctx, d ** -0.5, window, softcap)
    want = dense_attention(q, dense, lens, q_lens, d ** -0.5, window, softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)


def test_softcap_and_window_change_the_result():
    """The settings the cases use are not vacuous: each changes the output."""
    lens, h, hkv, d, bs = DECODE_SHAPES[0]
    kc, vc, tables, ctx, _, q, _ = make_case(lens, [1] * len(lens), h, hkv, d, bs, 0, 0,
                                             query_scale=QUERY_SCALE)
    outs = []
    for window, softcap in [(0, 0.0), (7, 0.0), (0, 5.0)]:
        out = torch.empty_like(q)
        reference.paged_decode_attention(out, q, kc, vc, tables, ctx, d ** -0.5, window, softcap)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2


@pytest.fixture(params=["parallel", "serial"])
def rows_kernel(request, monkeypatch):
    """The parallel rows kernel or the serial one (``rows_plan.MAX_SERIAL_WORK``)."""
    monkeypatch.setattr(cpu.rows_plan, "MAX_SERIAL_WORK", -1 if request.param == "parallel" else 1 << 40)
    return request.param


def _tol(dtype):
    return (ATOL, RTOL) if dtype == torch.float32 else (2e-2, 2.0 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_numba_decode_matches_reference(shape, window, softcap, dtype, rows_kernel):
    lens, h, hkv, d, bs = shape
    kc, vc, tables, ctx, _, q, _ = make_case(lens, [1] * len(lens), h, hkv, d, bs, window, 2, dtype,
                                             query_scale=QUERY_SCALE)
    want = torch.empty(q.shape)
    reference.paged_decode_attention(want, q.float(), kc.float(), vc.float(), tables, ctx, d ** -0.5,
                                     window, softcap)
    out = torch.empty_like(q)
    cpu.NumbaCPUBackend().decode(out, q, kc, vc, tables, ctx, d ** -0.5, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    atol, rtol = _tol(dtype)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dropped", [-1, None])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (7, 5.0), (0, 5.0)])
@pytest.mark.parametrize("partition_size", [8, 16])
def test_numba_partitioned_decode(window, softcap, partition_size, dropped):
    lens, h, hkv, d, bs = [40, 33], 4, 2, 32, 4
    kc, vc, tables, ctx, _, q, _ = make_case(lens, [1, 1], h, hkv, d, bs, window, 3, query_scale=QUERY_SCALE,
                                             dropped=dropped)
    want = torch.empty_like(q)
    reference.paged_decode_attention(want, q, kc, vc, tables, ctx, d ** -0.5, window, softcap)
    out = torch.empty_like(q)
    cpu.paged_decode_attention(out.numpy(), q.numpy(), kc.numpy(), vc.numpy(), tables.numpy(), ctx.numpy(),
                               d ** -0.5, partition_size=partition_size, window=window, softcap=softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_numba_prefill_matches_reference(shape, window, softcap, dtype, rows_kernel):
    lens, q_lens, h, hkv, d, bs = shape
    kc, vc, tables, ctx, qsl, q, _ = make_case(lens, q_lens, h, hkv, d, bs, window, 4, dtype,
                                               query_scale=QUERY_SCALE)
    want = torch.empty(q.shape)
    reference.paged_prefill_attention(want, q.float(), kc.float(), vc.float(), tables, qsl, ctx, d ** -0.5,
                                      window, softcap)
    for matmul_path in (False, True):  # the torch fused-attention path routes these to numba
        out = torch.empty_like(q)
        cpu.NumbaCPUBackend(matmul_prefill_path=matmul_path).prefill(
            out, q, kc, vc, tables, qsl, ctx, d ** -0.5, window=window, softcap=softcap)
        assert torch.isfinite(out).all()
        atol, rtol = _tol(dtype)
        torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (7, 5.0), (0, 5.0), (0, 0.0)])
def test_numba_decode_qkv_matches_the_steps(window, softcap, dtype):
    """The fused decode (rotary, cache write, attention) against rotary + write + reference."""
    lens, h, hkv, d, bs = [40, 9, 23], 4, 2, 32, 4
    kc, vc, tables, ctx, _, _, _ = make_case(lens, [1] * 3, h, hkv, d, bs, window, 5, dtype)
    g = torch.Generator().manual_seed(6)
    qkv = (torch.randn(3, (h + 2 * hkv) * d, generator=g) * 2).to(dtype)
    angles = torch.rand(3, 1, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.tensor([int(tables[s, (n - 1) // bs]) * bs + (n - 1) % bs for s, n in enumerate(lens)])
    backend = cpu.NumbaCPUBackend()
    k2, v2 = kc.clone(), vc.clone()
    q, k, v = backend.rope_split(qkv, cos, sin, h, hkv)
    reference.write_kv_cache(k2, v2, k, v, slots)
    want = torch.empty(q.shape)
    reference.paged_decode_attention(want, q.float(), k2.float(), v2.float(), tables, ctx, d ** -0.5,
                                     window, softcap)
    out = backend.decode_qkv(qkv, cos, sin, kc, vc, slots, tables, ctx, d ** -0.5, h, window, softcap)
    assert out is not None and torch.isfinite(out).all()
    atol, rtol = _tol(dtype)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (7, 5.0)])
def test_numba_never_reads_the_blocks_before_the_window(window, softcap, rows_kernel):
    """The dropped blocks' table entries left pointing at NaN blocks: any read of them would show."""
    lens, q_lens, h, hkv, d, bs = PREFILL_SHAPES[0]
    kc, vc, tables, ctx, qsl, q, dense = make_case(lens, q_lens, h, hkv, d, bs, window, 7, dropped=None)
    backend = cpu.NumbaCPUBackend()
    out = torch.empty_like(q)
    backend.prefill(out, q, kc, vc, tables, qsl, ctx, d ** -0.5, window=window, softcap=softcap)
    want = dense_attention(q, dense, lens, q_lens, d ** -0.5, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)
    rows = qsl[1:] - 1  # each sequence's last row: its decode
    out = torch.empty_like(q[rows])
    backend.decode(out, q[rows], kc, vc, tables, ctx, d ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), want[rows], atol=ATOL, rtol=RTOL)
