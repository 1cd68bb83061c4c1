"""SmolLM2-135M-Instruct (the embedded default model): greedy tokens equal transformers'."""

import pytest
import torch

from tests.doubles.engine import InProcessEngine, smollm2_greedy_reference

pytestmark = pytest.mark.slow

MAX_NEW = 40
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_greedy_reference(PROMPTS, MAX_NEW, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_smollm2_greedy_matches_transformers(smollm2, backend):
    if backend == "numba":
        pytest.importorskip("kernels.cpu")
    tok, model, prompts, refs = smollm2
    engine = InProcessEngine(model, num_blocks=64, block_size=16, backend=backend, max_model_len=512)
    for i, ids in enumerate(prompts):
        engine.add(f"r{i}", ids, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = engine.run()
    for i, ref in enumerate(refs):
        assert got[f"r{i}"] == ref, f"prompt {i}: {tok.decode(got[f'r{i}'])!r} != {tok.decode(ref)!r}"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


COPY_PROMPT = ("Repeat this exactly: the quick brown fox jumps over the lazy dog; the quick brown fox jumps "
               "over the lazy dog; the quick brown fox")


def test_smollm2_greedy_with_speculation_matches_transformers(smollm2):
    """Speculative decoding (ngram) on SmolLM2 in float32, the numba kernels: transformers' tokens on
    the same prompts and on a copy-heavy one, with drafts accepted and rejected."""
    import json

    from tests.doubles.engine import hf_greedy

    tok, model, prompts, refs = smollm2
    copy_ids = tok(COPY_PROMPT)["input_ids"]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    engine = InProcessEngine(model, num_blocks=64, block_size=16, backend="numba", max_model_len=512,
                             speculative_config=spec)
    for i, ids in enumerate([*prompts, copy_ids]):
        engine.add(f"r{i}", ids, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = engine.run()
    for i, ref in enumerate([*refs, hf_greedy(model, copy_ids, MAX_NEW)]):
        assert got[f"r{i}"] == ref, f"prompt {i}: {tok.decode(got[f'r{i}'])!r} != {tok.decode(ref)!r}"
    stats = engine.scheduler.stats
    assert 0 < sum(stats.spec_accepted) < sum(stats.spec_proposed)
