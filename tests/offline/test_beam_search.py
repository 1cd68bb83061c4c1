"""Beam search equals transformers' generate(num_beams=k, do_sample=False)."""

import pytest
import torch

from services.scheduler.beam_search import Beam, BeamSearch
from tests.doubles.engine import tiny_llama

PAD = 0


def hf_beams(model, prompt, k, max_new, eos, length_penalty, early_stopping):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k,
                             do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=PAD,
                             length_penalty=length_penalty, early_stopping=early_stopping)
    results = []
    for row in out[:, len(prompt):].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        while row and row[-1] == PAD:
            row.pop()
        results.append(row)
    return results


def first_greedy_token_at(model, prompt, index):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=index + 1, do_sample=False,
                             eos_token_id=None, pad_token_id=PAD)
    return out[0, len(prompt) + index].item()


def search_with_full_forwards(model, prompt, k, max_new, eos, length_penalty, early_stopping):
    """Drive BeamSearch with plain (uncached) forwards: checks the decision rules alone."""
    search = BeamSearch(k, max_new, frozenset([eos]), length_penalty=length_penalty, early_stopping=early_stopping)
    beams = [Beam(0, [], 0.0)]
    next_key = 1
    while True:
        for b in beams:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + b.output_token_ids])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(search.num_candidates)
            b.top_token_ids, b.top_logprobs = top.indices.tolist(), top.values.tolist()
        conts = search.step(beams)
        if search.done:
            return [list(h.token_ids) for h in search.results(k)]
        by_key = {b.key: b for b in beams}
        beams = []
        for c in conts:
            beams.append(Beam(next_key, by_key[c.parent_key].output_token_ids + [c.token_id], c.cum_logprob))
            next_key += 1


CASES = [(2, 1.0, False), (3, 1.0, True), (4, 0.5, "never"), (3, -0.5, False), (2, 2.0, "never")]


@pytest.mark.parametrize("k, length_penalty, early_stopping", CASES)
def test_decision_rules_match_transformers(k, length_penalty, early_stopping):
    model = tiny_llama(seed=21, vocab_size=64)
    prompt = [5, 9, 13, 2, 7]
    eos = first_greedy_token_at(model, prompt, 3)  # a token the model likes, so beams do finish
    expected = hf_beams(model, prompt, k, 10, eos, length_penalty, early_stopping)
    got = search_with_full_forwards(model, prompt, k, 10, eos, length_penalty, early_stopping)
    assert got == expected


@pytest.mark.parametrize("k, length_penalty, early_stopping", CASES[:3])
def test_engine_beam_search_matches_transformers(k, length_penalty, early_stopping):
    from tests.doubles.engine import InProcessEngine

    model = tiny_llama(seed=21, vocab_size=64)
    prompt = [5, 9, 13, 2, 7]
    eos = first_greedy_token_at(model, prompt, 3)
    expected = hf_beams(model, prompt, k, 10, eos, length_penalty, early_stopping)
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    engine.add("r", prompt, eos=[eos], n=k, use_beam_search=True, max_tokens=10, temperature=0.0,
               length_penalty=length_penalty, early_stopping=early_stopping)
    engine.add("other", [1, 2, 3], temperature=0.0, max_tokens=12)  # shares the steps
    engine.run()
    got = {o.choice_idx: o.new_token_ids for o in engine.outputs["r"]}
    assert [got[i] for i in range(len(got))] == expected
    assert engine.blocks.num_used_blocks == 0
    assert not engine.scheduler.groups


def test_beams_share_blocks_while_they_run():
    from tests.doubles.engine import InProcessEngine

    model = tiny_llama(seed=21, vocab_size=64)
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    engine.add("r", [5, 9, 13, 2, 7, 1, 1, 4, 4], n=4, use_beam_search=True, max_tokens=12, temperature=0.0,
               ignore_eos=True)
    peak_shared = 0
    while engine.scheduler.has_work():
        engine.step()
        peak_shared = max(peak_shared, sum(1 for c in engine.blocks.ref_counts if c > 1))
    assert peak_shared >= 2  # the prompt's full blocks are held by several beams at once
    assert len(engine.outputs["r"]) == 4 and engine.blocks.num_used_blocks == 0
