"""The Numba CUDA kernels (kernels/cuda/) against the PyTorch reference, at tiny shapes.

Runs under the CUDA simulator, in its own pytest invocation (numba reads the variable when it is
first imported, so it must be set before the process starts):

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/pytest -q tests/kernels/test_cuda.py -m cudasim

or on a real GPU without the variable. A simulated thread block runs its threads as Python
threads (~0.2 s per block), hence the grids of a few sequences and heads. The arrays are numpy:
the simulator (like numba on a GPU) copies them in and writes them back after each launch.

Tolerances as in test_kernels_cpu.py: float32 accumulation in a different order than SDPA;
writes and block copies are exact.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kernels import reference

if not numba.config.ENABLE_CUDASIM:
    from numba import cuda as _cuda

    if not _cuda.is_available():
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
                    allow_module_level=True)

from kernels import cuda as kcuda  # noqa: E402  (after the skip: imports numba.cuda)

pytestmark = pytest.mark.cudasim

ATOL, RTOL = 2e-5, 1e-4


def _case(lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), max(needed) + 1), generator=g)
    used = 0
    for s, nb in enumerate(needed):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    return key_cache, value_cache, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32), g


def test_write_kv_cache_exact():
    key_cache, value_cache, _, _, g = _case([12], 4, 2, 32, 4, seed=0)
    slots = torch.tensor([3, -1, 10, 0, 7], dtype=torch.int64)
    key = torch.randn(5, 2, 32, generator=g)
    value = torch.randn(5, 2, 32, generator=g)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(want_k, want_v, key, value, slots)
    kc, vc = key_cache.numpy().copy(), value_cache.numpy().copy()
    kcuda.write_kv_cache(kc, vc, key.numpy(), value.numpy(), slots.numpy())
    assert np.array_equal(kc, want_k.numpy()) and np.array_equal(vc, want_v.numpy())


@pytest.mark.parametrize(
    "lens,num_heads,num_kv_heads,head_dim,block_size,partition_size",
    [
        # one partition; GQA ratio 1; head_dim == block threads (one token group)
        ([37, 16], 2, 2, 64, 16, None),
        # partitions of 8 tokens + log-sum-exp merge; GQA ratio 3; head_dim 32 (two token groups)
        pytest.param([1, 23], 3, 1, 32, 4, 8, marks=pytest.mark.slow),  # the slowest to simulate
        # head_dim 128 > block threads (threads loop over dims); a partial last partition
        ([40], 1, 1, 128, 16, 16),
    ],
)
def test_decode_matches_reference(lens, num_heads, num_kv_heads, head_dim, block_size, partition_size):
    key_cache, value_cache, tables, context_lens, g = _case(lens, num_heads, num_kv_heads, head_dim,
                                                            block_size, seed=1)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    expected = torch.empty_like(query)
    reference.paged_decode_attention(expected, query, key_cache, value_cache, tables, context_lens, scale)
    out = np.full(query.shape, np.nan, np.float32)
    kcuda.paged_decode_attention(out, query.numpy(), key_cache.numpy(), value_cache.numpy(),
                                 tables.numpy(), context_lens.numpy(), scale,
                                 partition_size=partition_size)
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("partition_size", [None, pytest.param(8, marks=pytest.mark.slow)])  # 8: slow to simulate
def test_prefill_matches_reference(partition_size):
    # a fresh prompt of 2 tokens and a chunk of 2 new tokens over a 17-token cached prefix
    q_lens, lens = [2, 2], [2, 19]
    key_cache, value_cache, tables, context_lens, g = _case(lens, 2, 1, 32, 4, seed=2)
    query_start_loc = torch.tensor([0, 2, 4], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 2, 32, generator=g)
    expected = torch.empty_like(query)
    reference.paged_prefill_attention(expected, query, key_cache, value_cache, tables,
                                      query_start_loc, context_lens, 0.2)
    out = np.full(query.shape, np.nan, np.float32)
    kcuda.paged_prefill_attention(out, query.numpy(), key_cache.numpy(), value_cache.numpy(),
                                  tables.numpy(), query_start_loc.numpy(), context_lens.numpy(), 0.2,
                                  partition_size=partition_size)
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)


def test_copy_and_swap_blocks_exact():
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(6, 1, 4, 8, generator=g) for _ in range(2)]
    values = [torch.randn(6, 1, 4, 8, generator=g) for _ in range(2)]
    mapping = torch.tensor([[0, 3], [5, 1]], dtype=torch.int64)
    want_k, want_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(want_k, want_v, mapping)
    got_k, got_v = [k.numpy().copy() for k in keys], [v.numpy().copy() for v in values]
    kcuda.copy_blocks(got_k, got_v, mapping.numpy())
    for got, want in zip(got_k + got_v, want_k + want_v):
        assert np.array_equal(got, want.numpy())

    pool, swap = torch.randn(4, 1, 4, 8, generator=g), torch.randn(9, 1, 4, 8, generator=g)
    mapping = torch.tensor([[1, 8], [3, 0]], dtype=torch.int64)
    want = swap.clone()
    reference.swap_blocks(want, pool, mapping)
    got = swap.numpy().copy()
    kcuda.swap_blocks(got, pool.numpy(), mapping.numpy())
    assert np.array_equal(got, want.numpy())


def test_backend_needs_a_device():
    if kcuda.SIMULATOR:
        with pytest.raises(ImportError):
            kcuda.NumbaCUDABackend()


@pytest.mark.skipif(kcuda.SIMULATOR or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_on_gpu_matches_reference(dtype):
    """On torch CUDA tensors, as the model calls it; 16-bit: against the float32 reference over the
    same 16-bit values, rounded once into the output's dtype as the kernels' result is."""
    backend = kcuda.NumbaCUDABackend()
    assert backend.runs_for(dtype) == "cuda"
    lens = [1, 16, 300, 1500]
    key_cache, value_cache, tables, context_lens, g = _case(lens, 9, 3, 64, 16, seed=4)
    key_cache, value_cache = key_cache.cuda().to(dtype), value_cache.cuda().to(dtype)
    tables, context_lens = tables.cuda(), context_lens.cuda()
    query = torch.randn(len(lens) + 4, 9, 64, generator=g).cuda().to(dtype)
    out = torch.full_like(query, float("nan"))
    backend.decode(out[:4], query[:4], key_cache, value_cache, tables, context_lens, 0.125)
    expected = torch.empty(query.shape, device="cuda")
    kc, vc, q = key_cache.float(), value_cache.float(), query.float()
    reference.paged_decode_attention(expected[:4], q[:4], kc, vc, tables, context_lens, 0.125)
    qsl = torch.tensor([0, 1, 4, 6, 8], dtype=torch.int32, device="cuda")
    backend.prefill(out[4:], query[4:], key_cache, value_cache, tables, qsl, context_lens, 0.125)
    reference.paged_prefill_attention(expected[4:], q[4:], kc, vc, tables, qsl, context_lens, 0.125)
    torch.cuda.synchronize()
    # 16-bit: torch's tolerances for the dtype (a result on a rounding boundary may round one ulp apart)
    tolerance = {"atol": ATOL, "rtol": RTOL} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected.to(dtype), **tolerance)


def _bits(t: torch.Tensor) -> np.ndarray:
    """What the kernels are given for a 16-bit tensor: float16 as is, bfloat16 as its int16 bits."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])  # slow to simulate
