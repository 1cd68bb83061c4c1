"""Logits processing through the whole engine (scheduler + runner), against Hugging Face's processors.

Greedy decoding with a repetition penalty, a logit bias or min_tokens must give what
``transformers``' ``generate`` gives with the same processor, also when prompts are prefilled in
chunks and sequences are preempted (recompute) and prefilled again: the sampler's token history
must survive both. Logprobs travel back to the frontend's deltas, one per token.
"""

from __future__ import annotations

import pytest
import torch

from tests.doubles.engine import InProcessEngine, tiny_llama

PROMPT_LENGTHS = [3, 9, 14, 6, 11, 17]
MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **({"eos_token_id": None} | kwargs))
    return out[0, len(prompt):].tolist()


def pressured_engine(model) -> InProcessEngine:
    """Few blocks and a small token budget: chunked prefills and recompute preemptions."""
    return InProcessEngine(model, num_blocks=24, block_size=4, max_num_batched_tokens=8)


def test_repetition_penalty_matches_transformers_through_chunks_and_preemption(model, prompts):
    engine = pressured_engine(model)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    got = engine.run()
    assert engine.scheduler.stats.num_preemptions > 0, "the pool should have forced a preemption"
    for i, p in enumerate(prompts):
        want = hf_generate(model, p, MAX_NEW, repetition_penalty=1.8)
        assert got[f"r{i}"] == want, f"request {i}"
    assert got["r0"] != hf_generate(model, prompts[0], MAX_NEW)  # the penalty did change something


def test_logit_bias_matches_transformers_sequence_bias(model, prompts):
    engine = InProcessEngine(model, num_blocks=128, block_size=4)
    bias = {7: 4.0, 9: -50.0, 11: 2.5}
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                   logit_bias_token_ids=list(bias), logit_bias_values=list(bias.values()))
    got = engine.run()
    for i, p in enumerate(prompts):
        want = hf_generate(model, p, MAX_NEW, sequence_bias={(t,): b for t, b in bias.items()})
        assert got[f"r{i}"] == want, f"request {i}"
    forced = InProcessEngine(model, num_blocks=128, block_size=4)
    forced.add("f", prompts[0], temperature=0.8, seed=1, max_tokens=8, ignore_eos=True,
               logit_bias_token_ids=[42], logit_bias_values=[100.0])
    assert forced.run()["f"] == [42] * 8


def test_min_tokens_holds_back_eos_like_transformers(model, prompts):
    prompt = prompts[2]
    free = hf_generate(model, prompt, MAX_NEW)
    stop_at = next(i for i in range(2, MAX_NEW) if free[i] not in free[:i])
    eos = free[stop_at]  # greedy would stop there, after at least two other tokens
    assert stop_at < 9
    engine = pressured_engine(model)
    engine.add("plain", prompt, eos=[eos], temperature=0.0, max_tokens=MAX_NEW)
    engine.add("min", prompt, eos=[eos], temperature=0.0, max_tokens=MAX_NEW, min_tokens=10, eos_token_ids=[eos])
    got = engine.run()
    assert got["plain"] == free[:stop_at + 1]
    want = hf_generate(model, prompt, MAX_NEW, eos_token_id=eos, min_new_tokens=10)
    assert got["min"] == want and len(want) >= 10 and eos not in want[:10]


def test_logprobs_reach_the_deltas(model, prompts):
    engine = InProcessEngine(model, num_blocks=128, block_size=4, max_num_batched_tokens=8)
    engine.add("lp", prompts[2], temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    engine.add("none", prompts[3], temperature=0.0, max_tokens=6, ignore_eos=True)
    got = engine.run()
    outputs = engine.outputs["lp"]
    assert all(len(o.logprobs) == len(o.new_token_ids) == len(o.top_token_ids) == 1 for o in outputs)
    assert all(not o.logprobs and not o.top_token_ids for o in engine.outputs["none"])
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    for out, token, hf_logits in zip(outputs, got["lp"], hf.logits):
        ref = torch.log_softmax(hf_logits[0].float(), -1)
        assert out.top_token_ids[0] == torch.topk(ref, 3).indices.tolist()
        assert out.top_token_ids[0][0] == token  # greedy: the sampled token is the most likely
        assert out.logprobs[0] == pytest.approx(ref[token].item(), abs=1e-4)
        assert out.top_logprobs[0] == pytest.approx(torch.topk(ref, 3).values.tolist(), abs=1e-4)


def test_penalty_sees_prefix_cached_and_forked_tokens(model, prompts):
    """The prompt's cached blocks were computed for another request, and the second sample of an
    n=2 request joins with no token of its own: both must still count every prompt token."""
    engine = InProcessEngine(model, num_blocks=128, block_size=4)
    prompt = prompts[5]  # 17 tokens: 4 full blocks
    engine.add("warm", prompt, temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.run()
    engine.add("r", prompt, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2, repetition_penalty=1.8,
               presence_penalty=0.5)
    engine.run()
    outputs = engine.outputs["r"]
    assert max(o.num_cached_tokens for o in outputs) >= 16, "the prompt should come from the prefix cache"
    choices = {c: [t for o in outputs if o.choice_idx == c for t in o.new_token_ids] for c in (0, 1)}
    # transformers has no presence penalty: check the repetition penalty alone, then both together.
    want = hf_generate(model, prompt, MAX_NEW, repetition_penalty=1.8)
    engine.add("rep", prompt, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=2, repetition_penalty=1.8)
    engine.run()
    rep = engine.outputs["rep"]
    assert [t for o in rep if o.choice_idx == 0 for t in o.new_token_ids] == want
    assert [t for o in rep if o.choice_idx == 1 for t in o.new_token_ids] == want
    assert choices[0] == choices[1] != want  # greedy samples agree; the presence penalty changed them
