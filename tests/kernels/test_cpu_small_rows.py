"""The backend's row kernels (norm, rotary, activation) in parallel from a few rows
(``NumbaCPUBackend.parallel_small_rows``): the same bits as serially, and only where idle threads
spin."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [16, 64])
def test_small_rows_in_parallel_give_the_same_bits(dtype, num_tokens, monkeypatch):
    """``parallel_small_rows(True)`` (where idle threads spin) sends a decode batch's norm, rotary
    and activation to the parallel kernels; outputs are bit for bit the serial ones'. Where threads
    sleep it changes nothing."""
    from kernels.cpu import activation, norm, rotary

    g = torch.Generator().manual_seed(num_tokens)
    residual = torch.randn(num_tokens, 576, generator=g).to(dtype)
    delta, weight = torch.randn(num_tokens, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    qkv = torch.randn(num_tokens, 15 * 64, generator=g).to(dtype)
    cos, sin = torch.randn(num_tokens, 1, 64, generator=g).to(dtype), torch.randn(num_tokens, 1, 64, generator=g).to(dtype)
    gate_up = torch.randn(num_tokens, 2 * 1536, generator=g).to(dtype)
    ran = []
    for module, name in [(norm, "_add_rms_norm_parallel"), (rotary, "_rope_split_parallel"),
                         (activation, "_silu_mul_parallel")]:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, kernel=kernel, name=name: (ran.append(name), kernel(*a))[1])

    def outputs(backend):
        res = residual.clone()
        return [backend.add_rms_norm(res, delta, weight, 1e-5), res,
                *backend.rope_split(qkv, cos, sin, 9, 3), backend.silu_mul(gate_up)]

    serial = outputs(cpu.NumbaCPUBackend(matmul_prefill_path=False))
    assert ran == []
    asleep = cpu.NumbaCPUBackend(matmul_prefill_path=False, idle_threads_spin=lambda: False)
    assert asleep.parallel_small_rows(True) is False and outputs(asleep) and ran == []
    unknown = cpu.NumbaCPUBackend(matmul_prefill_path=False)  # no idle_threads_spin passed: asleep
    assert unknown.parallel_small_rows(True) is False and outputs(unknown) and ran == []
    spinning = cpu.NumbaCPUBackend(matmul_prefill_path=False, idle_threads_spin=lambda: True)
    assert spinning.parallel_small_rows(True) is True
    parallel = outputs(spinning)
    from kernels.cpu.backend import SMALL_ROWS_PARALLEL_FROM

    want = [name for name, rows in zip(["_add_rms_norm_parallel", "_rope_split_parallel", "_silu_mul_parallel"],
                                       SMALL_ROWS_PARALLEL_FROM) if num_tokens >= rows]
    assert len(want) >= 2 and sorted(set(ran)) == want
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(serial, parallel):
        assert torch.equal(a.view(bits), b.view(bits))
    assert spinning.parallel_small_rows(False) is False
    ran.clear()
    outputs(spinning)
    assert ran == []
