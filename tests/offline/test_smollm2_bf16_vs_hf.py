"""SmolLM2-135M-Instruct in bfloat16: greedy tokens agree with transformers in bfloat16.

Both sides start from the same weights (the GGUF dequantized to float32 by transformers, then cast
to bfloat16) and run every matmul in bf16, but not in the same order (our flat batches give oneDNN
other shapes; our attention keeps its probabilities in float32 where SDPA rounds them to bf16), and
a bf16 result has 8 significant bits: wherever two candidate tokens' logits are within a rounding
of each other, either implementation may pick either. Free-running greedy texts then part for good
at the first such place, so agreement is scored per position under the same context:

- transformers generates 32 greedy tokens ``t_0 .. t_31`` after each of 10 prompts;
- for every position ``j`` our engine is given the prompt followed by ``t_0 .. t_{j-1}`` and
  generates one greedy token, which agrees when it equals ``t_j``;
- at least 90% of the 320 positions must agree.

For scale (measured here, 10 prompts x 32 tokens, counting each text's tokens up to its first
difference): transformers bf16 against transformers fp32 agree on 234 of 320 (73%), our bf16
against transformers bf16 on 244-246 (77%). float32 stays token-identical
(``test_smollm2_vs_hf.py``).
"""

import pytest
import torch

from tests.doubles.engine import InProcessEngine, smollm2_greedy_reference

pytestmark = pytest.mark.slow

MAX_NEW = 32
MIN_AGREEMENT = 0.90
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Here is a recipe for pancakes. Ingredients:",
    "The theory of relativity, proposed by Albert Einstein,",
    "SELECT name, age FROM users WHERE",
    "In 1969, the first humans landed on",
    "Photosynthesis is the process by which plants",
]


@pytest.fixture(scope="module")
def smollm2_bf16():
    return smollm2_greedy_reference(PROMPTS, MAX_NEW, torch.bfloat16)


def _bf16_engine(model) -> InProcessEngine:
    return InProcessEngine(model, num_blocks=512, block_size=16, backend="numba", dtype=torch.bfloat16,
                           max_model_len=512, max_num_batched_tokens=2048)


def _agreement(engine, prompts, refs) -> tuple[int, str]:
    """Positions (of ``MAX_NEW`` per prompt) where the engine, given the prompt and transformers'
    first j tokens, picks transformers' token j; and a report of where they differ."""
    for i, (ids, ref) in enumerate(zip(prompts, refs)):
        for j in range(MAX_NEW):
            engine.add(f"r{i}.{j}", ids + ref[:j], temperature=0.0, max_tokens=1, ignore_eos=True)
    got = engine.run()
    agree = [[got[f"r{i}.{j}"] == [ref[j]] for j in range(MAX_NEW)] for i, ref in enumerate(refs)]
    report = "; ".join(
        f"prompt {i}: {sum(row)}/{MAX_NEW}, differs at {[j for j, ok in enumerate(row) if not ok]}"
        for i, row in enumerate(agree))
    return sum(map(sum, agree)), report


def test_smollm2_bf16_greedy_agrees_with_transformers_bf16(smollm2_bf16):
    _, model, prompts, refs = smollm2_bf16
    engine = _bf16_engine(model)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    agreed, report = _agreement(engine, prompts, refs)
    print(f"bf16 positions agreeing with transformers bf16: {agreed}/{MAX_NEW * len(PROMPTS)} ({report})")
    assert agreed >= MIN_AGREEMENT * MAX_NEW * len(PROMPTS), report
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# Prompts of 64 tokens and more: bfloat16 prefills of that length take torch's fused attention on
# gathered K/V (``kernels/cpu/matmul_prefill.py``) where the CPU has AMX; this test turns that path
# on whatever the CPU, and checks it is taken.
LONG_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used for "
    "wine and olive oil. Books became cheaper, literacy spread across Europe, and scholars could "
    "share identical copies of a text for the first time. Within fifty years, printing shops",
    "To make a good cup of coffee at home, start with fresh beans and grind them just before "
    "brewing. Use about two tablespoons of ground coffee for every six ounces of water, and heat "
    "the water to just below boiling. Pour it slowly over the grounds, let the coffee bloom for "
    "thirty seconds, and then continue pouring in small circles until",
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort and return a new list.\"\"\"\n"
    "    if len(items) <= 1:\n        return list(items)\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n"
    "    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n",
    "Mount Everest, known in Nepali as Sagarmatha and in Tibetan as Chomolungma, is Earth's highest "
    "mountain above sea level, located in the Mahalangur Himal sub-range of the Himalayas. The "
    "China-Nepal border runs across its summit point. Its elevation of 8,848.86 metres was most "
    "recently established in 2020 by the Chinese and Nepali authorities. Climbers",
]


@pytest.fixture(scope="module")
def smollm2_bf16_long():
    return smollm2_greedy_reference(LONG_PROMPTS, MAX_NEW, torch.bfloat16)


def test_smollm2_bf16_long_prompts_through_the_matmul_prefill(smollm2_bf16_long, monkeypatch):
    from kernels.cpu import matmul_prefill
    from tests.kernels.test_cpu_matmul_prefill import _recording

    _, model, prompts, refs = smollm2_bf16_long
    assert min(map(len, prompts)) >= matmul_prefill.MIN_ROWS
    rows = _recording(monkeypatch)
    engine = _bf16_engine(model)
    engine.runner.backend.matmul_prefill_path = True
    agreed, report = _agreement(engine, prompts, refs)
    assert rows and min(rows) >= matmul_prefill.MIN_ROWS
    print(f"long prompts, bf16 positions agreeing with transformers bf16: {agreed}/"
          f"{MAX_NEW * len(LONG_PROMPTS)} ({report}); matmul prefills of {sorted(set(rows))} rows")
    assert agreed >= MIN_AGREEMENT * MAX_NEW * len(LONG_PROMPTS), report
