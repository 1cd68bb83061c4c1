"""n > 1: the samples of a request share the prompt's blocks and copy the partial block on write."""

import pytest
import torch

from tests.doubles.engine import InProcessEngine, tiny_llama
from tests.doubles.engine import hf_greedy


def _choices(engine, rid):
    by_choice = {}
    for out in engine.outputs[rid]:
        by_choice.setdefault(out.choice_idx, []).extend(out.new_token_ids)
    return by_choice


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_greedy_samples_share_blocks_and_equal_transformers(backend):
    model = tiny_llama(seed=11)
    prompt = torch.randint(1, 128, (10,), generator=torch.Generator().manual_seed(2)).tolist()  # 2.5 blocks
    engine = InProcessEngine(model, num_blocks=64, block_size=4, backend=backend)
    engine.add("r", prompt, temperature=0.0, max_tokens=9, ignore_eos=True, n=3)
    engine.step()  # prefill + fork
    table = engine.blocks.block_tables
    seq_ids = sorted(table)
    assert len(seq_ids) == 3
    assert all(table[s] == table[seq_ids[0]] for s in seq_ids)  # all three share all three blocks
    assert [engine.blocks.ref_counts[b] for b in table[seq_ids[0]]] == [3, 3, 3]
    partial = table[seq_ids[0]][2]
    step = engine.scheduler.schedule()  # the first decode: two of three copy the partial block
    assert len(step.block_copies) == 2
    assert [src for src, _ in step.block_copies.tolist()] == [partial, partial]
    engine.scheduler.update(engine.execute(step))
    for out in engine.scheduler.take_outputs():
        engine.outputs[out.request_id].append(out)
    shared_full = [engine.blocks.ref_counts[b] for b in engine.blocks.block_tables[seq_ids[0]][:2]]
    assert shared_full == [3, 3]  # full blocks stay shared
    engine.run()
    expected = hf_greedy(model, prompt, 9)
    assert _choices(engine, "r") == {0: expected, 1: expected, 2: expected}
    assert engine.blocks.num_used_blocks == 0


def test_seeded_samples_are_reproducible_and_distinct():
    model = tiny_llama(seed=12)
    runs = []
    for _ in range(2):
        engine = InProcessEngine(model, num_blocks=64, block_size=4)
        engine.add("r", [3, 4, 5, 6, 7], temperature=1.0, max_tokens=12, ignore_eos=True, n=4, seed=1234)
        engine.add("other", [9, 9], temperature=1.0, max_tokens=5, ignore_eos=True)  # batch company
        engine.run()
        runs.append(_choices(engine, "r"))
        assert engine.blocks.num_used_blocks == 0
    assert runs[0] == runs[1]
    assert len({tuple(v) for v in runs[0].values()}) > 1


def test_abort_a_group_before_and_after_fork_frees_everything():
    model = tiny_llama(seed=13)
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    engine.add("a", [1, 2, 3, 4, 5, 6], temperature=0.0, max_tokens=20, ignore_eos=True, n=3)
    engine.add("b", [7, 8, 9], temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    engine.scheduler.abort_request("b")  # before any fork
    engine.step()
    engine.step()
    engine.scheduler.abort_request("a")  # after the fork
    engine.blocks.check_integrity()
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.has_work()


def test_best_of_returns_the_n_most_likely_samples():
    model = tiny_llama(seed=14)
    prompt = [3, 1, 4, 1, 5, 9]
    all4 = InProcessEngine(model, num_blocks=64, block_size=4)
    all4.add("r", prompt, temperature=1.0, max_tokens=8, ignore_eos=True, n=4, seed=7, logprobs=0)
    all4.run()
    samples = {}
    for out in all4.outputs["r"]:
        tokens, total = samples.get(out.choice_idx, ([], 0.0))
        samples[out.choice_idx] = (tokens + out.new_token_ids, total + sum(out.logprobs))
    ranked = sorted(samples.values(), key=lambda s: -s[1])
    best = InProcessEngine(model, num_blocks=64, block_size=4)
    best.add("r", prompt, temperature=1.0, max_tokens=8, ignore_eos=True, n=2, best_of=4, seed=7)
    best.run()
    outs = best.outputs["r"]
    assert [o.choice_idx for o in outs] == [0, 1]  # held back, then sent once each
    assert [o.new_token_ids for o in outs] == [ranked[0][0], ranked[1][0]]
    assert all(o.logprobs == [] for o in outs)  # none were asked for
    assert best.blocks.num_used_blocks == 0 and not best.scheduler.groups
