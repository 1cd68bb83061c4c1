"""Quantized KV caches (``--kv-cache-dtype int8|fp8_e4m3``): the formats against torch's own
conversions, the round trip's error bound, and the Numba CPU kernels against the torch reference
(``kernels/kv_quant.py``) reading the same quantized cache.

Tolerances: the kernels and the reference dequantize the same bytes with the same scales, then
accumulate in float32 in a different order (SDPA's against an online softmax): 2e-5 absolute,
as the float32 kernel tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import kv_quant
from kernels.cpu import kv_quant as cpu_quant
from kernels.kv_quant import QuantCache

FORMATS = ("int8", "fp8_e4m3")
ATOL, RTOL = 2e-5, 1e-4


def test_e4m3_table_is_torchs_cast():
    """The 256-entry table the kernels decode fp8 with equals torch's float8_e4m3fn -> float32."""
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(kv_quant.e4m3_table(), want)  # NaN where torch has NaN


def test_cpu_e4m3_widening_is_torchs_cast():
    """The CPU kernels' bit-placing fp8 decode, every code but the two NaNs (never written)."""
    from numba import njit

    from kernels.cpu.kv_quant import _row_scale, _widen

    @njit
    def widen_all(row, data):
        _widen(row, data, 0, 0, 0)
        return _row_scale(data)

    data = np.arange(256, dtype=np.uint8).reshape(1, 1, 1, 256)
    row = np.empty(256, np.float32)
    got = row * widen_all(row, data)
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = np.isfinite(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])


