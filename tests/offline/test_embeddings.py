"""Embedding requests in the engine (``SamplingParams.pooling``, prefill-only): the pooled vector
equals transformers' final hidden states (the base model's ``last_hidden_state``, after the final
norm) pooled the same way, however the prompt is prefilled (whole, in chunks across several
blocks, beside other requests, beside generation, after a recompute preemption, after prefix-cache
hits), and the blocks are free once it is done."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.doubles.engine import InProcessEngine, hf_greedy, tiny_llama
from tests.doubles.families import random_prompts, tiny_family

TOLERANCE = 1e-5  # normalized vectors, float32


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return tiny_llama(seed=3) if request.param == "llama" else tiny_family("qwen3", seed=3)


def reference(model, prompt: list[int], pooling: str) -> np.ndarray:
    """transformers' pooled, L2-normalized final hidden state."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


def embedding(engine: InProcessEngine, request_id: str) -> np.ndarray:
    carrying = [o for o in engine.outputs[request_id] if len(o.embedding)]
    assert len(carrying) == 1 and carrying[0].request_finished and carrying[0].new_token_ids == []
    vec = np.frombuffer(carrying[0].embedding, "<f4").astype(np.float64)
    return (vec / np.linalg.norm(vec)).astype(np.float32)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_batched_embeddings_equal_transformers(model, pooling):
    # 4-token blocks and 16-token steps: the 45-token prompt spans 12 blocks and at least 3 chunks
    engine = InProcessEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompts = random_prompts([45, 7, 1, 30], seed=11)
    for i, prompt in enumerate(prompts):
        engine.add(f"e{i}", prompt, max_tokens=0, pooling=pooling)
    engine.run()
    for i, prompt in enumerate(prompts):
        np.testing.assert_allclose(embedding(engine, f"e{i}"), reference(model, prompt, pooling), atol=TOLERANCE, rtol=0)
    assert engine.blocks.num_used_blocks == 0 and engine.blocks.num_cached_blocks > 0  # freed, kept for the cache


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_alone_equals_in_a_batch_and_beside_generation(model, async_scheduling):
    prompts = random_prompts([37, 20, 12], seed=5)
    alone = InProcessEngine(model, num_blocks=64, block_size=4)
    alone.add("e", prompts[0], max_tokens=0, pooling="mean")
    alone.run()
    mixed = InProcessEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=12,
                            async_scheduling=async_scheduling)
    mixed.add("g0", prompts[1], temperature=0.0, max_tokens=8, ignore_eos=True)
    mixed.step()
    mixed.step()  # g0 decodes while the embeddings prefill in chunks
    mixed.add("e", prompts[0], max_tokens=0, pooling="mean")
    mixed.add("e_last", prompts[2], max_tokens=0, pooling="last")
    mixed.run()
    np.testing.assert_allclose(embedding(mixed, "e"), embedding(alone, "e"), atol=1e-6, rtol=0)
    np.testing.assert_allclose(embedding(mixed, "e_last"), reference(model, prompts[2], "last"), atol=TOLERANCE, rtol=0)
    assert [t for o in mixed.outputs["g0"] for t in o.new_token_ids] == hf_greedy(model, prompts[1], 8)
    assert mixed.mixed_steps > 0


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=3)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_cache_hits_and_preemption_keep_the_vector(llama, pooling, async_scheduling):
    model = llama  # one family: the scheduler's part is the same for all
    prompt = random_prompts([40], seed=9)[0]
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    engine.add("first", prompt, max_tokens=0, pooling=pooling)
    engine.run()
    engine.add("again", prompt, max_tokens=0, pooling=pooling)  # its blocks are in the prefix cache
    engine.run()
    want = reference(model, prompt, pooling)
    np.testing.assert_allclose(embedding(engine, "again"), want, atol=TOLERANCE, rtol=0)
    cached = max(o.num_cached_tokens for o in engine.outputs["again"])
    assert cached == (36 if pooling == "last" else 0)  # mean pooling computes every position
    # a pool too small for both: the later request is preempted (recompute) and computed again
    tight = InProcessEngine(model, num_blocks=14, block_size=4, max_num_batched_tokens=4, enable_prefix_caching=False,
                            async_scheduling=async_scheduling)
    tight.add("g", random_prompts([8], seed=2)[0], temperature=0.0, max_tokens=30, ignore_eos=True)
    tight.add("e", prompt, max_tokens=0, pooling=pooling)
    tight.run()
    np.testing.assert_allclose(embedding(tight, "e"), want, atol=TOLERANCE, rtol=0)
    assert max(o.num_preemptions for o in tight.outputs["e"]) > 0  # it was computed twice


def test_llm_embed_equals_transformers(model):
    from services.offline import LLM

    llm = LLM.from_hf_model(model, dtype=torch.float32, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = random_prompts([33, 5], seed=4)
    for pooling in ("last", "mean"):
        for got, prompt in zip(llm.embed(prompts, pooling=pooling), prompts):
            np.testing.assert_allclose(got, reference(model, prompt, pooling), atol=TOLERANCE, rtol=0)
