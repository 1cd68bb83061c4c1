"""The Numba CPU kernels (kernels/cpu/) against the PyTorch reference (kernels/reference.py).

Tolerances: inputs are float32 N(0, 1) and everything accumulates in float32 on both sides, but
in a different order (blockwise online softmax here, one softmax over the whole row in SDPA), so
outputs (weighted means of N(0, 1) values, |x| < ~4) differ by rounding only: a few 1e-7 measured;
atol 2e-5 / rtol 1e-4 leaves room for the longest contexts and head_dim 128 without hiding a wrong
mask or a missing block (those give errors of 1e-2 and more). Writes and block copies are exact.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kernels import cpu, reference
from kernels.cpu.vectors import GroupShapeType

ATOL, RTOL = 2e-5, 1e-4

# ragged contexts: 1, around and at block-size multiples (filled in per block size), a few hundred
BASE_LENS = [1, 2, 7, 100, 257, 300]


def _lens_for(block_size: int) -> list[int]:
    return BASE_LENS + [block_size, 2 * block_size, block_size + 1, 8 * block_size - 1, 16 * block_size]


def _make_cache(num_seqs_lens, num_kv_heads, head_dim, block_size, seed, spare_blocks=7):
    """Random pools and a permuted (non-contiguous) block table per sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in num_seqs_lens]
    max_blocks = max(blocks_needed) + 2  # padding columns past the last block
    num_blocks = sum(blocks_needed) + spare_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g)
    value_cache = torch.randn(shape, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    # padding entries point at arbitrary (valid) blocks so a read past the end would show
    tables = torch.randint(0, num_blocks, (len(num_seqs_lens), max_blocks), generator=g)
    used = 0
    for s, nb in enumerate(blocks_needed):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    return key_cache, value_cache, tables.to(torch.int32), g


def _np(*tensors):
    return [t.numpy() for t in tensors]


@pytest.fixture(params=["parallel", "serial"])
def rows_kernel(request, monkeypatch):
    """The attention entry points run the parallel rows kernel or the serial one, by the work's
    size (``rows_plan.MAX_SERIAL_WORK``): a test that takes this fixture checks both."""
    limit = -1 if request.param == "parallel" else 1 << 40
    monkeypatch.setattr(cpu.rows_plan, "MAX_SERIAL_WORK", limit)
    return request.param


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_exact_and_skips_negative_slots(block_size, num_heads, num_kv_heads, head_dim):
    del num_heads
    key_cache, value_cache, _, g = _make_cache([64], num_kv_heads, head_dim, block_size, seed=1,
                                               spare_blocks=20)
    num_slots = key_cache.shape[0] * block_size
    num_tokens = 37
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[[0, 5, 36]] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(ref_k, ref_v, key, value, slots)
    cpu.write_kv_cache(*_np(key_cache, value_cache, key, value, slots))
    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])  # GQA ratios 1 and 3
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("partition_size", [0, None, 40])  # never, auto, forced (rounded to blocks)
@pytest.mark.usefixtures("rows_kernel")
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, head_dim, partition_size):
    lens = _lens_for(block_size)
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, head_dim, block_size, seed=2)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    expected = torch.empty_like(query)
    reference.paged_decode_attention(expected, query, key_cache, value_cache, tables, context_lens, scale)
    out = torch.full_like(query, float("nan"))
    cpu.paged_decode_attention(*_np(out, query, key_cache, value_cache, tables, context_lens), scale,
                               partition_size=partition_size)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_partitioned_decode_small_batch_long_context():
    """Batch 1-2, long contexts: the automatic choice partitions (as it would with 2 threads), and
    forced partitions of one block, of a few blocks, or longer than the context all agree."""
    assert cpu.auto_partitions(2, 2, num_threads=2) > 1
    assert cpu.auto_partitions(32, 3, num_threads=2) == 1  # enough (sequence, KV head) tasks
    assert cpu.auto_partitions(1, 3, num_threads=1) == 1  # one thread: nothing to balance
    lens = [1000, 33]
    key_cache, value_cache, tables, g = _make_cache(lens, 2, 64, 16, seed=3)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(2, 6, 64, generator=g)
    expected = torch.empty_like(query)
    reference.paged_decode_attention(expected, query, key_cache, value_cache, tables, context_lens, 0.125)
    for partition_size in (None, 16, 1, 512, 4096):
        out = torch.full_like(query, float("nan"))
        cpu.paged_decode_attention(*_np(out, query, key_cache, value_cache, tables, context_lens),
                                   0.125, partition_size=partition_size, num_threads=2)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_last_blocks_prefetch_the_first_blocks_of_the_range_attended_next():
    """The decode kernel's prefetch target (``_tile``): ``_PREFETCH_AHEAD`` blocks ahead in the
    range's own sequence, and past its last block the same offset in the first blocks of the range
    the thread attends next (its own sequence, KV head and start: a partition starts mid-table);
    with no range next, the tile's own row. And which range comes next for the plain and the
    partitioned kernels' task orders (``_following``)."""
    from kernels.cpu.decode import _PREFETCH_AHEAD as ahead_blocks
    from kernels.cpu.decode import _following, _tile

    block_size = 4
    end = 6 * block_size - 1  # a range of 6 blocks of sequence 3, the last one position short
    for next_start_block in (0, 2):
        following = (8, 1, next_start_block * block_size, 8 * block_size)  # sequence 8, KV head 1
        for b in range(6):
            for off in (0, 1):
                n, bi, at, *ahead = _tile(3, 0, b * block_size + off, end, block_size, following)
                assert (bi, at) == (b, off)
                assert n == min(block_size - off, end - b * block_size - off)
                a = b + ahead_blocks
                if a < 6:
                    assert ahead == [3, 0, a]
                else:  # the next range's block, at its KV head's rows
                    assert ahead == [8, 1, next_start_block + a - 6]
    n, bi, off, *ahead = _tile(3, 1, 5 * block_size, end, block_size, (8, 0, 0, 0))
    assert ahead == [3, 1, bi] and (bi, off) == (5, 0)  # nothing next: the tile's own row

    seqs, lens = np.array([2, 0], np.int32), np.array([9, 30], np.int32)
    assert _following(seqs, lens, 2, 0) == (2, 1, 0, 9)  # task 0: row 0, head 0 -> row 0, head 1
    assert _following(seqs, lens, 2, 1) == (0, 0, 0, 30)  # row 0, head 1 -> row 1, head 0
    assert _following(seqs, lens, 2, 3)[3] == 0  # the last task: nothing next
    # partitions of 8 tokens: row 0 has 2 used of 4, row 1 all 4; tasks (row, head, partition)
    assert _following(seqs, lens, 2, 0, 4, 8) == (2, 0, 8, 9)  # -> row 0, head 0, partition 1
    assert _following(seqs, lens, 2, 1, 4, 8)[2:] == (16, 9)  # empty: past its end
    assert _following(seqs, lens, 2, 7, 4, 8) == (0, 0, 0, 8)  # -> row 1, head 0, partition 0
    assert _following(seqs, lens, 2, 15, 4, 8)[3] == 0


