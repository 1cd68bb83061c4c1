"""Async scheduling: step N + 1 planned while step N runs, with placeholders for N's tokens.

- The scheduler alone (plain classes, a fake executor): what the planned-ahead step holds, how
  N's result fills the placeholder, how a sequence that stopped in N has its extra token dropped
  and its blocks held until N + 1 is done, and no block leaked.
- ``SampledTokens``: the executor's side of the placeholders, on one rank and across two.
- Over many random workloads of a fake model whose next token hashes the sequence's history, and
  then on the tiny random Llama: the overlapped loop gives lock-step's tokens exactly.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from services.executor.histories import TokenHistories
from services.executor.parallel.base import SingleRank
from services.executor.placeholders import SampledTokens
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import PLACEHOLDER_TOKEN_ID as PH
from shared.messages import AddRequest, SamplingParams, Step, StepResult, decode, encode
from tests.harness import InProcessEngine, tiny_llama
from tests.rank_group import RankGroup, make_communicator, new_group_id

CPU = torch.device("cpu")


def _scheduler(num_blocks: int = 10, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, **config), BlockManager(num_blocks, 4, watermark=0.0))


def _add(sched: Scheduler, rid: str, prompt: list[int], eos=(), **sampling) -> None:
    sched.add_request(AddRequest(rid, np.array(prompt, np.int32), SamplingParams(**sampling), list(eos), 0.0))


def _result(step: Step, tokens: dict[int, int]) -> StepResult:
    """Step ``step``'s result: ``tokens[seq_id]`` for each sampled sequence."""
    seq_ids = step.seq_ids[step.sample_mask]
    return StepResult(step.step_id, seq_ids, np.array([tokens[int(s)] for s in seq_ids], np.int64))


# ---------------------------------------------------------------------- the scheduler alone


def test_the_next_step_feeds_a_placeholder_and_the_result_fills_it():
    sched = _scheduler()
    _add(sched, "r", [1, 2, 3], max_tokens=10, ignore_eos=True)
    step0 = sched.schedule()  # the prefill samples the first token
    assert step0.input_token_ids.tolist() == [1, 2, 3] and step0.sample_mask.tolist() == [True]
    assert sched.can_schedule_ahead()
    step1 = sched.schedule()  # planned before step 0's result: it feeds step 0's token, unknown yet
    assert step1.input_token_ids.tolist() == [PH] and step1.positions.tolist() == [3]
    assert step1.context_lens.tolist() == [4] and step1.sample_mask.tolist() == [True]
    assert step1.slot_mapping.tolist() == [sched.blocks.block_tables[0][0] * 4 + 3]
    seq = sched.groups["r"].seqs[0]
    assert (seq.num_computed_tokens, seq.num_placeholders, seq.output_token_ids) == (4, 2, [])
    assert not sched.can_schedule_ahead()  # two steps in flight: the next waits for a result
    sched.update(_result(step0, {0: 7}))
    assert seq.output_token_ids == [7] and seq.num_placeholders == 1
    assert [o.new_token_ids for o in sched.take_outputs()] == [[7]]
    step2 = sched.schedule()  # planned while step 1 runs
    assert step2.input_token_ids.tolist() == [PH] and step2.positions.tolist() == [4]
    sched.update(_result(step1, {0: 8}))
    sched.update(_result(step2, {0: 9}))
    assert seq.output_token_ids == [7, 8, 9] and seq.num_placeholders == 0
    assert [o.new_token_ids for o in sched.take_outputs()] == [[8], [9]]


