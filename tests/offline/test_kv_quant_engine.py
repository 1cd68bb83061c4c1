"""A whole tiny model served over quantized KV blocks (``--kv-cache-dtype int8|fp8_e4m3``):

- greedy outputs agree with the unquantized (``auto``) cache on most tokens (not all: quantized K/V
  move the logits a little and a random tiny model's next-token distribution is flat), and prompt
  logprobs stay within a bound of transformers' float32 ones;
- preemption (recompute and swap under a small pool), prefix-cache hits and n > 1 (copy-on-write of
  the partial block) give exactly the output of the same quantized run without them: swaps and
  copies move the same bytes and scales, and a recomputed or cached prefix is the same tokens
  quantized the same way;
- the pool: the same memory holds about 4x the blocks of a float32 cache.
"""

from __future__ import annotations

import pytest
import torch

from services.executor.loader import RunnerOptions, plan_runner
from tests.doubles.engine import InProcessEngine, tiny_llama
from tests.offline.test_parallel_sampling import _choices
from tests.offline.test_preemption import _workload
from tests.offline.test_prompt_logprobs import hf_logprobs, prompt_of, scored

FORMATS = ("int8", "fp8_e4m3")
# Share of greedy tokens (over 12 requests x 20-45 tokens, position by position) equal to the
# unquantized cache's, at least; measured on this tiny model: int8 0.90, fp8_e4m3 0.68 (a flat
# distribution: once one token differs the rest of that sequence usually does too).
MIN_AGREEMENT = {"int8": 0.8, "fp8_e4m3": 0.5}
# |logprob - transformers' float32 logprob| at most, every prompt position. Measured: int8 0.0017,
# fp8_e4m3 0.0104; the bound is about 5x that: an 8-bit K/V element is off by up to half a step (int8:
# 1/254 of its row's largest value; e4m3: 1/16 relative), which moves scores and outputs by about
# that relative amount and a logprob by a small multiple of it through two layers.
MAX_LOGPROB_ERROR = {"int8": 0.01, "fp8_e4m3": 0.05}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def _run(model, prompts, max_new, **engine_kwargs):
    engine = InProcessEngine(model, block_size=4, **engine_kwargs)
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert engine.add(f"r{i}", p, temperature=0.0, max_tokens=m, ignore_eos=True) == []
    return engine, engine.run()


@pytest.fixture(scope="module")
def unpressured(model):
    """Each format's greedy tokens with a pool large enough for everything (numba backend)."""
    prompts, max_new = _workload()
    return prompts, max_new, {fmt: _run(model, prompts, max_new, num_blocks=512, backend="numba",
                                        kv_cache_dtype=fmt)[1] for fmt in ("auto", *FORMATS)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_output_agrees_with_the_unquantized_cache(unpressured, fmt):
    _, _, runs = unpressured
    auto, quant = runs["auto"], runs[fmt]
    total = sum(len(t) for t in auto.values())
    same = sum(a == b for r in auto for a, b in zip(auto[r], quant[r]))
    print(f"{fmt}: {same}/{total} = {same / total:.3f} of greedy tokens equal to auto's")
    assert same / total >= MIN_AGREEMENT[fmt]
    assert same < total  # the cache is quantized: some token differs


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_logprobs_close_to_transformers(model, fmt):
    prompts = [prompt_of(n, seed) for n, seed in ((37, 1), (22, 2))]
    engine = InProcessEngine(model, num_blocks=64, block_size=4, backend="numba", kv_cache_dtype=fmt)
    for i, p in enumerate(prompts):
        engine.add(f"p{i}", p, temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine.run()
    worst = 0.0
    for i, p in enumerate(prompts):
        want = hf_logprobs(model, p)[:-1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
        got = torch.tensor(scored(engine.outputs[f"p{i}"]).prompt_logprobs)
        worst = max(worst, float((got - want).abs().max()))
    print(f"{fmt}: prompt logprobs within {worst:.4f} of transformers' float32")
    assert 0 < worst <= MAX_LOGPROB_ERROR[fmt]


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_quantized_output(model, unpressured, mode, backend):
    prompts, max_new, runs = unpressured
    engine, tokens = _run(model, prompts, max_new, num_blocks=40, preemption_mode=mode, backend=backend,
                          num_cpu_blocks=64 if mode == "swap" else 0, kv_cache_dtype="int8")
    stats = engine.scheduler.stats
    assert (stats.num_swap_outs if mode == "swap" else stats.num_recomputes) > 0
    assert tokens == runs["int8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_hits_and_forks_give_the_same_output(model, fmt):
    prefix = prompt_of(13, 9)
    prompts = [prefix + prompt_of(2, s) for s in (10, 11)]  # 15 tokens: 3 full blocks and a partial one
    outputs = {}
    for caching in (False, True):
        engine = InProcessEngine(model, num_blocks=64, block_size=4, backend="numba", kv_cache_dtype=fmt,
                                 enable_prefix_caching=caching)
        copies, execute = [], engine.execute
        engine.execute = lambda step: copies.append(len(step.block_copies)) or execute(step)
        engine.add("a", prompts[0], temperature=0.0, max_tokens=8, ignore_eos=True)
        engine.run()
        engine.add("b", prompts[1], temperature=0.0, max_tokens=8, ignore_eos=True, n=3)  # forks: CoW
        engine.run()
        assert (engine.blocks.num_hit_tokens > 0) == caching
        assert engine.blocks.num_used_blocks == 0 and sum(copies) >= 2  # two forks copied the partial block
        outputs[caching] = _choices(engine, "a"), _choices(engine, "b")
    single, forked = outputs[True]
    assert len(forked) == 3 and forked[0] == forked[1] == forked[2]
    assert outputs[True] == outputs[False]


def test_the_pool_holds_about_4x_the_blocks_of_float32(model):
    plans = {fmt: plan_runner(model.config, RunnerOptions(dtype=torch.float32, kv_cache_memory="4MiB",
                                                         kv_cache_dtype=fmt, swap_space=0))
             for fmt in ("auto", "int8")}
    head_dim = model.config.head_dim  # 16: 64 bytes a row in float32, 16 + a 4-byte scale in int8
    assert plans["int8"].block_bytes * (4 * head_dim) == plans["auto"].block_bytes * (head_dim + 4)
    assert plans["int8"].num_blocks == (4 * 2**20) // plans["int8"].block_bytes
    assert plans["int8"].num_blocks >= 3 * plans["auto"].num_blocks


def test_llm_takes_the_option_and_refuses_a_bad_one(model):
    from services.offline import LLM
    from shared.messages import SamplingParams

    llm = LLM.from_hf_model(model, dtype=torch.float32, num_kv_blocks=32, block_size=4, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_cache_dtype == "int8"
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].choices[0].token_ids) == 4
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, int8, fp8_e4m3"):
        LLM.from_hf_model(model, dtype=torch.float32, num_kv_blocks=32, kv_cache_dtype="fp8_e5m2")
