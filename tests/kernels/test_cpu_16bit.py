"""The Numba CPU kernels on 16-bit KV caches (bfloat16, float16) against the PyTorch reference.

The expected outputs are the reference computed in float32 from the same 16-bit values (caches and
queries cast up exactly), so the kernels' widening is checked without any 16-bit rounding on the
reference side. Tolerances:
- float32 output: both sides accumulate in float32 from identical inputs, in a different order,
  so ``test_kernels_cpu``'s ATOL/RTOL hold unchanged.
- 16-bit output: one more rounding, of the final value, to the output's format: at most one unit
  in the last place of that format (a value near a rounding boundary may round either way), so
  ``rtol`` is 2**-8 for bfloat16 (8 significant bits) and 2**-11 for float16 (11); a wrong mask,
  block or widening gives errors of 1e-2 and more.
Writes round float32 to the cache's format exactly as torch's ``.to`` does, and copies and swaps
are bit copies (random bit patterns, NaNs included, compared bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, reference
from tests.kernels import test_cpu_attention as test_kernels_cpu
from tests.kernels.test_cpu_attention import ATOL, RTOL, _lens_for, _make_cache

DTYPES = [torch.bfloat16, torch.float16]
OUT_RTOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: RTOL}
BITS = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}
rows_kernel = test_kernels_cpu.rows_kernel  # the fixture: parallel and serial rows kernels


def _bits(*tensors):
    """numpy views in the kernels' format (16-bit tensors as their raw bits)."""
    return [t.view(BITS[t.dtype]).numpy() if t.dtype in BITS else t.numpy() for t in tensors]


def _share_blocks(tables: torch.Tensor, lens: list[int], block_size: int) -> None:
    """Make every second sequence share its leading full blocks with the one before it (as forks
    and prefix-cache hits do): tables that map several sequences to the same physical blocks."""
    for s in range(1, len(lens), 2):
        shared = min(lens[s - 1], lens[s]) // block_size
        tables[s, :shared] = tables[s - 1, :shared]


def _decode_case(dtype, block_size, num_heads, num_kv_heads, head_dim, seed):
    lens = _lens_for(block_size)
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, head_dim, block_size, seed)
    _share_blocks(tables, lens, block_size)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return (query, key_cache.to(dtype), value_cache.to(dtype), tables,
            torch.tensor(lens, dtype=torch.int32))


