"""The fused decode (kernels/cpu/decode_qkv.py: rotary, cache write and attention of a decode
batch in one kernel call) against the three calls it replaces (``rope_split``, ``write_kv``,
``decode``): the same output bits and the same pools, float32 and bfloat16, ragged contexts,
grouped-query shapes, on one thread and in parallel; and the per-step plan the backend reuses."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kernels.cpu import NumbaCPUBackend
from kernels.cpu.rows_plan import MAX_SERIAL_WORK, MIN_PARTITION_SIZE
from services.executor.attention import AttentionMetadata, decode_from_qkv, paged_attention
from services.executor.layers import RotaryEmbedding

BLOCK = 16


def _batch(num_seqs, max_ctx, num_heads, num_kv_heads, head_dim, dtype, seed):
    """Pools of noise, block tables of distinct random blocks, ragged contexts that count the new
    token, its slot, a qkv projection output and the rotary tables at the new positions."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (num_seqs,), generator=g).to(torch.int32)
    ctx[0] = max_ctx
    max_blocks = -(-max_ctx // BLOCK)
    num_blocks = num_seqs * max_blocks + 3
    blocks = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    tables = blocks.to(torch.int32).contiguous()
    pos = (ctx - 1).long()
    slots = tables[torch.arange(num_seqs), pos // BLOCK].long() * BLOCK + pos % BLOCK
    pools = [torch.randn(num_blocks, num_kv_heads, BLOCK, head_dim, generator=g).to(dtype) for _ in range(2)]
    qkv = (2 * torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)).to(dtype)
    rope = RotaryEmbedding(head_dim, max_ctx + 1, 10000.0).at(pos, dtype)
    meta = AttentionMetadata(
        num_decodes=num_seqs, num_decode_tokens=num_seqs, slot_mapping=slots, block_tables=tables,
        context_lens=ctx, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32))
    return qkv, rope, pools, meta


def _three_calls(backend, qkv, rope, key_cache, value_cache, meta, num_heads, num_kv_heads, scale):
    rotary = RotaryEmbedding(rope[0].shape[-1], 2, 10000.0)  # its forward reads only the tables given
    q, k, v = rotary(qkv, *rope, num_heads, num_kv_heads, backend)
    backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    return paged_attention(backend, q, key_cache, value_cache, meta, scale, k, v)


SMOLLM2 = (9, 3, 64)  # query heads, KV heads, head_dim


# The other shapes are ones the unfused kernels' tests compile already (a cold Numba cache compiles
# each shape's kernels once, a few seconds each): one KV head per query head, and groups of 3.
@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,num_seqs,max_ctx,threads", [
    *[(dtype, *SMOLLM2, *batch) for dtype in (torch.float32, torch.bfloat16)
      for batch in ((1, 40, 1), (3, 70, 2), (24, 300, 2))],  # serial, serial (little work), parallel
    (torch.float32, 4, 4, 64, 24, 300, 2),
    (torch.bfloat16, 6, 2, 64, 24, 300, 2),
])
def test_fused_decode_equals_the_three_calls(dtype, num_heads, num_kv_heads, head_dim, num_seqs, max_ctx,
                                             threads):
    qkv, rope, (kc, vc), meta = _batch(num_seqs, max_ctx, num_heads, num_kv_heads, head_dim, dtype,
                                       seed=num_seqs * 31 + head_dim)
    scale = head_dim ** -0.5
    original_k, original_v = kc.clone(), vc.clone()
    numba_before, torch_before = numba.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(threads)  # the backend matches numba's threads to torch's
    try:
        want_k, want_v = kc.clone(), vc.clone()
        want = _three_calls(NumbaCPUBackend(), qkv, rope, want_k, want_v, meta, num_heads, num_kv_heads, scale)
        backend = NumbaCPUBackend()
        got = decode_from_qkv(backend, qkv, rope, kc, vc, meta, scale, num_heads)
        plan = backend._last_plan[3]
    finally:
        torch.set_num_threads(torch_before)
        numba.set_num_threads(numba_before)
    assert got is not None  # the fused kernel ran
    work = int(meta.context_lens.sum()) * num_kv_heads
    assert plan.serial == (threads == 1 or work <= MAX_SERIAL_WORK)  # both kernels are covered
    assert got.dtype == dtype and got.shape == (num_seqs, num_heads, head_dim)
    assert torch.equal(got, want)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # the same slots, the same bits
    # the pools changed at the step's slots and nowhere else
    for pool, original in ((kc, original_k), (vc, original_v)):
        changed = (pool != original).transpose(1, 2).reshape(-1, num_kv_heads * head_dim).any(dim=1)
        assert set(changed.nonzero().flatten().tolist()) == set(meta.slot_mapping.tolist())


