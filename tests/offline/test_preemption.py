"""Running out of KV memory: preemption by recompute or swap, chunked prefill, the contiguous baseline."""

import pytest
import torch

from tests.doubles.engine import InProcessEngine, tiny_llama


def _workload(seed: int = 0, num: int = 12):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 20, (num,), generator=gen)]
    max_new = [int(m) for m in torch.randint(20, 45, (num,), generator=gen)]
    return prompts, max_new


def _run(model, prompts, max_new, **engine_kwargs):
    engine = InProcessEngine(model, block_size=4, **engine_kwargs)
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert engine.add(f"r{i}", p, temperature=0.0, max_tokens=m, ignore_eos=True) == []
    return engine, engine.run()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def unpressured(model):
    prompts, max_new = _workload()
    _, tokens = _run(model, prompts, max_new, num_blocks=512)
    return prompts, max_new, tokens


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_demand_three_times_the_pool_completes_identically(model, unpressured, mode, backend):
    prompts, max_new, expected = unpressured
    num_blocks = 40
    demand = sum(-(-(len(p) + m) // 4) for p, m in zip(prompts, max_new))
    assert demand >= 3 * num_blocks
    engine, tokens = _run(model, prompts, max_new, num_blocks=num_blocks, preemption_mode=mode,
                          num_cpu_blocks=64 if mode == "swap" else 0, backend=backend)
    assert tokens == expected  # every request completed, token for token
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_outs > 0 and stats.num_recomputes == 0
        assert len(engine.blocks.cpu_free_queue) == engine.blocks.num_cpu_blocks
    else:
        assert stats.num_recomputes > 0 and stats.num_swap_outs == 0
    preempted = [o[-1].num_preemptions for o in engine.outputs.values()]
    assert sum(preempted) >= stats.num_preemptions and all(o[-1].finish_reason == "length"
                                                           for o in engine.outputs.values())
    assert engine.blocks.num_free_blocks == num_blocks
    assert engine.scheduler.num_unfinished_requests == 0


def test_swap_falls_back_to_recompute_without_swap_space(model, unpressured):
    prompts, max_new, expected = unpressured
    engine, tokens = _run(model, prompts, max_new, num_blocks=40, preemption_mode="swap", num_cpu_blocks=0)
    assert tokens == expected
    assert engine.scheduler.stats.num_recomputes > 0


def test_long_prompt_prefilled_in_chunks_gives_same_output(model):
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 128, (70,), generator=gen).tolist()
    outputs = {}
    for budget in (16, 512):
        engine = InProcessEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=budget)
        engine.add("short", [5, 6, 7], temperature=0.0, max_tokens=30, ignore_eos=True)
        engine.step()  # the short request is decoding before the long one arrives
        engine.add("long", prompt, temperature=0.0, max_tokens=10, ignore_eos=True)
        steps_before_first = 0
        while not engine.outputs.get("long"):
            engine.step()
            steps_before_first += 1
        outputs[budget] = (engine.run(), steps_before_first, engine.max_tokens_in_step, engine.mixed_steps)
        outputs[budget][0]["long"] = engine.outputs["long"][0].new_token_ids + outputs[budget][0].get("long", [])
    chunked, whole = outputs[16], outputs[512]
    assert chunked[1] >= 5 and whole[1] == 1  # 70 tokens in chunks of at most 16
    assert chunked[2] <= 16
    assert chunked[3] > 0  # the short request's decodes ran beside the long prefill's chunks
    assert chunked[0]["long"] == whole[0]["long"]


def test_prompt_larger_than_pool_fails_at_once(model):
    engine = InProcessEngine(model, num_blocks=8, block_size=4)
    outs = engine.add("huge", list(range(1, 60)), temperature=0.0, max_tokens=4)
    assert len(outs) == 1 and outs[0].finish_reason == "error"
    assert "KV blocks" in outs[0].error and "8" in outs[0].error
    assert not engine.scheduler.has_work()


def test_contiguous_policy_same_outputs_lower_utilization(model, unpressured):
    prompts, max_new, expected = unpressured
    paged, tokens_paged = _run(model, prompts, max_new, num_blocks=64, max_model_len=64)
    contiguous, tokens_contig = _run(model, prompts, max_new, num_blocks=64, max_model_len=64,
                                     kv_policy="contiguous")
    assert tokens_paged == expected and tokens_contig == expected
    util = lambda s: s.sum_slots_used / s.sum_slots_allocated
    assert util(paged.scheduler.stats) > util(contiguous.scheduler.stats)
    assert paged.scheduler.stats.max_num_running > contiguous.scheduler.stats.max_num_running
    assert contiguous.scheduler.stats.num_preemptions == 0


def test_sequence_that_outgrows_the_pool_ends_with_length(model):
    engine = InProcessEngine(model, num_blocks=8, block_size=4)
    engine.add("long", list(range(1, 11)), temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.run()
    outs = engine.outputs["long"]
    assert outs[-1].finish_reason == "length"
    assert 20 <= sum(len(o.new_token_ids) for o in outs) < 60  # it filled the pool, then stopped
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.has_work()


def test_group_too_large_for_the_pool_is_refused(model):
    engine = InProcessEngine(model, num_blocks=8, block_size=4)
    outs = engine.add("wide", list(range(1, 11)), temperature=1.0, max_tokens=4, n=6)
    assert outs[0].finish_reason == "error" and "6 sequences" in outs[0].error and "9 KV blocks" in outs[0].error
    assert engine.add("ok", list(range(1, 11)), temperature=1.0, max_tokens=4, n=4) == []