def test_cpu_e4m3_encoding_is_torchs_cast():
    """The write's e4m3 encoding from float32 bits against torch's cast: every value, every
    midpoint between neighbours (ties to even), subnormals, random magnitudes, both signs."""
    from kernels.cpu.kv_quant import _encode_e4m3

    table = kv_quant.e4m3_table()[:127].astype(np.float64)
    mids = (table[:-1] + table[1:]) / 2
    rng = np.random.default_rng(0)
    q = np.concatenate([table, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                        rng.uniform(0, 448, 500), 2.0 ** rng.uniform(-12, -5, 200)]).astype(np.float32)
    q = np.concatenate([q, -q])
    want = torch.from_numpy(q).to(torch.float8_e4m3fn).float().numpy()
    got = np.array([_encode_e4m3(v, np.float32(min(abs(v), 448.0)).view(np.uint32)) for v in q], np.uint8)
    np.testing.assert_array_equal(kv_quant.e4m3_table()[got], want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_within_the_format_bound(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 17, generator=g) * torch.rand(40, 3, 1, generator=g) * 10
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    q, scale = kv_quant.quantize(x, fmt)
    back = kv_quant.dequantize(q, scale, fmt)
    assert torch.all(back[0, 0] == 0)
    err = (back - x).abs()
    if fmt == "int8":
        assert torch.all(err <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12)
    else:  # torch's own e4m3 cast of the scaled values, scaled back
        cast = (x / scale[..., None]).nan_to_num(0.0).to(torch.float8_e4m3fn).float() * scale[..., None]
        torch.testing.assert_close(back, cast, atol=0, rtol=1e-6)
        assert torch.all(err <= x.abs() / 16 + scale[..., None] * 2 ** -9)  # half an ulp of 3 bits
    # every row's largest magnitude is represented (nearly) exactly: the scale uses the full range
    top = x.abs().amax(-1)
    torch.testing.assert_close(back.abs().amax(-1), top, atol=1e-6, rtol=1e-5)


def _case(lens, num_heads, num_kv_heads, head_dim, block_size, fmt, seed):
    """Quantized caches filled by the reference write through a random block table, the tables,
    the lengths, and the generator."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 2
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc, vc = QuantCache.zeros(shape, fmt, "cpu"), QuantCache.zeros(shape, fmt, "cpu")
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(needed) + 1), -1, dtype=torch.int32)
    used = 0
    for s, (n, nb) in enumerate(zip(lens, needed)):
        tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        slots = (tables[s, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g) * 2
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        kv_quant.write_kv_cache(kc, vc, k, v, slots)
    return kc, vc, tables, torch.tensor(lens, dtype=torch.int32), g


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_write_equals_reference(fmt):
    g = torch.Generator().manual_seed(2)
    shape = (5, 2, 4, 13)
    slots = torch.tensor([3, -1, 10, 0, 7, 19], dtype=torch.int64)
    key, value = torch.randn(6, 2, 13, generator=g) * 3, torch.randn(6, 2, 13, generator=g)
    key[4, 1] = 0.0
    want_k, want_v = QuantCache.zeros(shape, fmt, "cpu"), QuantCache.zeros(shape, fmt, "cpu")
    got_k, got_v = QuantCache.zeros(shape, fmt, "cpu"), QuantCache.zeros(shape, fmt, "cpu")
    cpu_quant.write_kv_cache(got_k, got_v, key.to(torch.bfloat16).float(), value, slots)
    kv_quant.write_kv_cache(want_k, want_v, key.to(torch.bfloat16).float(), value, slots)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=0)
        torch.testing.assert_close(kv_quant.dequantize(got.data, got.scale, fmt),
                                   kv_quant.dequantize(want.data, want.scale, fmt), atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_cpu_decode_equals_reference(fmt, window, softcap):
    # partial blocks, an odd head size, grouped-query heads (3 per KV head)
    kc, vc, tables, lens, g = _case([1, 7, 18], 6, 2, 13, 4, fmt, seed=3)
    query = torch.randn(3, 6, 13, generator=g)
    want, got = torch.empty_like(query), torch.empty_like(query)
    kv_quant.paged_decode_attention(want, query, kc, vc, tables, lens, 0.3, window, softcap)
    cpu_quant.paged_decode_attention(got, query, kc, vc, tables, lens, 0.3, window, softcap)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [0, 6])
def test_cpu_prefill_equals_reference(fmt, window):
    kc, vc, tables, lens, g = _case([9, 5, 12], 4, 4, 16, 4, fmt, seed=4)
    q_lens = [9, 2, 4]  # a whole prompt, then chunks over cached prefixes
    starts = torch.tensor([0, 9, 11, 15], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 4, 16, generator=g)
    want, got = torch.empty_like(query), torch.empty_like(query)
    kv_quant.paged_prefill_attention(want, query, kc, vc, tables, starts, lens, 0.25, window)
    cpu_quant.paged_prefill_attention(got, query, kc, vc, tables, starts, lens, 0.25, window)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_attention_close_to_unquantized(fmt):
    """The dequantized reference against attention over the float keys and values themselves:
    within what the formats' errors allow (a loose bound: int8 ~1e-2, e4m3 ~6e-2 relative)."""
    from kernels import reference

    g = torch.Generator().manual_seed(5)
    shape = (4, 2, 8, 32)
    kf, vf = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    kc, vc = QuantCache.zeros(shape, fmt, "cpu"), QuantCache.zeros(shape, fmt, "cpu")
    slots = torch.arange(32)
    kv_quant.write_kv_cache(kc, vc, kf.permute(0, 2, 1, 3).reshape(32, 2, 32),
                            vf.permute(0, 2, 1, 3).reshape(32, 2, 32), slots)
    tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    lens = torch.tensor([32], dtype=torch.int32)
    query = torch.randn(1, 4, 32, generator=g)
    exact, quant = torch.empty_like(query), torch.empty_like(query)
    reference.paged_decode_attention(exact, query, kf, vf, tables, lens, 32 ** -0.5)
    kv_quant.paged_decode_attention(quant, query, kc, vc, tables, lens, 32 ** -0.5)
    bound = 0.03 if fmt == "int8" else 0.15
    assert (quant - exact).abs().max() <= bound * exact.abs().max()


def test_copy_and_swap_move_scales_with_bytes():
    kc, vc, _, _, _ = _case([8], 2, 2, 8, 4, "int8", seed=6)
    src_k, src_v = kc.data.clone(), kc.scale.clone()
    kv_quant.copy_blocks([kc], [vc], torch.tensor([[0, 2], [1, 3]]))
    assert torch.equal(kc.data[2], src_k[0]) and torch.equal(kc.scale[3], src_v[1])
    host = QuantCache.zeros(kc.shape, "int8", "cpu")
    kv_quant.swap_blocks(host, kc, torch.tensor([[3, 0]]))
    assert torch.equal(host.data[0], kc.data[3]) and torch.equal(host.scale[0], kc.scale[3])
    with pytest.raises(TypeError):
        kv_quant.swap_blocks(QuantCache.zeros(kc.shape, "fp8_e4m3", "cpu"), kc, torch.tensor([[0, 0]]))
