"""Async scheduling gives lock-step's outputs: over many random workloads of ``HashModel`` (a fake
model whose next token hashes the sequence's history), then on the tiny random Llama (tokens, and
logprobs up to float32 rounding); and a sequence group swapped out mid-prompt forks as it would
have without the swap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import PLACEHOLDER_TOKEN_ID as PH
from tests.doubles.hash_model import VOCAB, HashModel, add_request, next_token
from tests.doubles.engine import InProcessEngine, tiny_llama


# ---------------------------------------------------------------------- random workloads of HashModel


def _run_hash_workload(seed: int, async_scheduling: bool, preemption_mode: str):
    """Random requests (stop tokens, max_tokens, n, shared prefixes) arriving over time, some aborted,
    in a pool small enough to preempt; returns every request's tokens per choice and finish reasons."""
    rng = np.random.default_rng(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64,
                                      preemption_mode=preemption_mode),
                      BlockManager(20, 4, watermark=0.0, num_cpu_blocks=32))
    model, prefix = HashModel(), rng.integers(1, VOCAB, 8).tolist()
    arrivals = sorted(rng.integers(0, 30, 14).tolist())
    aborts = {f"r{i}": int(rng.integers(2, 10)) for i in rng.choice(14, 3, replace=False)}
    got, unapplied, tick = {}, None, 0
    while arrivals or sched.has_work() or unapplied is not None:
        while arrivals and arrivals[0] <= tick:
            i = 14 - len(arrivals)
            arrivals.pop(0)
            prompt = (prefix if i % 3 == 0 else []) + rng.integers(1, VOCAB, int(rng.integers(1, 12))).tolist()
            n = int(rng.integers(1, 3))  # a request aborted after k tokens has one choice: with two, how
            n = 1 if f"r{i}" in aborts else n  # many the other has then depends on timing
            add_request(sched, f"r{i}", prompt, eos=[0], max_tokens=int(rng.integers(1, 30)), n=n,
                 stop_token_ids=[int(rng.integers(1, VOCAB))], seed=i, min_tokens=int(rng.integers(0, 3)))
        tick += 1
        step = sched.schedule()
        if unapplied is not None:
            sched.update(unapplied)
            unapplied = None
        if step is not None:
            result = model.execute(step)
            if async_scheduling and sched.can_schedule_ahead():
                unapplied = result
            else:
                sched.update(result)
        sched.blocks.check_integrity()
        for out in sched.take_outputs():
            tokens, _ = got.get((out.request_id, out.choice_idx), ([], None))
            got[(out.request_id, out.choice_idx)] = (tokens + out.new_token_ids, out.finish_reason)
            if len(got[(out.request_id, 0)][0]) >= aborts.get(out.request_id, 1e9):
                sched.abort_request(out.request_id)
                aborts.pop(out.request_id)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks and not sched.blocks.cpu_tables
    return got, sched.stats, model.num_placeholders


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_overlapped_loop_equals_lock_step_on_random_workloads(seed, preemption_mode):
    expected, lock_stats, _ = _run_hash_workload(seed, False, preemption_mode)
    got, stats, num_placeholders = _run_hash_workload(seed, True, preemption_mode)
    assert got == expected
    assert num_placeholders > 0 and lock_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert {reason for _, reason in got.values()} >= {"stop", "length"}


# ---------------------------------------------------------------------- the tiny Llama, end to end