def test_a_sequence_that_stops_drops_its_extra_token_and_frees_its_blocks_after_the_next_step():
    sched = _scheduler()
    _add(sched, "stops", [1, 2, 3, 4, 5], eos=[2], max_tokens=10)
    _add(sched, "goes_on", [6, 7], max_tokens=10, ignore_eos=True)
    step0 = sched.schedule()
    step1 = sched.schedule()
    assert step1.input_token_ids.tolist() == [PH, PH]
    stops_blocks = list(sched.blocks.block_tables[0])
    assert len(stops_blocks) == 2  # step 1 writes position 5: its second block
    sched.update(_result(step0, {0: 2, 1: 11}))  # EOS for "stops"
    [stopped, going] = sched.take_outputs()
    assert (stopped.new_token_ids, stopped.finish_reason, stopped.request_finished) == ([2], "stop", True)
    assert going.new_token_ids == [11] and going.finish_reason is None
    assert "stops" not in sched.groups and sched.num_unfinished_requests == 1
    # Step 1 still writes "stops"'s KV: its blocks stay its own until step 1 is done.
    assert sched.blocks.block_tables[0] == stops_blocks
    sched.blocks.check_integrity()
    step2 = sched.schedule()  # "goes_on" alone; nothing yet tells the executors to forget "stops"
    assert step2.seq_ids.tolist() == [1] and step2.finished_seq_ids == []
    sched.update(_result(step1, {0: 99, 1: 12}))  # 99: the extra token of "stops", dropped
    assert [(o.request_id, o.new_token_ids) for o in sched.take_outputs()] == [("goes_on", [12])]
    assert 0 not in sched.blocks.block_tables
    sched.blocks.check_integrity()
    step3 = sched.schedule()
    assert step3.finished_seq_ids == [0]
    sched.update(_result(step2, {1: 13}))
    sched.update(_result(step3, {1: 14}))
    sched.abort_request("goes_on")
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_sequences_that_reach_max_tokens_are_not_planned_ahead():
    sched = _scheduler()
    _add(sched, "one", [1, 2], max_tokens=1, ignore_eos=True)
    _add(sched, "three", [3, 4], max_tokens=3, ignore_eos=True)
    step0 = sched.schedule()
    step1 = sched.schedule()
    assert step1.seq_ids.tolist() == [1]  # "one" ends with step 0's token
    sched.update(_result(step0, {0: 5, 1: 6}))
    step2 = sched.schedule()
    assert step2.seq_ids.tolist() == [1] and step2.finished_seq_ids == [0]
    sched.update(_result(step1, {1: 7}))
    assert sched.schedule() is None  # "three" has its third token in flight
    sched.update(_result(step2, {1: 8}))
    outputs = sched.take_outputs()
    assert {o.request_id: o.finish_reason for o in outputs if o.finish_reason} == {"one": "length", "three": "length"}
    assert [t for o in outputs if o.request_id == "three" for t in o.new_token_ids] == [6, 7, 8]
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_an_abort_with_two_steps_in_flight_frees_the_blocks_after_both():
    sched = _scheduler()
    _add(sched, "r", [1, 2, 3], max_tokens=10, ignore_eos=True)
    step0 = sched.schedule()
    step1 = sched.schedule()
    sched.abort_request("r")
    assert sched.blocks.num_free_blocks < sched.blocks.num_blocks and not sched.has_work()
    sched.update(_result(step0, {0: 5}))
    sched.update(_result(step1, {0: 6}))
    assert sched.take_outputs() == [] and sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_beam_search_and_crash_suspects_run_lock_step():
    sched = _scheduler()
    _add(sched, "beams", [1, 2, 3], n=2, use_beam_search=True, temperature=0.0, max_tokens=4)
    sched.schedule()
    assert not sched.can_schedule_ahead()
    sched = _scheduler()
    _add(sched, "r", [1, 2, 3], max_tokens=4)
    sched.schedule()
    sched.schedule()
    sched.reset_executor_state("rank 0 died")  # two steps lost: r counts one crash, and is a suspect
    assert sched.crashes.suspects and sched.groups["r"].seqs[0].num_placeholders == 0
    sched.schedule()
    assert not sched.can_schedule_ahead()


# ---------------------------------------------------------------------- the executor's side