def _decode_cases():
    """(rows kernel, partition size, cache format, heads, KV heads, head_dim) for the decode test.

    Every (kernel, format, group shape) is a Numba specialization of its own, compiled when first
    called (a second or more each for the parallel kernels); the full product (3 kernels x 2
    formats x 4 shapes) compiled 48 of them. These 12 cases cover every pair instead: each
    kernel (parallel rows, serial rows, partitioned) on every group shape (GQA ratios 1 and 3,
    head_dim 64 and 128), each kernel with both formats, each shape with both formats, and the
    partitioned kernel under both row orders (the ``rows_kernel`` fixture's values). The
    float32 format's full product stays in ``test_kernels_cpu``; block sizes 4 and 16 (ragged
    batches, shared blocks) run for every case. The head_dim 64 rows-kernel cases are also
    every pair for the prefill test, which runs them (``_prefill_cases``): nothing new to compile."""
    shapes = [(4, 4, 64), (6, 2, 64), (4, 4, 128), (6, 2, 128)]
    cases = []
    for i, shape in enumerate(shapes):
        cases.append(("parallel", 0, DTYPES[i % 2], *shape))
        cases.append(("serial", 0, DTYPES[(i + 1) % 2], *shape))
        # partition size 40: forced (rounded up to a multiple of the block size)
        cases.append((["parallel", "serial"][i % 2], 40, DTYPES[i // 2], *shape))
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    return [pytest.param(*c, id=f"{c[0]}-part{c[1]}-{names[c[2]]}-{c[3]}h{c[4]}kv-d{c[5]}") for c in cases]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("rows_kernel,partition_size,dtype,num_heads,num_kv_heads,head_dim",
                         _decode_cases(), indirect=["rows_kernel"])
def test_decode_16bit_matches_reference(rows_kernel, partition_size, dtype, num_heads,
                                        num_kv_heads, head_dim, block_size):
    query, key_cache, value_cache, tables, lens = _decode_case(
        dtype, block_size, num_heads, num_kv_heads, head_dim, seed=11)
    scale = head_dim ** -0.5
    expected = torch.empty(query.shape)
    reference.paged_decode_attention(expected, query.float(), key_cache.float(),
                                     value_cache.float(), tables, lens, scale)
    for out_dtype in (dtype, torch.float32):
        out = torch.full(query.shape, float("nan"), dtype=out_dtype)
        cpu.paged_decode_attention(*_bits(out, query, key_cache, value_cache), tables.numpy(),
                                   lens.numpy(), scale, partition_size=partition_size)
        torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=OUT_RTOL[out_dtype])


def _prefill_cases():
    """(rows kernel, cache format, heads, KV heads): the decode test's unpartitioned head_dim 64
    cases, every pair of (kernel, format, GQA ratio 1 or 3), compiled once for both tests."""
    return [pytest.param(*c.values[:1], *c.values[2:5], id=c.id.replace("-part0", "").rsplit("-d", 1)[0])
            for c in _decode_cases() if c.values[1] == 0 and c.values[5] == 64]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("rows_kernel,dtype,num_heads,num_kv_heads", _prefill_cases(),
                         indirect=["rows_kernel"])
def test_prefill_16bit_matches_reference(rows_kernel, dtype, num_heads, num_kv_heads, block_size):
    head_dim = 64
    q_lens = [16, 17, 1, 0, 33, 5, block_size, 40]
    lens = [16, 17 + 3, 1, 9, 33 + 2 * block_size, 200, block_size, 40 + 7 * block_size]
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, head_dim, block_size, 12)
    _share_blocks(tables, lens, block_size)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(sum(q_lens)), num_heads, head_dim, generator=g).to(dtype)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    expected = torch.zeros(query.shape)
    reference.paged_prefill_attention(expected, query.float(), key_cache.float(),
                                      value_cache.float(), tables, qsl, context_lens, scale)
    for out_dtype in (dtype, torch.float32):
        out = torch.full(query.shape, float("nan"), dtype=out_dtype)
        cpu.paged_prefill_attention(*_bits(out, query, key_cache, value_cache), tables.numpy(),
                                    qsl.numpy(), context_lens.numpy(), scale)
        torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=OUT_RTOL[out_dtype])