def _prefill_case(q_lens, lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, head_dim, block_size, seed)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(sum(q_lens)), num_heads, head_dim, generator=g)
    return key_cache, value_cache, tables, query_start_loc, torch.tensor(lens, dtype=torch.int32), query


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.usefixtures("rows_kernel")
def test_prefill_matches_reference(block_size, num_heads, num_kv_heads, head_dim):
    # fresh prompts (q_len == context), chunked prefills over a cached prefix, single tokens,
    # an empty entry, tile boundaries (16, 17, 33 rows) and block-size multiples
    q_lens = [16, 17, 1, 0, 33, 5, block_size, 40]
    lens = [16, 17 + 3, 1, 9, 33 + 2 * block_size, 200, block_size, 40 + 7 * block_size]
    key_cache, value_cache, tables, qsl, context_lens, query = _prefill_case(
        q_lens, lens, num_heads, num_kv_heads, head_dim, block_size, seed=4)
    scale = head_dim ** -0.5
    expected = torch.zeros_like(query)
    reference.paged_prefill_attention(expected, query, key_cache, value_cache, tables, qsl,
                                      context_lens, scale)
    out = torch.full_like(query, float("nan"))
    cpu.paged_prefill_attention(*_np(out, query, key_cache, value_cache, tables, qsl, context_lens),
                                scale)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.usefixtures("rows_kernel")
