"""Async scheduling: step N + 1 planned while step N runs, with placeholders for N's tokens.

- The scheduler alone (plain classes, a fake executor): what the planned-ahead step holds, how
  N's result fills the placeholder, how a sequence that stopped in N has its extra token dropped
  and its blocks held until N + 1 is done, and no block leaked.
- ``SampledTokens``: the executor's side of the placeholders, on one rank and across two.

That the overlapped loop gives lock-step's tokens: ``test_async_equivalence``; executor crashes
with two steps in flight: ``test_async_crashes``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor.parallel.base import SingleRank
from services.executor.placeholders import SampledTokens
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import PLACEHOLDER_TOKEN_ID as PH
from shared.messages import Step, StepResult, decode, encode
from tests.doubles.hash_model import CPU, add_request
from tests.doubles.rank_group import RankGroup, make_communicator, new_group_id


def _scheduler(num_blocks: int = 10, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, **config), BlockManager(num_blocks, 4, watermark=0.0))


def _result(step: Step, tokens: dict[int, int]) -> StepResult:
    """Step ``step``'s result: ``tokens[seq_id]`` for each sampled sequence."""
    seq_ids = step.seq_ids[step.sample_mask]
    return StepResult(step.step_id, seq_ids, np.array([tokens[int(s)] for s in seq_ids], np.int64))


# ---------------------------------------------------------------------- the scheduler alone


def test_the_next_step_feeds_a_placeholder_and_the_result_fills_it():
    sched = _scheduler()
    add_request(sched, "r", [1, 2, 3], max_tokens=10, ignore_eos=True)
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
    add_request(sched, "stops", [1, 2, 3, 4, 5], eos=[2], max_tokens=10)
    add_request(sched, "goes_on", [6, 7], max_tokens=10, ignore_eos=True)
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
    add_request(sched, "one", [1, 2], max_tokens=1, ignore_eos=True)
    add_request(sched, "three", [3, 4], max_tokens=3, ignore_eos=True)
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
    add_request(sched, "r", [1, 2, 3], max_tokens=10, ignore_eos=True)
    step0 = sched.schedule()
    step1 = sched.schedule()
    sched.abort_request("r")
    assert sched.blocks.num_free_blocks < sched.blocks.num_blocks and not sched.has_work()
    sched.update(_result(step0, {0: 5}))
    sched.update(_result(step1, {0: 6}))
    assert sched.take_outputs() == [] and sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_beam_search_and_crash_suspects_run_lock_step():
    sched = _scheduler()
    add_request(sched, "beams", [1, 2, 3], n=2, use_beam_search=True, temperature=0.0, max_tokens=4)
    sched.schedule()
    assert not sched.can_schedule_ahead()
    sched = _scheduler()
    add_request(sched, "r", [1, 2, 3], max_tokens=4)
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