def _awkward_floats(g: torch.Generator, n: int) -> torch.Tensor:
    """float32 values that exercise rounding: ties, huge and tiny magnitudes, signed zeros, infs."""
    mags = 10.0 ** torch.randint(-30, 30, (n,), generator=g).float()
    values = torch.randn(n, generator=g) * mags
    ties = (torch.randint(0, 2 ** 15, (n,), generator=g, dtype=torch.int32) << 16 | 0x8000)
    values[: n // 4] = ties[: n // 4].view(torch.float32)  # exactly halfway between bf16 values
    values[n // 4: n // 4 + 6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65520.0, 1e-7])
    return values


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_rounds_like_torch_and_copies_16bit_exactly(dtype):
    num_kv_heads, head_dim, block_size = 2, 64, 16
    g = torch.Generator().manual_seed(13)
    key_cache = torch.randn(30, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(30, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    num_tokens = 64
    slots = torch.randperm(30 * block_size, generator=g)[:num_tokens]
    slots[[3, 40]] = -1  # padding tokens
    shape = (num_tokens, num_kv_heads, head_dim)
    key = _awkward_floats(g, num_tokens * num_kv_heads * head_dim).view(shape)
    value = _awkward_floats(g, num_tokens * num_kv_heads * head_dim).view(shape)
    for k, v in ((key, value), (key.to(dtype), value.to(dtype))):  # float32 inputs, then 16-bit
        ref_k, ref_v = key_cache.clone(), value_cache.clone()
        reference.write_kv_cache(ref_k, ref_v, k, v, slots)
        cpu.write_kv_cache(*_bits(key_cache, value_cache, k, v), slots.numpy())
        assert torch.equal(key_cache.view(torch.int16), ref_k.view(torch.int16))
        assert torch.equal(value_cache.view(torch.int16), ref_v.view(torch.int16))


def _random_bits(shape, dtype, g):
    """Tensors of ``dtype`` holding arbitrary 16-bit patterns (NaNs and infinities included)."""
    return torch.randint(-2 ** 15, 2 ** 15, shape, generator=g, dtype=torch.int32).to(
        torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_and_swap_16bit_are_bit_copies(dtype):
    g = torch.Generator().manual_seed(14)
    keys = [_random_bits((20, 2, 4, 64), dtype, g) for _ in range(2)]
    values = [_random_bits((20, 2, 4, 64), dtype, g) for _ in range(2)]
    for mapping in ([[0, 5], [3, 7], [19, 1]], [[0, 5], [5, 6], [6, 0]]):  # disjoint, chained
        block_mapping = torch.tensor(mapping, dtype=torch.int64)
        ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
        reference.copy_blocks(ref_k, ref_v, block_mapping)
        cpu.copy_blocks(_bits(*keys), _bits(*values), block_mapping.numpy())
        for got, want in zip(keys + values, ref_k + ref_v):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    device_pool = _random_bits((12, 3, 16, 64), dtype, g)
    swap_pool = _random_bits((30, 3, 16, 64), dtype, g)
    for dst, src, mapping in ((swap_pool, device_pool, [[2, 29], [11, 0], [5, 7]]),  # out
                              (device_pool, swap_pool, [[29, 3], [0, 4]])):  # and back in
        want = dst.clone()
        reference.swap_blocks(want, src, torch.tensor(mapping))
        cpu.swap_blocks(*_bits(dst, src), torch.tensor(mapping).numpy())
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_runs_16bit_caches_without_the_reference(dtype, monkeypatch):
    """The dispatch's backend takes 16-bit pools through the kernels: every reference function is
    replaced by one that fails, and the results still match the float32 reference."""
    query, key_cache, value_cache, tables, lens = _decode_case(dtype, 16, 6, 2, 64, seed=15)
    expected = torch.empty(query.shape)
    reference.paged_decode_attention(expected, query.float(), key_cache.float(),
                                     value_cache.float(), tables, lens, 0.125)
    g = torch.Generator().manual_seed(16)
    new_k = torch.randn(3, 2, 64, generator=g).to(dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(ref_k, ref_v, new_k, new_k, torch.tensor([0, 17, -1]))
    ref_pools = [t.clone() for t in (ref_k, ref_v)]
    reference.copy_blocks([ref_pools[0]], [ref_pools[1]], torch.tensor([[1, 2]]))
    # a prefill: the last 5 and 40 positions of sequences 3 and 4 (100 and 257 tokens) as new tokens
    pre_qsl = torch.tensor([0, 5, 45], dtype=torch.int32)
    pre_query = torch.randn(45, 6, 64, generator=g).to(dtype)
    pre_expected = torch.empty(pre_query.shape)
    reference.paged_prefill_attention(pre_expected, pre_query.float(), key_cache.float(),
                                      value_cache.float(), tables[3:5], pre_qsl, lens[3:5], 0.125)

    def fail(*args, **kwargs):
        raise AssertionError("the reference ran")

    for name in ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention",
                 "copy_blocks", "swap_blocks"):
        monkeypatch.setattr(reference, name, fail)
    backend = cpu.NumbaCPUBackend()
    out = torch.empty_like(query)
    backend.decode(out, query, key_cache, value_cache, tables.long(), lens.long(), 0.125)
    torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=OUT_RTOL[dtype])
    pre_out = torch.empty_like(pre_query)
    backend.prefill(pre_out, pre_query, key_cache, value_cache, tables[3:5].long(), pre_qsl,
                    lens[3:5].long(), 0.125)
    torch.testing.assert_close(pre_out.float(), pre_expected, atol=ATOL, rtol=OUT_RTOL[dtype])
    backend.write_kv(key_cache, value_cache, new_k, new_k, torch.tensor([0, 17, -1]))
    backend.copy_blocks([key_cache], [value_cache], torch.tensor([[1, 2]]))
    for got, want in zip((key_cache, value_cache), ref_pools):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    swap = torch.zeros_like(key_cache)
    backend.swap_blocks(swap, key_cache, torch.tensor([[2, 5]]))
    assert torch.equal(swap[5].view(torch.int16), key_cache[2].view(torch.int16))
