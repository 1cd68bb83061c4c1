"""SmolLM2-135M-Instruct (the embedded default model): greedy tokens equal transformers'."""

import pytest
import torch

from shared.model_source import resolve_model
from tests.harness import InProcessEngine

pytestmark = pytest.mark.slow

MAX_NEW = 40
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs())
    model.eval()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=None)
        refs.append(out[0, len(ids):].tolist())
        assert len(refs[-1]) == MAX_NEW
    return tok, model, prompts, refs


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
