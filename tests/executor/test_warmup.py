"""The executor's warm-up (``services/executor/warmup.py``): it runs, leaves the runner with no
sequence, changes no later output although it wrote into the pool's first blocks, and reaches the
kernels that only long prompts, long contexts, copy-on-write and swaps would otherwise reach first."""

import pytest
import torch

from kernels.cpu import activation, cache_ops, decode, decode_qkv, norm, rotary, rows_plan
from services.executor.warmup import WARMUP_SEQ_IDS, warm_up, warmup_steps
from tests.doubles.engine import InProcessEngine, tiny_llama

PROMPTS = {"a": [5, 9, 14, 3, 7, 22, 8], "b": list(range(30, 71)), "c": [11] * 19}


def greedy_outputs(engine: InProcessEngine) -> dict[str, list[int]]:
    for request_id, prompt in PROMPTS.items():
        engine.add(request_id, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
    return engine.run()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_leaves_no_trace(dtype):
    hf = tiny_llama(seed=5)
    cold = InProcessEngine(hf, num_blocks=64, block_size=4, backend="numba", dtype=dtype)
    warm = InProcessEngine(hf, num_blocks=64, block_size=4, backend="numba", dtype=dtype)
    before = [c.clone() for layer in warm.runner.kv_caches for c in layer]
    assert warm_up(warm.runner) == 3
    after = [c for layer in warm.runner.kv_caches for c in layer]
    assert any(not torch.equal(x, y) for x, y in zip(before, after))  # it did write into the pool
    runner = warm.runner
    assert len(runner.histories) == 0 and len(runner.sampler) == 0
    assert not any(seq_id in runner.histories for seq_id in WARMUP_SEQ_IDS)
    expected = greedy_outputs(cold)
    assert greedy_outputs(warm) == expected
    assert all(len(tokens) == 12 for tokens in expected.values())


def test_steps_fit_the_pool_and_the_model_length():
    steps = warmup_steps(block_size=16, num_blocks=100, max_model_len=2048, vocab_size=1000)
    prefill, decode, free = steps
    assert prefill.num_decodes == 0 and len(prefill.input_token_ids) == prefill.query_start_loc[-1]
    assert decode.num_decodes == 2 and list(decode.context_lens) == [n + 1 for n in prefill.context_lens]
    assert free.finished_seq_ids == list(WARMUP_SEQ_IDS) and len(free.seq_ids) == 0
    slots = set(prefill.slot_mapping.tolist()) | set(decode.slot_mapping.tolist())
    assert len(slots) == len(prefill.slot_mapping) + len(decode.slot_mapping)  # no slot written twice
    assert max(slots) < 100 * 16
    short = warmup_steps(block_size=16, num_blocks=100, max_model_len=20, vocab_size=1000)
    assert max(short[1].context_lens) <= 20
    assert warmup_steps(block_size=16, num_blocks=3, max_model_len=2048, vocab_size=1000) == []


# (module, kernel) that a step reaches only at a long prefill chunk (the per-layer ops' parallel
# variants), a long context at a small batch (partitioned decode), a decode batch with more work
# than the warm-up's (the fused decode's parallel kernel), copy-on-write or a swap
RARE_KERNELS = [(norm, "_add_rms_norm_parallel"), (rotary, "_rope_split_parallel"),
                (activation, "_silu_mul_parallel"), (decode, "_rows_partitioned_kernel"),
                (decode_qkv, "_qkv_kernel"), (cache_ops, "_copy_rows_kernel")]


@pytest.mark.parametrize("dtype,max_model_len", [(torch.float32, 8192), (torch.bfloat16, 8192),
                                                 (torch.bfloat16, 4096)])
def test_warm_up_reaches_the_rare_kernels(dtype, max_model_len, monkeypatch):
    """Each kernel a step may reach but the warm-up steps do not, once; the partitioned decode
    only where a context can be longer than a partition (``rows_plan.MIN_PARTITION_SIZE``)."""
    engine = InProcessEngine(tiny_llama(seed=5, max_position_embeddings=max_model_len), num_blocks=64,
                             block_size=4, backend="numba", dtype=dtype, max_model_len=max_model_len)
    called = []
    for module, name in RARE_KERNELS:
        def record(*args, _name=name, _kernel=getattr(module, name)):
            called.append(_name)
            return _kernel(*args)
        monkeypatch.setattr(module, name, record)
    warm_up(engine.runner)
    expected = {name for _, name in RARE_KERNELS}
    if engine.runner.model.model.layers[0].mlp.as_transformers(dtype):  # float32 exactness mode:
        expected.discard("_silu_mul_parallel")  # transformers' silu and mul, no fused activation
    if max_model_len <= rows_plan.MIN_PARTITION_SIZE:
        expected.discard("_rows_partitioned_kernel")
    assert engine.runner.max_model_len == max_model_len
    assert set(called) == expected