def _step_feeding(seq_ids, inputs, positions, sample=None) -> Step:
    lens = [len(x) for x in inputs]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = len(seq_ids)
    return Step(1, 0, np.array(seq_ids, np.int64), np.array(sum(inputs, []), np.int64),
                np.array(sum(positions, []), np.int64), np.zeros(qsl[-1], np.int64), qsl,
                np.array([p[-1] + 1 for p in positions], np.int32), np.zeros((n, 1), np.int32),
                np.array(sample if sample is not None else [True] * n))


def test_sampled_tokens_fill_placeholders_and_refuse_a_wrong_position():
    sampled = SampledTokens()
    step0 = _step_feeding([4, 5], [[1, 2], [3]], [[0, 1], [6]])
    sampled.record(step0, np.array([4, 5]), np.array([40, 50]))  # positions 2 and 7
    step1 = _step_feeding([5, 4], [[PH], [PH]], [[7], [2]])
    sampled.fill(decoded := decode(encode(step1)), SingleRank(), CPU)
    assert decoded.input_token_ids.tolist() == [50, 40]
    with pytest.raises(ValueError, match="placeholder at position 3, but the executor has a sample at position 2"):
        sampled.fill(_step_feeding([4], [[PH]], [[3]]), SingleRank(), CPU)
    sampled.forget_failed(_step_feeding([4], [[9]], [[2]]))  # its step failed: a placeholder gets token 0
    step2 = _step_feeding([4], [[PH]], [[3]])
    sampled.fill(step2, SingleRank(), CPU)
    assert step2.input_token_ids.tolist() == [0]
    sampled.remove(4)
    with pytest.raises(ValueError, match="no sample"):
        sampled.fill(_step_feeding([4], [[PH]], [[3]]), SingleRank(), CPU)