@pytest.mark.parametrize("out_format", ["float32", "float64 (a temporary target)"])
def test_prefill_of_some_sequences_leaves_the_others(out_format):
    """``sequences=``: only those sequences' rows are computed, bit for bit as in a call for all;
    the other rows of ``out`` keep what they held, also where the kernel writes a temporary
    (a float64 ``out`` beside a float32 cache) and copies it back."""
    q_lens, lens = [16, 5, 0, 33, 7], [16, 20, 9, 40, 7]
    key_cache, value_cache, tables, qsl, context_lens, query = _prefill_case(
        q_lens, lens, 4, 2, 64, 16, seed=8)
    dtype = torch.float32 if out_format == "float32" else torch.float64
    full = torch.full(query.shape, float("nan"), dtype=dtype)
    some = torch.full(query.shape, 7.0, dtype=dtype)
    arrays = _np(query, key_cache, value_cache, tables, qsl, context_lens)
    cpu.paged_prefill_attention(full.numpy(), *arrays, 0.125)
    cpu.paged_prefill_attention(some.numpy(), *arrays, 0.125, sequences=[1, 4])
    for s in range(len(q_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        if s in (1, 4):
            assert torch.equal(some[rows], full[rows])
        else:
            assert bool((some[rows] == 7.0).all())
    cpu.paged_prefill_attention(some.numpy(), *arrays, 0.125, sequences=[])  # nothing to do
    assert bool((some[: int(qsl[1])] == 7.0).all())


def test_copy_blocks_exact():
    g = torch.Generator().manual_seed(5)
    layers = 3
    keys = [torch.randn(20, 2, 4, 64, generator=g) for _ in range(layers)]
    values = [torch.randn(20, 2, 4, 64, generator=g) for _ in range(layers)]
    for mapping in ([[0, 5], [3, 7], [19, 1]], [[0, 5], [5, 6], [6, 0]], []):  # disjoint, chained, none
        block_mapping = torch.tensor(mapping, dtype=torch.int64).view(-1, 2)
        ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
        reference.copy_blocks(ref_k, ref_v, block_mapping)
        cpu.copy_blocks([k.numpy() for k in keys], [v.numpy() for v in values], block_mapping.numpy())
        for got, want in zip(keys + values, ref_k + ref_v):
            assert torch.equal(got, want)


def test_swap_blocks_exact():
    g = torch.Generator().manual_seed(6)
    device_pool = torch.randn(12, 3, 16, 64, generator=g)
    swap_pool = torch.randn(30, 3, 16, 64, generator=g)
    out_mapping = torch.tensor([[2, 29], [11, 0], [5, 7]])  # device -> swap
    want = swap_pool.clone()
    reference.swap_blocks(want, device_pool, out_mapping)
    cpu.swap_blocks(swap_pool.numpy(), device_pool.numpy(), out_mapping.numpy())
    assert torch.equal(swap_pool, want)
    in_mapping = torch.tensor([[29, 3], [0, 4]])  # swap -> device
    want = device_pool.clone()
    reference.swap_blocks(want, swap_pool, in_mapping)
    cpu.swap_blocks(device_pool.numpy(), swap_pool.numpy(), in_mapping.numpy())
    assert torch.equal(device_pool, want)


def test_backend_views_dtypes_and_one_specialization():
    """The dispatch's calls: ``out`` slices of a bigger tensor, int64 indices, non-contiguous
    queries, a float32 and a bf16 cache (both through the kernels: the bf16 output is compared
    with the reference computed in float32 from the same bf16 values, within one bf16 rounding);
    the kernels keep one specialization per cache format."""
    backend = cpu.NumbaCPUBackend()
    lens = [5, 64, 130]
    q_lens = [3, 2]
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    key_cache, value_cache, tables, g = _make_cache(lens + [20, 70], num_kv_heads, head_dim,
                                                    block_size, seed=7)
    # write the newest token of each decode and the new tokens of each prefill
    slots = []
    for s, n in enumerate(lens):
        slots.append(int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size)
    for s, (q_len, n) in enumerate(zip(q_lens, [20, 70]), start=len(lens)):
        for pos in range(n - q_len, n):
            slots.append(int(tables[s, pos // block_size]) * block_size + pos % block_size)
    slots.append(-1)
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)  # strided rows
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(ref_k, ref_v, k, v, slot_mapping)
    backend.write_kv(key_cache, value_cache, k, v, slot_mapping)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)

    nd = len(lens)
    context_lens = torch.tensor(lens + [20, 70], dtype=torch.int64)  # int64 on purpose
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    tables64 = tables.long()
    for cache_dtype in (torch.float32, torch.bfloat16):
        kc, vc = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
        qq = q.to(cache_dtype)
        out = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=cache_dtype)
        backend.decode(out[:nd], qq[:nd], kc, vc, tables64[:nd], context_lens[:nd], 0.125)
        backend.prefill(out[nd:nd + 5], qq[nd:nd + 5], kc, vc, tables64[nd:], qsl,
                        context_lens[nd:], 0.125)
        expected = torch.zeros(out.shape)  # float32, from the same (bf16-valued) inputs
        reference.paged_decode_attention(expected[:nd], qq[:nd].float(), kc.float(), vc.float(),
                                         tables[:nd], context_lens[:nd], 0.125)
        reference.paged_prefill_attention(expected[nd:nd + 5], qq[nd:nd + 5].float(), kc.float(),
                                          vc.float(), tables[nd:], qsl, context_lens[nd:], 0.125)
        rtol = RTOL if cache_dtype == torch.float32 else 2.0 ** -8  # one bf16 rounding
        torch.testing.assert_close(out[:nd + 5].float(), expected[:nd + 5], atol=ATOL, rtol=rtol)
        assert out[nd + 5:].isnan().all()  # nothing written past the view

    # a non-contiguous ``out`` view (every other head) goes through a temporary and back
    out = torch.zeros(nd, 2 * num_heads, head_dim)
    view = out[:, ::2]
    backend.decode(view, q[:nd], key_cache, value_cache, tables[:nd], context_lens[:nd], 0.125)
    expected = torch.empty(nd, num_heads, head_dim)
    reference.paged_decode_attention(expected, q[:nd], key_cache, value_cache, tables[:nd],
                                     context_lens[:nd], 0.125)
    torch.testing.assert_close(view, expected, atol=ATOL, rtol=RTOL)
    assert (out[:, 1::2] == 0).all()

    # numba follows torch's thread count
    assert numba.get_num_threads() == min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    # one specialization per combination of formats (and, for the decode kernels, per group shape:
    # query heads per KV head and head_dim are compile-time constants there, kernels/cpu/vectors.py;
    # other tests in this process compile other shapes): every array C-contiguous, indices
    # int32/int64 as the wrappers make them, whatever the views and index dtypes the dispatch passed
    seen = {}
    for kernel in (cpu.decode._rows_kernel, cpu.decode._rows_serial_kernel,
                   cpu.decode._rows_partitioned_kernel, cpu.cache_ops._write_kv_kernel):
        formats = set()
        for sig in kernel.signatures:
            arrays = [a for a in sig if isinstance(a, numba.types.Array)]
            assert all(a.layout == "C" for a in arrays), sig
            assert all(a.dtype in (numba.float32, numba.uint16, numba.int16, numba.int32,
                                   numba.int64) for a in arrays), sig
            shapes = tuple(a for a in sig if isinstance(a, GroupShapeType))
            formats.add((tuple(a.dtype for a in arrays), shapes))
        assert len(formats) == len(kernel.signatures), kernel.signatures
        seen[kernel] = {dtype for f, _ in formats for dtype in f}
    # the bf16 cache went through the kernels (decode and prefill both run the rows kernels:
    # parallel, serial or partitioned, by the work's size and the thread count)
    rows_kernels = (cpu.decode._rows_kernel, cpu.decode._rows_serial_kernel,
                    cpu.decode._rows_partitioned_kernel)
    assert numba.uint16 in set().union(*(seen[k] for k in rows_kernels))


def test_exp_nonpositive_is_libm_exp_within_3_ulp():
    """The softmax's vectorizable exp against numpy's float32 exp over [-87.3, 0]: within 3 ulp, 2
    above -20; exactly 1 at 0, and 0 below the normal range and at -inf (masked scores)."""
    import numpy as np
    from numba import njit

    from kernels.cpu.common import exp_nonpositive

    @njit
    def apply(xs):
        out = np.empty_like(xs)
        for i in range(xs.shape[0]):
            out[i] = exp_nonpositive(xs[i])
        return out

    xs = np.concatenate([np.linspace(-87.3, 0, 200_001, dtype=np.float32),
                         -np.logspace(-8, 0, 1001, dtype=np.float32)])
    got, want = apply(xs), np.exp(xs)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    worst = ulps.argmax()
    assert ulps.max() <= 3 and ulps[xs > -20].max() <= 2, (xs[worst], got[worst], want[worst])
    edge = apply(np.array([0.0, -87.34, -100.0, -np.inf], np.float32))
    assert edge.tolist() == [1.0, 0.0, 0.0, 0.0]
