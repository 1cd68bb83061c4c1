"""The numba backend's view of one forward pass (``kernels/cpu/pass_view.py``): the same bits as
the backend's own methods, serial and parallel, float32 and bfloat16; the backend's methods for
tensors the pass did not check; the backend itself for float16. And the model's modules, which
call ``forward`` directly where no hook is registered (``services/executor/module.py``)."""

from __future__ import annotations

import numba
import pytest
import torch

from kernels.cpu import NumbaCPUBackend
from kernels.cpu.pass_view import ForwardPass
from services.executor.attention import AttentionMetadata
from services.executor.layers import RotaryEmbedding
from services.executor.module import Linear, Module

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # shapes the fused decode's own tests compile already


def _step(num_seqs, dtype, seed):
    """A decode step's tensors: the residual stream and a delta, a norm weight, a fused gate/up
    output, a qkv projection, pools, rotary tables and metadata (ragged contexts)."""
    g = torch.Generator().manual_seed(seed)
    hidden = 96
    stream = [torch.randn(num_seqs, hidden, generator=g).to(dtype) for _ in range(2)]
    weight = torch.randn(hidden, generator=g).to(dtype)
    gate_up = torch.randn(num_seqs, 2 * 80, generator=g).to(dtype)
    ctx = torch.randint(1, 120, (num_seqs,), generator=g).to(torch.int32)
    max_blocks = 8
    tables = torch.randperm(num_seqs * max_blocks + 2, generator=g)[:num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).to(torch.int32).contiguous()
    pos = (ctx - 1).long()
    slots = tables[torch.arange(num_seqs), pos // BLOCK].long() * BLOCK + pos % BLOCK
    pools = [torch.randn(num_seqs * max_blocks + 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
             for _ in range(2)]
    qkv = torch.randn(num_seqs, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    rope = RotaryEmbedding(HEAD_DIM, 128, 10000.0).at(pos, dtype)
    meta = AttentionMetadata(
        num_decodes=num_seqs, num_decode_tokens=num_seqs, slot_mapping=slots, block_tables=tables,
        context_lens=ctx, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32))
    return stream, weight, gate_up, qkv, pools, rope, meta


def _layer_calls(backend, stream, weight, gate_up, qkv, pools, rope, meta):
    """What a decoder layer asks of the backend, on copies: the outputs, the stream, the pools."""
    residual, delta = stream[0].clone(), stream[1]
    kc, vc = pools[0].clone(), pools[1].clone()
    first = backend.add_rms_norm(residual, residual[:0], weight, 1e-5)  # the first layer: no add
    second = backend.add_rms_norm(residual, delta, weight, 1e-6)
    attn = backend.decode_qkv(qkv, *rope, kc, vc, meta.slot_mapping, meta.decode_block_tables,
                              meta.decode_context_lens, 0.125, HEADS)
    return [first, second, residual, attn, backend.silu_mul(gate_up), kc, vc]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs, small_rows", [(3, False), (64, True)])  # serial; parallel kernels
def test_the_pass_gives_the_backends_bits(dtype, num_seqs, small_rows, monkeypatch):
    step = _step(num_seqs, dtype, seed=num_seqs)
    torch_before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(2)
    try:
        backend = NumbaCPUBackend(matmul_prefill_path=False, idle_threads_spin=lambda: small_rows)
        assert backend.parallel_small_rows(small_rows) is small_rows
        want = _layer_calls(backend, *step)
        view = backend.for_pass(step[-1], step[-2], num_seqs, dtype)
        assert isinstance(view, ForwardPass)
        ran = []
        for name in ("add_rms_norm", "silu_mul", "decode_qkv"):  # the pass's own kernels, not these
            monkeypatch.setattr(backend, name, lambda *a, name=name: ran.append(name))
        got = _layer_calls(view, *step)
        serial = backend.decode_plan(step[-1].decode_block_tables, step[-1].decode_context_lens, step[4][0], 2).serial
    finally:
        torch.set_num_threads(torch_before)
        numba.set_num_threads(numba_before)
    assert ran == [] and serial == (not small_rows)  # both decode kernels are covered
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(want, got):
        assert a is not None and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))
    assert view.prefill_kind() == backend.prefill_kind()  # the rest is the backend's


def test_what_the_pass_did_not_check_goes_to_the_backend(monkeypatch):
    """Other rotary tables or metadata, a strided delta, another dtype, other rows: the backend's
    methods run (and give what they give); a float16 pass is the backend itself."""
    dtype, num_seqs = torch.float32, 3
    stream, weight, gate_up, qkv, pools, rope, meta = _step(num_seqs, dtype, seed=9)
    backend = NumbaCPUBackend(matmul_prefill_path=False)
    view = backend.for_pass(meta, rope, num_seqs, dtype)
    asked = []
    for name in ("add_rms_norm", "silu_mul", "decode_qkv"):
        method = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, name=name, method=method: (asked.append(name), method(*a))[1])
    kc, vc = pools[0].clone(), pools[1].clone()
    other_rope = tuple(t.clone() for t in rope)
    assert view.decode_qkv(qkv, *other_rope, kc, vc, meta.slot_mapping, meta.decode_block_tables,
                           meta.decode_context_lens, 0.125, HEADS) is not None
    assert view.decode_qkv(qkv, *rope, kc, vc, meta.slot_mapping.clone(), meta.decode_block_tables,
                           meta.decode_context_lens, 0.125, HEADS) is not None
    assert view.decode_qkv(qkv.double(), *rope, kc, vc, meta.slot_mapping, meta.decode_block_tables,
                           meta.decode_context_lens, 0.125, HEADS) is None  # the backend declines it too
    assert view.decode_qkv(qkv, *rope, kc, vc, meta.slot_mapping, meta.decode_block_tables,
                           meta.decode_context_lens, 0.125, HEADS) is not None  # the pass's own kernel
    with pytest.raises(ValueError):  # then a projection of another width: the backend's error, no read past it
        view.decode_qkv(qkv[:, :-HEAD_DIM].contiguous(), *rope, kc, vc, meta.slot_mapping,
                        meta.decode_block_tables, meta.decode_context_lens, 0.125, HEADS)
    strided = torch.stack([stream[1], stream[1]], dim=-1)[..., 0]
    residual = stream[0].clone()
    assert view.add_rms_norm(residual, strided, weight, 1e-5) is None  # declined: not contiguous
    assert view.add_rms_norm(residual[:2].contiguous(), stream[1][:2], weight, 1e-5) is not None
    assert view.silu_mul(gate_up.bfloat16()) is not None
    assert asked == ["decode_qkv"] * 4 + ["add_rms_norm"] * 2 + ["silu_mul"]
    assert backend.for_pass(meta, rope, num_seqs, torch.float16) is backend


class _Doubler(Module):
    def forward(self, x):
        return 2 * x


def test_modules_call_forward_and_run_their_own_hooks():
    module, linear = _Doubler(), Linear(3, 2, bias=False)
    assert isinstance(linear, torch.nn.Linear) and linear.weight.shape == (2, 3)
    calls = []
    module.forward = lambda x: (calls.append(x), 3 * x)[1]  # an instance's forward is the one called
    assert module(torch.ones(1)).item() == 3 and len(calls) == 1
    seen = []
    handle = linear.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    x = torch.ones(4, 3)
    assert torch.equal(linear(x), x @ linear.weight.T) and seen == [(4, 2)]
    handle.remove()
    linear(x)
    assert seen == [(4, 2)]