def test_16bit_caches_match_the_reference_from_the_same_values(dtype):
    """bf16 (int16 bits) and fp16 caches and queries: the kernels widen every element and
    accumulate in float32, so they equal the float32 reference over the same 16-bit values as
    closely as float32 kernels do; new keys and values are written bit for bit."""
    lens = [37]
    key_cache, value_cache, tables, context_lens, g = _case(lens, 2, 1, 64, 16, seed=5)
    kc, vc = key_cache.to(dtype), value_cache.to(dtype)
    query = torch.randn(len(lens), 2, 64, generator=g).to(dtype)
    expected = torch.empty(query.shape)
    reference.paged_decode_attention(expected, query.float(), kc.float(), vc.float(), tables, context_lens, 0.125)
    out = np.full(query.shape, np.nan, np.float32)
    kcuda.paged_decode_attention(out, _bits(query), _bits(kc), _bits(vc), tables.numpy(), context_lens.numpy(),
                                 0.125)  # one partition: the merge reads float32 partials whatever the cache
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)

    query_start_loc = torch.tensor([0, 2], dtype=torch.int32)  # 2 new tokens after 12 cached
    lens_pf = torch.tensor([14], dtype=torch.int32)
    query = torch.randn(2, 2, 64, generator=g).to(dtype)
    expected = torch.empty(query.shape)
    reference.paged_prefill_attention(expected, query.float(), kc.float(), vc.float(), tables[:1], query_start_loc,
                                      lens_pf, 0.125)
    out = np.full(query.shape, np.nan, np.float32)
    kcuda.paged_prefill_attention(out, _bits(query), _bits(kc), _bits(vc), tables[:1].numpy(),
                                  query_start_loc.numpy(), lens_pf.numpy(), 0.125)
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)

    slots = torch.tensor([5, 17], dtype=torch.int64)
    key, value = torch.randn(2, 1, 64, generator=g).to(dtype), torch.randn(2, 1, 64, generator=g).to(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(want_k, want_v, key, value, slots)
    got_k, got_v = _bits(kc).copy(), _bits(vc).copy()
    kcuda.write_kv_cache(got_k, got_v, _bits(key), _bits(value), slots.numpy())
    assert np.array_equal(got_k, _bits(want_k)) and np.array_equal(got_v, _bits(want_v))


# Sliding windows and soft-capping (tests/kernels/test_window_softcap.py's cases, kept tiny: a
# simulated thread block takes ~0.2 s). The blocks wholly before every row's window are NaN and
# their table entries still point at them (a -1 would wrap around in the simulator's numpy
# indexing): finite, right outputs show they are never read.
@pytest.mark.parametrize("window,softcap,partition_size", [
    (7, 0.0, None), (0, 5.0, None), (7, 5.0, 4), (1000, 0.0, None),
])
def test_decode_window_softcap(window, softcap, partition_size):
    from tests.kernels.test_window_softcap import QUERY_SCALE, make_case

    lens = [23, 6]
    kc, vc, tables, ctx, _, q, _ = make_case(lens, [1, 1], 2, 1, 32, 4, window, 8,
                                             query_scale=QUERY_SCALE, dropped=None)
    expected = torch.empty_like(q)
    reference.paged_decode_attention(expected, q, kc, vc, tables, ctx, 32 ** -0.5, window, softcap)
    out = np.full(q.shape, np.nan, np.float32)
    kcuda.paged_decode_attention(out, q.numpy(), kc.numpy(), vc.numpy(), tables.numpy(), ctx.numpy(),
                                 32 ** -0.5, partition_size=partition_size, window=window, softcap=softcap)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window,softcap,partition_size", [(5, 5.0, None), (7, 0.0, 4)])
def test_prefill_window_softcap(window, softcap, partition_size):
    from tests.kernels.test_window_softcap import QUERY_SCALE, make_case

    lens, q_lens = [21, 4], [3, 4]  # a chunk after an 18-token cached prefix; a fresh prompt
    kc, vc, tables, ctx, qsl, q, _ = make_case(lens, q_lens, 2, 1, 32, 4, window, 9,
                                               query_scale=QUERY_SCALE, dropped=None)
    expected = torch.empty_like(q)
    reference.paged_prefill_attention(expected, q, kc, vc, tables, qsl, ctx, 32 ** -0.5, window, softcap)
    out = np.full(q.shape, np.nan, np.float32)
    kcuda.paged_prefill_attention(out, q.numpy(), kc.numpy(), vc.numpy(), tables.numpy(), qsl.numpy(),
                                  ctx.numpy(), 32 ** -0.5, partition_size=partition_size, window=window,
                                  softcap=softcap)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected.numpy(), atol=ATOL, rtol=RTOL)
