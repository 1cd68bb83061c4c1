"""Greedy outputs of the paged engine equal Hugging Face transformers' token for token."""

import pytest
import torch

from tests.doubles.engine import InProcessEngine, hf_greedy, tiny_llama


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_tiny_llama_batch_matches_transformers(backend):
    if backend == "numba":
        pytest.importorskip("kernels.cpu")
    model = tiny_llama(seed=1)
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 4, 5, 8, 13, 17, 30, 2, 9]  # crosses many 4-token blocks, includes multiples of 4
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    max_new = [12, 20, 7, 16, 25, 9, 14, 11, 18, 5]
    engine = InProcessEngine(model, num_blocks=128, block_size=4, backend=backend,
                             max_num_batched_tokens=48)
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        engine.add(f"r{i}", p, temperature=0.0, max_tokens=m, ignore_eos=True)
    got = engine.run()
    assert engine.mixed_steps > 0, "prefill and decode never shared a step"
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert got[f"r{i}"] == hf_greedy(model, p, m), f"request {i} (prompt length {len(p)}) differs"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_all_blocks_free_after_finish_and_abort():
    model = tiny_llama(seed=2)
    engine = InProcessEngine(model, num_blocks=40, block_size=4)
    for i in range(6):
        engine.add(f"r{i}", list(range(1, 6 + i)), temperature=0.0, max_tokens=30, ignore_eos=True)
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.scheduler.abort_request("r1")
    engine.scheduler.abort_request("r4")
    engine.blocks.check_integrity()
    got = engine.run()
    assert set(got) >= {"r0", "r2", "r3", "r5"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.scheduler.num_unfinished_requests == 0
    engine.blocks.check_integrity()
