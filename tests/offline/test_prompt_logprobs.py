"""Prompt scoring in the engine (``SamplingParams.prompt_logprobs``): every prompt position's
logprob, rank and most likely tokens equal Hugging Face's log-softmax, however the prompt is
prefilled (whole, in 16-token chunks beside other requests' decodes, again after a recompute
preemption) and whatever the prefix cache holds; ``max_tokens`` 0 scores and samples nothing."""

from __future__ import annotations

import pytest
import torch

from services.offline import LLM, Logprob
from shared.messages import RequestOutput, SamplingParams
from tests.doubles.engine import InProcessEngine, tiny_llama

TOLERANCE = 1e-4  # fp32 through a different attention path: differences are ~1e-6


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scored(outputs: list[RequestOutput]) -> RequestOutput:
    """The one output of a request that carries its prompt's scores."""
    carrying = [o for o in outputs if o.prompt_logprobs]
    assert len(carrying) == 1, f"{len(carrying)} outputs carry prompt logprobs"
    return carrying[0]


def assert_equals_transformers(model, prompt: list[int], out: RequestOutput, num_top: int) -> None:
    ref = hf_logprobs(model, prompt)[:-1]  # the last row predicts a generated token, not a prompt one
    targets = torch.tensor(prompt[1:])
    want = ref.gather(1, targets.unsqueeze(1)).squeeze(1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=TOLERANCE, rtol=0)
    # Ranks and top tokens, allowing for near ties (a random tiny model's distribution is flat):
    # the rank lies between the counts of tokens surely and possibly likelier, and the top tokens'
    # reference logprobs are the reference's top values (the ids may differ only where values tie).
    ranks = torch.tensor(out.prompt_ranks)
    assert ((ref > want.unsqueeze(1) + TOLERANCE).sum(-1) + 1 <= ranks).all()
    assert (ranks <= (ref >= want.unsqueeze(1) - TOLERANCE).sum(-1)).all()
    top = torch.topk(ref, num_top, dim=-1)
    top_ids = torch.tensor(out.prompt_top_token_ids, dtype=torch.long).reshape(top.indices.shape)
    top_logprobs = torch.tensor(out.prompt_top_logprobs).reshape(top.values.shape)
    torch.testing.assert_close(top_logprobs, top.values, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(ref.gather(1, top_ids), top.values, atol=TOLERANCE, rtol=0)


def test_whole_prompt_equals_transformers_and_generation_is_unchanged(model):
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    prompt = prompt_of(23, seed=1)
    engine.add("scored", prompt, temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=3)
    engine.add("plain", prompt, temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = engine.run()
    assert_equals_transformers(model, prompt, scored(engine.outputs["scored"]), 3)
    assert scored(engine.outputs["scored"]) is engine.outputs["scored"][0]  # on the first output
    assert tokens["scored"] == tokens["plain"] and len(tokens["scored"]) == 5
    assert not any(o.prompt_logprobs for o in engine.outputs["plain"])


def test_chunks_of_16_tokens_beside_decodes_equal_transformers(model):
    engine = InProcessEngine(model, num_blocks=128, block_size=4, max_num_batched_tokens=16)
    engine.add("decoding", prompt_of(5, seed=2), temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.step()  # it decodes while the others are prefilled chunk by chunk
    prompts = {"a": prompt_of(61, seed=3), "b": prompt_of(37, seed=4), "c": prompt_of(1, seed=5)}
    for request_id, prompt in prompts.items():
        engine.add(request_id, prompt, temperature=0.0, max_tokens=2, ignore_eos=True,
                   prompt_logprobs=2 + len(prompt) % 3)
    engine.run()
    assert engine.max_tokens_in_step <= 16 and engine.mixed_steps > 0
    for request_id in ("a", "b"):
        assert_equals_transformers(model, prompts[request_id], scored(engine.outputs[request_id]),
                                   2 + len(prompts[request_id]) % 3)
    assert not any(o.prompt_logprobs for o in engine.outputs["c"])  # one token: nothing to score


def test_a_cached_prefix_is_computed_and_scored_and_the_cache_still_fills(model):
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    shared = prompt_of(24, seed=6)
    engine.add("warm", shared + [5, 6, 7], temperature=0.0, max_tokens=1)
    engine.run()
    prompt = shared + [9, 10, 11, 12, 13]
    engine.add("hit", prompt, temperature=0.0, max_tokens=1)
    engine.add("scored", prompt, temperature=0.0, max_tokens=1, prompt_logprobs=1)
    engine.run()
    assert engine.outputs["hit"][0].num_cached_tokens == 24  # the prefix is in the cache...
    out = scored(engine.outputs["scored"])
    assert out.num_cached_tokens == 0  # ... but a prompt to score takes no hit
    assert_equals_transformers(model, prompt, out, 1)
    engine.add("after", prompt + [1], temperature=0.0, max_tokens=1)  # a scored prompt fills the cache too
    engine.run()
    assert engine.outputs["after"][0].num_cached_tokens == 28


def test_recompute_preemption_mid_prompt_scores_it_again(model):
    engine = InProcessEngine(model, num_blocks=11, block_size=4, max_num_batched_tokens=4)
    engine.add("old", prompt_of(6, seed=8), temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.step()
    prompt = prompt_of(30, seed=9)
    engine.add("scored", prompt, temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    scores = engine.scheduler.groups["scored"].prompt_scores
    num_restarts = 0
    while engine.has_work():
        num_scored = scores.num_scored
        engine.step()
        num_restarts += scores.num_scored < num_scored
    assert num_restarts > 0, "the scored prompt was never preempted half-scored"
    assert_equals_transformers(model, prompt, scored(engine.outputs["scored"]), 2)
    assert len(sum((o.new_token_ids for o in engine.outputs["old"]), [])) == 30


def test_max_tokens_zero_scores_the_prompt_and_samples_nothing(model):
    engine = InProcessEngine(model, num_blocks=32, block_size=4)
    prompt = prompt_of(13, seed=10)
    engine.add("n1", prompt, max_tokens=0, prompt_logprobs=0)
    engine.add("n3", prompt, max_tokens=0, prompt_logprobs=4, n=3)
    engine.add("best", prompt, max_tokens=0, prompt_logprobs=1, n=2, best_of=3)
    engine.run()
    assert engine.num_steps == 1  # one prefill each, no decode
    for request_id, num_choices, num_top in (("n1", 1, 0), ("n3", 3, 4), ("best", 2, 1)):
        outs = engine.outputs[request_id]
        assert sorted(o.choice_idx for o in outs) == list(range(num_choices))
        assert all(o.new_token_ids == [] and o.finish_reason == "length" for o in outs)
        assert outs[-1].request_finished and sum(o.request_finished for o in outs) == 1
        assert_equals_transformers(model, prompt, scored(outs), num_top)
    assert engine.blocks.num_used_blocks == 0 and engine.scheduler.num_unfinished_requests == 0


def test_several_choices_and_beam_search_score_the_prompt_once(model):
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    prompt = prompt_of(11, seed=11)
    engine.add("n", prompt, temperature=1.0, seed=3, max_tokens=4, n=3, prompt_logprobs=2)
    engine.add("beam", prompt, temperature=0.0, max_tokens=4, n=2, use_beam_search=True, prompt_logprobs=2)
    engine.run()
    for request_id in ("n", "beam"):
        assert_equals_transformers(model, prompt, scored(engine.outputs[request_id]), 2)


def test_llm_generate_exposes_prompt_logprobs_in_vllms_shape(model):
    llm = LLM.from_hf_model(model, dtype=torch.float32, num_kv_blocks=32, block_size=4, max_num_batched_tokens=16)
    prompts = [prompt_of(20, seed=12), [42]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=2))
    ref = hf_logprobs(model, prompts[0])
    first = outs[0].prompt_logprobs
    assert first[0] is None and len(first) == 20 and outs[1].prompt_logprobs == [None]
    for position, ranked in enumerate(first[1:]):
        token_id = prompts[0][position + 1]
        assert next(iter(ranked)) == token_id  # the prompt token first, then the top 2
        assert abs(ranked[token_id].logprob - ref[position, token_id].item()) < TOLERANCE
        others = sorted(lp.rank for t, lp in ranked.items() if t != token_id)
        assert others == [1, 2] if len(ranked) == 3 else others in ([1], [2])  # the prompt token among the top 2
        best = sorted((lp.logprob for lp in ranked.values()), reverse=True)[:2]
        torch.testing.assert_close(torch.tensor(best), torch.topk(ref[position], 2).values, atol=TOLERANCE, rtol=0)
        assert isinstance(ranked[token_id], Logprob) and ranked[token_id].rank >= 1
    assert all(o.choices[0].token_ids == [] and o.choices[0].finish_reason == "length" for o in outs)
    [plain] = llm.generate([prompts[0]], SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs is None
