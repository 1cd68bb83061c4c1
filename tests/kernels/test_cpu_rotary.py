"""The fused rotary + q/k/v split (kernels/cpu/rotary.py, behind ``RotaryEmbedding`` on CPU)
against the torch form (``x * cos + rotate_half(x) * sin``): bit for bit, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import NumbaCPUBackend
from kernels.cpu.rotary import PARALLEL_FROM_ROWS
from services.executor.layers import RotaryEmbedding, _rotate_half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 70, PARALLEL_FROM_ROWS + 3])  # the last: the parallel kernel
def test_fused_rope_split_is_bit_identical(dtype, num_tokens):
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    g = torch.Generator().manual_seed(num_tokens)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    cos, sin = rotary.at(positions, dtype)
    qkv = (4 * torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)).to(dtype)
    backend = NumbaCPUBackend()
    assert backend.rope_split(qkv, cos, sin, num_heads, num_kv_heads) is not None  # the kernel runs
    q, k, v = rotary(qkv, cos, sin, num_heads, num_kv_heads, backend)

    x = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    want = x * cos + _rotate_half(x) * sin
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(q, want[:, :num_heads]) and torch.equal(k, want[:, num_heads:])
    assert torch.equal(v, qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim))
    # the torch form (no backend, or a strided qkv) gives the same bits
    strided = torch.stack([qkv, qkv], dim=-1)[..., 0]
    assert backend.rope_split(strided, cos, sin, num_heads, num_kv_heads) is None
    for got, expected in zip(rotary(strided, cos, sin, num_heads, num_kv_heads, backend), (q, k, v)):
        assert torch.equal(got, expected)
