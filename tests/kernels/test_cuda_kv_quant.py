"""The Numba CUDA kernels over quantized KV caches (kernels/cuda/kv_quant.py) against the torch
reference (kernels/kv_quant.py), at tiny shapes under the CUDA simulator (see test_cuda.py for how
it runs), or on a GPU. Tolerances as in test_kv_quant.py."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

if not numba.config.ENABLE_CUDASIM:
    from numba import cuda as _cuda

    if not _cuda.is_available():
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
                    allow_module_level=True)

from kernels import kv_quant  # noqa: E402
from kernels.cuda import kv_quant as cuda_quant  # noqa: E402  (after the skip: imports numba.cuda)
from kernels.kv_quant import QuantCache  # noqa: E402
from tests.kernels.test_kv_quant import _case  # noqa: E402

pytestmark = pytest.mark.cudasim
FORMATS = ("int8", "fp8_e4m3")


def _arrays(cache: QuantCache):
    return cache.data.numpy().view(np.uint8), cache.scale.numpy()


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_equals_reference(fmt):
    g = torch.Generator().manual_seed(7)
    shape = (4, 2, 4, 9)
    slots = torch.tensor([3, -1, 10, 0, 7], dtype=torch.int64)
    key = torch.randn(5, 2, 9, generator=g) * 3
    key[0, 0, :3] = torch.tensor([0.5, -2.5, 1.5]) * key[0, 0].abs().max() / 127  # int8 ties
    value = torch.randn(5, 2, 9, generator=g)
    want_k, want_v = QuantCache.zeros(shape, fmt, "cpu"), QuantCache.zeros(shape, fmt, "cpu")
    kv_quant.write_kv_cache(want_k, want_v, key, value, slots)
    for x, want in ((key, want_k), (value, want_v)):
        got = QuantCache.zeros(shape, fmt, "cpu")
        data, scales = _arrays(got)
        cuda_quant.write_kv_cache(data, scales, x.numpy(), slots.numpy(), fmt, cuda_quant.E4M3_POSITIVE)
        got = QuantCache(torch.from_numpy(data).view(got.data.dtype), torch.from_numpy(scales), fmt)
        torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=0)
        torch.testing.assert_close(kv_quant.dequantize(got.data, got.scale, fmt),
                                   kv_quant.dequantize(want.data, want.scale, fmt), atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 20.0)])
def test_decode_and_prefill_equal_reference(fmt, window, softcap):
    kc, vc, tables, lens, g = _case([6, 3], 4, 2, 5, 4, fmt, seed=8)  # odd head size, partial blocks
    kd, ks = _arrays(kc)
    vd, vs = _arrays(vc)
    args = (kd, ks, vd, vs, cuda_quant.TABLES[fmt], tables.numpy())
    query = torch.randn(2, 4, 5, generator=g)
    want = torch.empty_like(query)
    kv_quant.paged_decode_attention(want, query, kc, vc, tables, lens, 0.4, window, softcap)
    got = np.zeros((2, 4, 5), np.float32)
    cuda_quant.attend_rows(got, query.numpy(), *args, np.arange(2), lens.numpy().astype(np.int64), 0.4,
                           window, softcap)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=2e-5, rtol=1e-4)
    starts = torch.tensor([0, 4, 6], dtype=torch.int32)  # 4 new tokens of 6, 2 of 3
    query = torch.randn(6, 4, 5, generator=g)
    want = torch.empty_like(query)
    kv_quant.paged_prefill_attention(want, query, kc, vc, tables, starts, lens, 0.4, window, softcap)
    seqs, row_lens = cuda_quant.prefill_rows(starts.numpy(), lens.numpy())
    got = np.zeros((6, 4, 5), np.float32)
    cuda_quant.attend_rows(got, query.numpy(), *args, seqs, row_lens, 0.4, window, softcap)
    torch.testing.assert_close(torch.from_numpy(got), want, atol=2e-5, rtol=1e-4)