def _fill_on_ranks(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    sampled = SampledTokens()
    if rank == 0:  # only rank 0 samples
        sampled.record(_step_feeding([1, 2], [[5], [6]], [[3], [8]]), np.array([1, 2]), np.array([49151, 17]))
    with torch.inference_mode():  # the group's buffers become inference tensors, as in a forward pass
        comm.all_reduce_(torch.zeros(4))
    step = _step_feeding([2, 1, 3], [[PH], [PH], [7, 8]], [[9], [4], [0, 1]])
    sampled.fill(step, comm, CPU)
    comm.close()
    report({"tokens": step.input_token_ids.tolist()})


def test_every_rank_fills_rank_0s_tokens(tmp_path):
    spec = {"group_id": new_group_id(), "store_path": str(tmp_path / "store")}
    group = RankGroup(_fill_on_ranks, 2, spec)
    assert group.join(60) == [0, 0], group.messages
    assert [group.wait_for(r, "tokens")["tokens"] for r in range(2)] == [[17, 49151, 7, 8]] * 2


# ---------------------------------------------------------------------- lock-step and overlapped agree

VOCAB = 50


class HashModel:
    """A fake executor: a sequence's next token hashes its whole history (and its seed), which it
    keeps as the real runner does (``TokenHistories``, placeholders filled by ``SampledTokens``)."""

    def __init__(self) -> None:
        self.histories, self.sampled, self.seeds = TokenHistories(), SampledTokens(), {}
        self.num_placeholders = 0

    def execute(self, step: Step) -> StepResult:
        step = decode(encode(step))
        for seq_id in step.finished_seq_ids:
            self.histories.remove(seq_id)
            self.sampled.remove(seq_id)
        for new in step.new_seqs:
            self.histories.add(new)
            self.seeds[new.seq_id] = new.sampling.seed or 0
        self.num_placeholders += int((step.input_token_ids == PH).sum())
        self.sampled.fill(step, SingleRank(), CPU)
        self.histories.observe(step)
        seq_ids = step.seq_ids[step.sample_mask]
        tokens = np.array([_next_token(self.histories.token_ids(s), self.seeds[s]) for s in seq_ids.tolist()], np.int64)
        self.sampled.record(step, seq_ids, tokens)
        return StepResult(step.step_id, seq_ids, tokens)


def _next_token(history: list[int], seed: int) -> int:
    digest = hashlib.blake2b(np.array([seed, *history], np.int64).tobytes(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


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
            _add(sched, f"r{i}", prompt, eos=[0], max_tokens=int(rng.integers(1, 30)), n=n,
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
    _add(sched, "old", [1, 2, 3, 4], max_tokens=12, ignore_eos=True)
    _add(sched, "pair", [20, 21, 22, 23, 24], n=2, max_tokens=3, ignore_eos=True)
    model, outputs = HashModel(), {}
    while sched.has_work():
        sched.update(model.execute(sched.schedule()))
        sched.blocks.check_integrity()
        for out in sched.take_outputs():
            outputs.setdefault((out.request_id, out.choice_idx), []).extend(out.new_token_ids)
    assert sched.stats.num_swap_outs > 0
    expected = []
    for _ in range(3):
        expected.append(_next_token([20, 21, 22, 23, 24, *expected], 0))
    assert outputs[("pair", 0)] == outputs[("pair", 1)] == expected
    assert sched.blocks.num_free_blocks == 4


# ---------------------------------------------------------------------- executor crashes


@pytest.fixture(scope="module")
def crash_model():
    return tiny_llama(seed=5)


@pytest.fixture(scope="module")
def crash_workload(crash_model):
    from tests.test_recovery import uninterrupted_run

    return uninterrupted_run(crash_model)


def _crashing_engine(model, **kwargs):
    """``test_recovery``'s crashing engine, overlapped; records how many steps were in flight at
    each crash."""
    from tests.test_recovery import CrashingEngine

    engine = CrashingEngine(model, async_scheduling=True, **kwargs)
    engine.in_flight_at_crash = []
    reset = engine.scheduler.reset_executor_state

    def counting_reset(cause):
        engine.in_flight_at_crash.append(len(engine.scheduler._in_flight))
        reset(cause)

    engine.scheduler.reset_executor_state = counting_reset
    return engine


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("crash_after", [1, 6, 25])
def test_a_crash_with_two_steps_in_flight_recovers_as_in_lock_step(crash_model, crash_workload, mode, crash_after):
    from tests.test_recovery import _add_all, _run

    prompts, max_new, expected = crash_workload
    engine = _crashing_engine(crash_model, num_blocks=40, preemption_mode=mode,
                              num_cpu_blocks=64 if mode == "swap" else 0)
    _add_all(engine, prompts, max_new)
    for _ in range(crash_after):
        engine.step()
    engine.crash_next = True
    assert _run(engine) == expected
    assert engine.in_flight_at_crash == [2]  # the step that died, and the one planned while it ran
    assert all(out[-1].finish_reason == "length" for out in engine.outputs.values())
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.blocks.cpu_free_queue) == engine.blocks.num_cpu_blocks


def test_a_request_that_crashes_the_executor_every_time_is_failed_alone_overlapped(crash_model, crash_workload):
    from tests.test_recovery import _add_all, _run

    prompts, max_new, expected = crash_workload
    engine = _crashing_engine(crash_model, num_blocks=256, poison=frozenset({"poison"}))
    _add_all(engine, prompts, max_new)
    engine.step()
    engine.add("poison", [9, 8, 7, 6, 5], temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = _run(engine)
    [failure] = engine.outputs["poison"]
    assert failure.finish_reason == "error" and "executor crashes" in failure.error
    assert {k: v for k, v in tokens.items() if k != "poison"} == expected
    assert engine.in_flight_at_crash == [2, 1]  # the second crash: the suspect alone, lock-step
    crashed = [held for held in engine.step_requests if "poison" in held]
    assert len(crashed) == 2 and crashed[-1] == {"poison"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
