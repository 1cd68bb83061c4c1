"""Prefill attention through torch's fused attention (``kernels/cpu/matmul_prefill.py``) and the
backend's split of a prefill between it and the Numba kernel, against the PyTorch reference
computed in float32 from the same bfloat16 values.

Tolerance: torch's kernel rounds the softmax weights to bfloat16 before multiplying them with V
(relative error up to 2**-9 each), so an output may be off by up to 2**-9 of the largest value it
averages, plus the final rounding to bfloat16 (2**-8 relative): ``atol = 2**-8 * max|V|``,
``rtol = 2**-8``. A wrong mask, block or sequence boundary gives errors of 0.1 and more.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, reference
from kernels.cpu import backend as backend_module
from kernels.cpu import matmul_prefill
from tests.kernels.test_cpu_attention import _make_cache

HEAD_DIM = 64


def _case(q_lens, prefixes, num_heads=9, num_kv_heads=3, block_size=16, seed=0, dtype=torch.bfloat16):
    lens = [q + p for q, p in zip(q_lens, prefixes)]
    key_cache, value_cache, tables, g = _make_cache(lens, num_kv_heads, HEAD_DIM, block_size, seed)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(sum(q_lens)), num_heads, HEAD_DIM, generator=g).to(dtype)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    expected = torch.zeros(query.shape)
    reference.paged_prefill_attention(expected, query.float(), key_cache.float(), value_cache.float(),
                                      tables, qsl, context_lens, HEAD_DIM ** -0.5)
    return query, key_cache, value_cache, tables, qsl, context_lens, expected


def _assert_close(out, expected, value_cache):
    atol = 2.0 ** -8 * value_cache.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=2.0 ** -8)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("q_len,prefix", [(64, 0), (100, 0), (64, 37), (130, 300)])
def test_one_sequence_matches_reference(q_len, prefix, num_heads, num_kv_heads):
    """Causal over its own rows, and over a cached prefix (the mask's lower-right alignment);
    grouped-query and one query head per KV head; blocks scattered over the pool."""
    query, key_cache, value_cache, tables, _, lens, expected = _case(
        [q_len], [prefix], num_heads, num_kv_heads, seed=q_len + prefix)
    out = torch.full_like(query, float("nan"))
    matmul_prefill.prefill_sequence(out, query, key_cache, value_cache, tables[0], int(lens[0]),
                                    HEAD_DIM ** -0.5)
    _assert_close(out, expected, value_cache)


def _recording(monkeypatch):
    """Record the row counts ``prefill_sequence`` is called with (it still runs)."""
    calls = []
    original = matmul_prefill.prefill_sequence

    def record(out, query, *args):
        calls.append(query.shape[0])
        return original(out, query, *args)

    monkeypatch.setattr(matmul_prefill, "prefill_sequence", record)
    return calls


def _new_kv(key_cache, value_cache, tables, q_lens, prefixes):
    """The rows' own keys and values ``[T, Hkv, D]`` as a step has them: read back from the pools
    (position ``prefix + j`` of each sequence)."""
    block_size = key_cache.shape[2]
    keys, values = [], []
    for s, (n, p) in enumerate(zip(q_lens, prefixes)):
        for pos in range(p, p + n):
            block, offset = int(tables[s, pos // block_size]), pos % block_size
            keys.append(key_cache[block, :, offset])
            values.append(value_cache[block, :, offset])
    return torch.stack(keys), torch.stack(values)


def test_fresh_prompt_reads_its_new_keys_where_they_are():
    """A prompt without a cached prefix attends to the new keys and values it is given, bit for bit
    as to the same values gathered from the pools; with a cached prefix, the given ones are not
    enough and the pools are read (a wrong key there would show)."""
    for q_len, prefix in ((100, 0), (90, 40)):
        query, key_cache, value_cache, tables, _, lens, expected = _case([q_len], [prefix], seed=11)
        key, value = _new_kv(key_cache, value_cache, tables, [q_len], [prefix])
        gathered, given = torch.empty_like(query), torch.empty_like(query)
        args = (key_cache, value_cache, tables[0], int(lens[0]), HEAD_DIM ** -0.5)
        matmul_prefill.prefill_sequence(gathered, query, *args)
        matmul_prefill.prefill_sequence(given, query, *args, key, value)
        assert torch.equal(gathered, given)
        _assert_close(given, expected, value_cache)
        if prefix == 0:  # proof that the given keys are the ones read: change them, the output moves
            matmul_prefill.prefill_sequence(given, query, *args, key * 2, value)
            assert not torch.allclose(given, gathered)


def _numba_calls(monkeypatch):
    """Record the sequences each Numba prefill call computes (it still runs)."""
    calls = []
    original = backend_module.paged_prefill_attention

    def record(*args, sequences=None, **kwargs):
        calls.append(sequences)
        return original(*args, sequences=sequences, **kwargs)

    monkeypatch.setattr(backend_module, "paged_prefill_attention", record)
    return calls


@pytest.mark.parametrize("given_kv", [False, True])
def test_backend_splits_a_mixed_prefill_by_length(given_kv, monkeypatch):
    """Sequences of MIN_ROWS rows or more go one by one through torch's attention, all the shorter
    ones (a zero-row one among them left out) through one Numba call; the whole prefill matches
    the reference, with and without the step's new keys and values given, and the same step
    with the path off too (one Numba call for all)."""
    q_lens = [5, 70, 64, 0, 30, 130, 63, 200, 1]
    prefixes = [0, 0, 40, 9, 10, 0, 17, 300, 50]
    query, key_cache, value_cache, tables, qsl, lens, expected = _case(q_lens, prefixes, seed=3)
    kv = _new_kv(key_cache, value_cache, tables, q_lens, prefixes) if given_kv else (None, None)
    calls, numba_calls = _recording(monkeypatch), _numba_calls(monkeypatch)
    for path in (True, False):
        out = torch.full_like(query, float("nan"))
        cpu.NumbaCPUBackend(matmul_prefill_path=path).prefill(
            out, query, key_cache, value_cache, tables.long(), qsl, lens.long(), HEAD_DIM ** -0.5,
            *kv)
        _assert_close(out, expected, value_cache)
    assert calls == [70, 64, 130, 200]  # the path on; none with it off
    assert numba_calls == [[0, 4, 6, 8], None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_formats_keep_the_numba_kernel(dtype, monkeypatch):
    """float32 (the exactness mode) and float16 never take torch's attention, even with the path on."""
    query, key_cache, value_cache, tables, qsl, lens, expected = _case([100], [20], seed=5, dtype=dtype)
    calls = _recording(monkeypatch)
    out = torch.empty_like(query)
    cpu.NumbaCPUBackend(matmul_prefill_path=True).prefill(
        out, query, key_cache, value_cache, tables, qsl, lens, HEAD_DIM ** -0.5)
    assert calls == []
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("found,expected", [("amx", True), ("avx512_bf16", False), (None, False)])
def test_default_follows_the_cpu(found, expected):
    """By default the path is on only where the CPU the caller read has AMX (where it was measured
    faster), and the start-up log says which prefill runs."""
    backend = backend_module.NumbaCPUBackend(native_bf16=found)
    assert backend.matmul_prefill_path is expected
    assert ("torch fused attention" in backend.prefill_kind()) is expected