def test_fused_decode_declines_what_it_does_not_take():
    """Steps with prefills, float16, strided qkv and partitioned plans (a long context at batch 1 on
    two threads) take the three calls: None, and nothing written."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    backend = NumbaCPUBackend()
    qkv, rope, (kc, vc), meta = _batch(2, 40, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=5)
    pools = kc.clone(), vc.clone()
    mixed = AttentionMetadata(num_decodes=1, num_decode_tokens=1, slot_mapping=meta.slot_mapping,
                              block_tables=meta.block_tables, context_lens=meta.context_lens,
                              query_start_loc=meta.query_start_loc,
                              prefill_query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
    assert decode_from_qkv(backend, qkv, rope, kc, vc, mixed, 0.1, num_heads) is None
    half = tuple(t.half() for t in (qkv, *rope, kc, vc))
    assert decode_from_qkv(backend, half[0], half[1:3], half[3], half[4], meta, 0.1, num_heads) is None
    strided = torch.stack([qkv, qkv], dim=-1)[..., 0]
    assert decode_from_qkv(backend, strided, rope, kc, vc, meta, 0.1, num_heads) is None
    assert torch.equal(kc, pools[0]) and torch.equal(vc, pools[1])

    long_ctx = MIN_PARTITION_SIZE + 3 * BLOCK
    qkv, rope, (kc, vc), meta = _batch(1, long_ctx, num_heads, num_kv_heads, head_dim, torch.float32, seed=6)
    pools = kc.clone(), vc.clone()
    torch_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if numba.config.NUMBA_NUM_THREADS < 2:
            pytest.skip("numba has one thread here: no partitions")  # pragma: no cover
        assert decode_from_qkv(backend, qkv, rope, kc, vc, meta, 0.1, num_heads) is None
        assert backend._last_plan[3].partition_size > 0
        assert torch.equal(kc, pools[0]) and torch.equal(vc, pools[1])
    finally:
        torch.set_num_threads(torch_before)


def test_decode_plan_is_made_once_per_step_and_follows_changed_lengths():
    """The backend's decode reuses its plan for the same metadata tensors (every layer of a step),
    but a context-length tensor changed in place gets a new one, so the output is a fresh
    backend's."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv, rope, (kc, vc), meta = _batch(5, 50, num_heads, num_kv_heads, head_dim, torch.float32, seed=7)
    q = qkv[:, :num_heads * head_dim].reshape(5, num_heads, head_dim).contiguous()
    backend = NumbaCPUBackend()
    out = torch.empty_like(q)
    backend.decode(out, q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, 0.2)
    plan = backend._last_plan[3]
    backend.decode(out, q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, 0.2)
    assert backend._last_plan[3] is plan
    meta.decode_context_lens[1] = 3  # in place
    backend.decode(out, q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, 0.2)
    assert backend._last_plan[3] is not plan
    want = torch.empty_like(q)
    NumbaCPUBackend().decode(want, q, kc, vc, meta.decode_block_tables, meta.decode_context_lens.clone(), 0.2)
    assert torch.equal(out, want)
    assert np.array_equal(backend._last_plan[3].lens[np.argsort(backend._last_plan[3].rows)],
                          meta.decode_context_lens.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_decodes_the_same_with_and_without_the_fused_kernel(dtype, monkeypatch):
    """A tiny Llama served in process on the numba backend: every decode-only step goes through
    the fused kernel, and the tokens and logprobs are those of the three calls (the kernel hidden)."""
    from tests.doubles.engine import InProcessEngine, tiny_llama

    model = tiny_llama(seed=3)
    prompts = {f"r{i}": [(7 * i + j) % 120 + 2 for j in range(3 + 5 * i)] for i in range(5)}

    def serve() -> dict[str, tuple[list[int], list[float]]]:
        engine = InProcessEngine(model, backend="numba", dtype=dtype, block_size=4)
        for rid, prompt in prompts.items():
            engine.add(rid, prompt, temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)
        engine.run()
        return {rid: ([t for o in outs for t in o.new_token_ids], [p for o in outs for p in o.logprobs])
                for rid, outs in engine.outputs.items()}

    from kernels.cpu.pass_view import ForwardPass

    calls = []
    for cls in (NumbaCPUBackend, ForwardPass):  # the model calls the backend's view of its pass
        def counted(self, *args, fused=cls.decode_qkv):
            out = fused(self, *args)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(cls, "decode_qkv", counted)
    got = serve()
    assert calls and all(calls)  # it ran in every layer of every decode-only step
    for cls in (NumbaCPUBackend, ForwardPass):
        monkeypatch.setattr(cls, "decode_qkv", lambda self, *args: None)
    want = serve()
    assert got == want
    assert all(len(tokens) == 14 for tokens, _ in got.values())
