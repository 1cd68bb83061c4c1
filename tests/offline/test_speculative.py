"""Speculative decoding (ngram) through the offline ``EngineCore``: greedy output equal to decoding
without it and to transformers' ``generate``, on prompts whose continuation repeats (proposals
accepted) and random ones (rejected); max_tokens and stop tokens exact; seeded sampling
reproducible; the pool's integrity and the prefix cache's content under preemption; the counts."""

import json

import pytest
import torch

from tests.doubles.engine import InProcessEngine, hf_greedy, tiny_llama

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
REPEATING = [5, 6, 7, 8, 9, 10, 11] * 3 + [5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def _random_prompts(seed, num, low=3, high=20):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (int(n),), generator=gen).tolist() for n in torch.randint(low, high, (num,), generator=gen)]


def _run(model, prompts, spec, max_tokens=30, check=None, **kwargs):
    engine = InProcessEngine(model, speculative_config=spec, **kwargs)
    for i, p in enumerate(prompts):
        assert engine.add(f"r{i}", p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True) == []
    tokens = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if check is not None:
            check(engine)
    return engine, [tokens[f"r{i}"] for i in range(len(prompts))]


def _counts_consistent(stats):
    proposed, accepted = stats.spec_proposed, stats.spec_accepted
    assert all(a <= p for a, p in zip(accepted, proposed))
    assert all(x >= y for x, y in zip(proposed, proposed[1:])) and all(x >= y for x, y in zip(accepted, accepted[1:]))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_greedy_equals_plain_decoding_and_transformers(model, backend):
    prompts = [REPEATING, *_random_prompts(1, 3)]
    _, plain = _run(model, prompts, None, backend=backend)
    engine, spec = _run(model, prompts, SPEC, backend=backend)
    assert spec == plain
    assert spec == [hf_greedy(model, p, 30) for p in prompts]
    stats = engine.scheduler.stats
    proposed, accepted = sum(stats.spec_proposed), sum(stats.spec_accepted)
    assert 0 < accepted < proposed  # some proposals held, some were rolled back
    _counts_consistent(stats)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_fewer_steps_on_a_repeating_continuation(model):
    plain_engine, plain = _run(model, [REPEATING], None, max_tokens=40)
    engine, spec = _run(model, [REPEATING], SPEC, max_tokens=40)
    assert spec == plain
    assert engine.num_steps < plain_engine.num_steps


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_is_exact(model, max_tokens):
    engine, (tokens,) = _run(model, [REPEATING], SPEC, max_tokens=max_tokens)
    assert tokens == hf_greedy(model, REPEATING, max_tokens)
    assert engine.outputs["r0"][-1].finish_reason == "length"


def test_a_stop_token_ends_it_where_plain_decoding_does(model):
    _, (plain,) = _run(model, [REPEATING], None, max_tokens=30)
    stop = plain[12]  # a token of the continuation: it ends at its first occurrence
    outs = {}
    for spec in (None, SPEC):
        engine = InProcessEngine(model, speculative_config=spec)
        engine.add("r", REPEATING, temperature=0.0, max_tokens=30, stop_token_ids=[stop])
        outs[spec] = (engine.run()["r"], engine.outputs["r"][-1].finish_reason)
    assert outs[SPEC] == outs[None] == (plain[:plain.index(stop) + 1], "stop")


def test_seeded_sampling_is_reproducible(model):
    runs = []
    for _ in range(2):
        engine = InProcessEngine(model, speculative_config=SPEC)
        for i, p in enumerate([REPEATING, REPEATING[3:]]):
            engine.add(f"r{i}", p, temperature=0.02, top_p=0.9, seed=11 + i, max_tokens=30, ignore_eos=True)
        runs.append(engine.run())
        assert sum(engine.scheduler.stats.spec_accepted) > 0
    assert runs[0] == runs[1]


def test_requests_that_decode_without_it_give_the_same_answers(model):
    """Logprobs and penalties decode without speculation beside one that speculates; n > 1 samples
    speculate each."""
    outs = {}
    for spec in (None, SPEC):
        engine = InProcessEngine(model, speculative_config=spec)
        engine.add("lp", REPEATING, temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        engine.add("pen", REPEATING, temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
        engine.add("n2", REPEATING, temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
        engine.add("plain", REPEATING, temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.run()
        tokens = {(o.request_id, o.choice_idx): [] for outs in engine.outputs.values() for o in outs}
        for o in (o for outs in engine.outputs.values() for o in outs):
            tokens[o.request_id, o.choice_idx] += o.new_token_ids
        logprobs = [o.logprobs for o in engine.outputs["lp"]]
        outs[spec] = (tokens, logprobs, sorted(o.choice_idx for o in engine.outputs["n2"] if o.finish_reason))
    assert outs[SPEC][0] == outs[None][0]
    assert outs[SPEC][1] == outs[None][1]
    assert outs[SPEC][2] == [0, 1]


def _cache_holds_known_tokens_only(engine):
    """Every block with a registered hash, in a running sequence's table, hashes that sequence's
    known tokens (never a draft that was not accepted)."""
    blocks = engine.blocks
    for seq in engine.scheduler.running:
        for i, block_id in enumerate(blocks.block_tables.get(seq.seq_id, ())):
            if blocks.block_hashes[block_id] is not None:
                assert (i + 1) * blocks.block_size <= seq.num_tokens
                assert blocks.block_hashes[block_id] == blocks.prefix_hashes(seq.token_ids, i + 1)[-1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching_keep_the_pool_whole(model, mode):
    shared = REPEATING[:12]
    prompts = [shared + p for p in _random_prompts(5, 6)] + [REPEATING, REPEATING[2:]]
    kwargs = dict(num_blocks=36, block_size=4, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    _, plain = _run(model, prompts, None, max_tokens=40, **kwargs)
    engine, spec = _run(model, prompts, SPEC, max_tokens=40, check=_cache_holds_known_tokens_only, **kwargs)
    assert spec == plain
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and sum(stats.spec_accepted) > 0
    assert engine.blocks.num_queried_tokens and engine.blocks.num_hit_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    _counts_consistent(stats)


def test_async_scheduling_with_speculation_gives_the_same_tokens(model):
    """Async scheduling goes lock-step while a sequence would propose, and on while speculation is
    paused (random prompts: proposals rejected) or a request cannot speculate."""
    prompts = [REPEATING, *_random_prompts(2, 2)]
    _, plain = _run(model, prompts, None, max_tokens=40)
    engine, spec = _run(model, prompts, SPEC, max_tokens=40, async_scheduling=True)
    assert spec == plain
    assert sum(engine.scheduler.stats.spec_accepted) > 0