def _mixed_batch(async_scheduling: bool, preemption_mode: str):
    """Greedy, seeded, penalties, stop tokens, EOS after min_tokens, max_tokens 1, n = 2, a prefix
    shared with three others, and an abort after 4 tokens, in a pool that forces preemptions."""
    engine = InProcessEngine(tiny_llama(seed=5), num_blocks=20, block_size=4, max_num_batched_tokens=64,
                             preemption_mode=preemption_mode, num_cpu_blocks=64 if preemption_mode == "swap" else 0,
                             async_scheduling=async_scheduling)
    gen = torch.Generator().manual_seed(1)

    def prompt(n):
        return torch.randint(1, 128, (n,), generator=gen).tolist()

    shared = prompt(9)
    requests = {
        "greedy": (shared + prompt(3), dict(temperature=0.0, max_tokens=20, ignore_eos=True)),
        "seeded": (prompt(7), dict(temperature=0.8, seed=7, max_tokens=15, ignore_eos=True, logprobs=2)),
        "penalties": (prompt(11), dict(temperature=0.0, max_tokens=25, ignore_eos=True, repetition_penalty=1.3,
                                       presence_penalty=0.5, frequency_penalty=0.3, logprobs=1)),
        "stop": (prompt(5), dict(temperature=0.0, max_tokens=30, stop_token_ids=list(range(10, 40)))),
        "eos": (prompt(6), dict(temperature=1.0, seed=11, max_tokens=30, min_tokens=4)),
        "n2": (prompt(10), dict(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=1)),
        "aborted": (prompt(8), dict(temperature=0.0, max_tokens=40, ignore_eos=True)),
        "one": (shared + prompt(2), dict(temperature=0.0, max_tokens=1, ignore_eos=True)),
        "prefix": (shared + prompt(4), dict(temperature=0.5, seed=99, max_tokens=18, ignore_eos=True)),
        # prompt logprobs, of a prompt prefilled in chunks beside the others (64 tokens a step): the
        # overlapped loop plans its next chunk and first decode while the chunk before is in flight
        "scored": (prompt(40), dict(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)),
    }
    for rid, (tokens, sampling) in requests.items():
        assert engine.add(rid, tokens, eos=list(range(60, 70)) if rid == "eos" else [], **sampling) == []
    placeholders, execute = [], engine.execute
    engine.execute = lambda step: (placeholders.append(int((step.input_token_ids == PH).sum())), execute(step))[1]
    got = {}
    while engine.has_work():
        for out in engine.step():
            tokens, logprobs, _ = got.get((out.request_id, out.choice_idx), ([], [], None))
            got[(out.request_id, out.choice_idx)] = (tokens + out.new_token_ids, logprobs + out.logprobs,
                                                     out.finish_reason)
            if out.prompt_logprobs:  # (top token ids, logprobs, -) as the choices' (tokens, logprobs, reason)
                got[(out.request_id, "prompt")] = (out.prompt_top_token_ids, out.prompt_logprobs, None)
        if "aborted" in engine.scheduler.groups and len(got.get(("aborted", 0), [[]])[0]) >= 4:
            engine.abort_request("aborted")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return got, engine.scheduler.stats, sum(placeholders)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tiny_llama_overlapped_gives_lock_steps_tokens_and_logprobs(preemption_mode):
    expected, lock_stats, lock_placeholders = _mixed_batch(False, preemption_mode)
    got, stats, num_placeholders = _mixed_batch(True, preemption_mode)
    assert lock_placeholders == 0 and num_placeholders > 0
    assert lock_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert {k: (t, r) for k, (t, _, r) in got.items()} == {k: (t, r) for k, (t, _, r) in expected.items()}
    assert expected[("stop", 0)][2] == "stop" and expected[("eos", 0)][2] == "stop"
    assert len(expected[("aborted", 0)][0]) == 4 and len(expected[("n2", 1)][0]) == 12
    assert len(expected[("scored", "prompt")][1]) == 39  # every position after the first, scored once
    for key, (_, logprobs, _) in expected.items():
        # Equal up to float32 rounding: a step's batch (which differs between the loops: a sequence
        # that stopped rides along once more) changes the matmuls' rounding, by ~5e-7 here, as
        # adding a request to a lock-step batch does.
        assert got[key][1] == pytest.approx(logprobs, abs=1e-5, rel=0)
        assert len(got[key][1]) == len(logprobs)


def test_a_group_swapped_out_mid_prompt_forks_its_samples_when_it_comes_back():
    """(Lock-step too.) The swapped-in first sequence of an ``n = 2`` request finishes its prompt:
    its sibling forks in that step, as it would have without the swap."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2, max_model_len=64,
                                      preemption_mode="swap"), BlockManager(4, 4, watermark=0.0, num_cpu_blocks=8))
    add_request(sched, "old", [1, 2, 3, 4], max_tokens=12, ignore_eos=True)
    add_request(sched, "pair", [20, 21, 22, 23, 24], n=2, max_tokens=3, ignore_eos=True)
    model, outputs = HashModel(), {}
    while sched.has_work():
        sched.update(model.execute(sched.schedule()))
        sched.blocks.check_integrity()
        for out in sched.take_outputs():
            outputs.setdefault((out.request_id, out.choice_idx), []).extend(out.new_token_ids)
    assert sched.stats.num_swap_outs > 0
    expected = []
    for _ in range(3):
        expected.append(next_token([20, 21, 22, 23, 24, *expected], 0))
    assert outputs[("pair", 0)] == outputs[("pair", 1)] == expected
    assert sched.blocks.num_free_blocks == 4
