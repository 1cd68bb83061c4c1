"""Sliding-window block freeing: each block-manager operation with null entries, and whole
scheduler runs (prefix caching, n > 1 forks, swap and recompute preemption in small pools) in which
an executor model checks that every key a query attends in its window reads back its own token."""

import random

import numpy as np
import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import ContiguousBlockManager
from services.scheduler.kv_snapshot import build_kv_snapshot
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sliding_window import NULL_BLOCK, max_live_blocks, num_dead_blocks
from services.scheduler.step_builder import Scheduled, build_step
from shared.kv_json import kv_snapshot_json
from shared.messages import PLACEHOLDER_TOKEN_ID, AddRequest, SamplingParams, StepResult


def _bm(num_blocks=16, window=8, **kwargs):
    return BlockManager(num_blocks, 4, watermark=0.0, sliding_window=window, **kwargs)


# ---------------------------------------------------------------------- arithmetic


def test_dead_blocks_are_those_whose_last_token_is_out_of_the_next_querys_window():
    # W = 8, bs = 4: at n computed tokens the next query (position n) attends n - 7 .. n.
    assert [num_dead_blocks(n, 8, 4) for n in (0, 7, 10, 11, 14, 15, 19)] == [0, 0, 0, 1, 1, 2, 3]
    assert num_dead_blocks(1000, 0, 4) == 0  # no window
    assert max_live_blocks(8, 4) == 3 and max_live_blocks(32, 16) == 3 and max_live_blocks(4, 4) == 2


# ---------------------------------------------------------------------- operations with nulls


def test_trim_releases_dead_blocks_and_keeps_positions():
    bm = _bm()
    assert bm.allocate_slots(0, 16)  # blocks 0..3
    assert bm.free_out_of_window(0, 10) == 0
    assert bm.free_out_of_window(0, 15) == 2
    assert bm.block_tables[0] == [NULL_BLOCK, NULL_BLOCK, 2, 3]
    assert bm.num_free_blocks == 14 and bm.trimmed_at[0] == 15
    assert bm.free_out_of_window(0, 15) == 0  # idempotent
    bm.check_integrity()
    assert bm.slot(0, 9) == 2 * 4 + 1
    with pytest.raises(AssertionError, match="out of the window"):
        bm.slot(0, 3)
    with pytest.raises(ValueError, match="trimmed at 15"):
        bm.free_out_of_window(0, 12)
    assert bm.num_new_blocks(0, 20) == 1  # the table's length counts positions, nulls included
    assert bm.allocate_slots(0, 20, 16) and bm.block_tables[0][4] not in (NULL_BLOCK, 2, 3)
    bm.free(0)
    assert bm.num_free_blocks == 16 and not bm.trimmed_at
    bm.check_integrity()


def test_no_window_trims_nothing():
    bm = _bm(window=0)
    bm.allocate_slots(0, 40)
    assert bm.free_out_of_window(0, 40) == 0 and NULL_BLOCK not in bm.block_tables[0]


def test_a_hashed_block_trimmed_stays_cached_and_is_hit_again():
    bm = _bm()
    tokens = list(range(1, 17))
    hashes = bm.prefix_hashes(tokens, 4)
    bm.allocate_slots(0, 17)
    bm.cache_full_blocks(0, hashes)
    bm.free_out_of_window(0, 16)  # blocks 0 and 1 dead (last tokens 3, 7 <= 16 - 8)
    assert list(bm.evictable) == [1, 0] and bm.num_cached_blocks == 2
    bm.cache_full_blocks(0, hashes)  # nulls are skipped, never registered
    assert NULL_BLOCK not in bm.cached.values()
    bm.check_integrity()
    hits = bm.match_prefix(hashes, 17)
    assert hits == [0, 1, 2, 3]
    assert bm.allocate_slots(1, 17, 16, hits)  # admission takes them, then trims the dead ones
    bm.free_out_of_window(1, 16)
    assert bm.block_tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and bm.block_tables[1][2:4] == [2, 3]
    assert bm.ref_counts[2] == 2 and bm.ref_counts[0] == 0 and 0 in bm.evictable
    bm.check_integrity()


def test_fork_and_copy_on_write_with_nulls():
    bm = _bm()
    bm.allocate_slots(0, 14)  # blocks 0..3, the last partly filled
    bm.free_out_of_window(0, 14)  # block 0 dead (14 - 8 = 6 >= 3)
    bm.fork(0, 1)
    assert bm.block_tables[1] == [NULL_BLOCK, 1, 2, 3] and bm.trimmed_at[1] == 14
    assert bm.ref_counts[1] == 2 and bm.ref_counts[0] == 0
    bm.check_integrity()
    assert bm.allocate_slots(1, 15, 14)  # writes into shared block 3: copied
    (src, dst), = bm.take_copies()
    assert src == 3 and bm.block_tables[1][3] == dst and bm.block_tables[1][0] == NULL_BLOCK
    bm.free_out_of_window(1, 16)  # now block 1 too
    assert bm.block_tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and bm.ref_counts[1] == 1
    bm.check_integrity()
    bm.free(1)
    bm.free(0)
    assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_swap_moves_only_live_blocks_and_nulls_come_back_as_nulls():
    bm = _bm(num_cpu_blocks=4)
    bm.allocate_slots(0, 20)  # 5 blocks
    bm.free_out_of_window(0, 19)  # 3 dead: 19 - 8 = 11 >= 11
    bm.fork(0, 1)
    assert bm.can_swap_out([0, 1])  # 2 distinct live blocks, 4 CPU blocks
    out = bm.swap_out([0, 1])
    assert [dev for dev, _ in out] == [3, 4]
    assert bm.cpu_tables[0][:3] == [NULL_BLOCK] * 3 and bm.cpu_tables[1] == bm.cpu_tables[0]
    assert bm.num_free_blocks == 16
    bm.check_integrity()
    back = bm.swap_in([0, 1])
    assert len(back) == 2 and bm.block_tables[0][:3] == [NULL_BLOCK] * 3 and bm.trimmed_at[0] == 19
    bm.check_integrity()
    bm.swap_out([0])
    bm.free_swapped(0)
    assert 0 not in bm.trimmed_at and len(bm.cpu_free_queue) == 4
    bm.check_integrity()


def test_check_integrity_catches_a_null_after_a_live_entry_and_a_missing_trim():
    bm = _bm()
    bm.allocate_slots(0, 16)
    bm.free_out_of_window(0, 15)
    bm.block_tables[0][0], bm.block_tables[0][2] = 2, NULL_BLOCK  # a live block before a null
    with pytest.raises(AssertionError, match="null entries at"):
        bm.check_integrity()
    bm = _bm()
    bm.allocate_slots(0, 16)
    bm.trimmed_at[0] = 15  # recorded, but its dead blocks still held
    with pytest.raises(AssertionError, match="null entries at"):
        bm.check_integrity()


def test_contiguous_refuses_a_window():
    with pytest.raises(ValueError, match="no sliding-window"):
        ContiguousBlockManager(8, 4, sliding_window=8)


def test_step_sends_nulls_as_block_zero_and_kv_snapshot_shows_them():
    bm = _bm()
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm)
    sched.add_request(AddRequest("r", np.arange(1, 18, dtype=np.int32), SamplingParams(max_tokens=4), 0.0))
    step = sched.schedule()  # the prompt (17 tokens): blocks 0..4, none dead yet at 0 computed
    seq = sched.running[0]
    assert seq.num_computed_tokens == 17
    bm.free_out_of_window(seq.seq_id, 17)  # as the next schedule does: 17 - 8 = 9: blocks 0, 1 dead
    assert bm.block_tables[seq.seq_id][:2] == [NULL_BLOCK, NULL_BLOCK]
    seq.num_computed_tokens = 16  # pretend position 16 is still to compute: a step of one token
    seq.output_token_ids, seq.num_placeholders = [], 0
    step = build_step(1, [Scheduled(seq, 1)], bm, [], [], [])
    assert step.block_tables[0].tolist() == [0, 0, 2, 3, 4]
    assert step.slot_mapping.tolist() == [4 * 4 + 0]
    snap = build_kv_snapshot(sched, 1)
    assert snap.table_block_ids.tolist() == [NULL_BLOCK, NULL_BLOCK, 2, 3, 4]
    assert snap.used_block_ids.tolist() == [2, 3, 4]
    (entry,) = kv_snapshot_json(snap)["sequences"]
    assert entry["block_table"] == [-1, -1, 2, 3, 4]
    assert sched.engine_stats().num_slots_allocated == 3 * 4


# ---------------------------------------------------------------------- whole runs


class KvModel:
    """The executors' pools as the scheduler's steps drive them, each step run as it is sent (the
    executors run steps in order): blocks moved, tokens written to their slots (a placeholder
    replaced by the token the sequence sampled last, as with async scheduling), every query's
    window read back, then tokens sampled; returns the step's result."""

    def __init__(self, sched: Scheduler, window: int, rng: random.Random):
        self.sched, self.window, self.bs, self.rng = sched, window, sched.blocks.block_size, rng
        self.device: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.sampled: dict[int, int] = {}  # seq id -> the token it sampled last

    def run(self, step) -> StepResult:
        bm = self.sched.blocks
        for dev, cpu in step.swap_out.tolist():
            self.cpu[cpu] = list(self.device[dev])
        for cpu, dev in step.swap_in.tolist():
            self.device[dev] = list(self.cpu[cpu])
        for src, dst in step.block_copies.tolist():
            self.device[dst] = list(self.device[src])
        starts = step.query_start_loc.tolist()
        forked = [seq_id for i, seq_id in enumerate(step.seq_ids.tolist()) if starts[i] == starts[i + 1]]
        row_seq = np.repeat(step.seq_ids, np.diff(step.query_start_loc)).tolist()
        for slot, token, seq_id in zip(step.slot_mapping.tolist(), step.input_token_ids.tolist(), row_seq):
            if token == PLACEHOLDER_TOKEN_ID:
                token = self.sampled[seq_id]
            block = slot // self.bs  # shared only with the samples forking in this step, if any
            sharers = sum(block in bm.block_tables[seq_id] for seq_id in forked)
            assert bm.ref_counts[block] == 1 + sharers, f"write into shared block {block}"
            self.device.setdefault(block, [None] * self.bs)[slot % self.bs] = token
        by_id = {s.seq_id: s for g in self.sched.groups.values() for s in g.seqs}
        for i, seq_id in enumerate(step.seq_ids.tolist()):
            seq, table = by_id[seq_id], bm.block_tables[seq_id]
            for row in range(starts[i], starts[i + 1]):
                p = int(step.positions[row])
                for j in range(max(0, p - self.window + 1) if self.window else 0, p + 1):
                    assert table[j // self.bs] != NULL_BLOCK, f"seq {seq_id}: key {j} of query {p} freed"
                    block = int(step.block_tables[i, j // self.bs])
                    expected = seq.token_id(j)
                    if expected != PLACEHOLDER_TOKEN_ID:  # (else sampled by a step in flight)
                        assert self.device[block][j % self.bs] == expected, f"seq {seq_id}: key {j} lost"
        sampled = step.seq_ids[step.sample_mask]
        tokens = np.array([self.rng.randrange(2, 6) for _ in sampled], np.int64)
        self.sampled.update(zip(sampled.tolist(), tokens.tolist()))
        return StepResult(step.step_id, sampled, tokens)


def run_windowed(window, bs, num_blocks, requests, *, num_cpu_blocks=0, preemption_mode="recompute",
                 prefix_caching=True, max_num_batched_tokens=64, seed=0, async_scheduling=False):
    """Run ``requests`` (prompt, max_tokens, n) to completion, checking the pool after every step
    (with ``async_scheduling``, the next step planned while one is in flight where the scheduler
    allows). Returns the scheduler, its outputs and the most blocks one sequence held."""
    bm = BlockManager(num_blocks, bs, watermark=0.0, num_cpu_blocks=num_cpu_blocks,
                      enable_prefix_caching=prefix_caching, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=1024, preemption_mode=preemption_mode), bm)
    for i, (prompt, max_tokens, n) in enumerate(requests):
        params = SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(AddRequest(f"r{i}", np.array(prompt, np.int32), params, float(i)))
    kv, outputs, peak, in_flight = KvModel(sched, window, random.Random(seed)), [], 0, []
    chunk_blocks = -(-max_num_batched_tokens // bs) + 1
    for _ in range(40_000):
        if not sched.has_work() and not in_flight:
            break
        step = None
        if not in_flight or (async_scheduling and len(in_flight) == 1 and sched.can_schedule_ahead()):
            step = sched.schedule()
        if step is None:
            sched.update(in_flight.pop(0))
            outputs += sched.take_outputs()
            bm.check_integrity()
            continue
        in_flight.append(kv.run(step))
        for s in sched.running:
            live = sum(b != NULL_BLOCK for b in bm.block_tables.get(s.seq_id, ()))
            peak = max(peak, live)
            if window:
                assert live <= max_live_blocks(window, bs) + chunk_blocks
        for i in range(step.num_decodes):  # a decoding sequence holds its window and no more
            seq_id = int(step.seq_ids[i])
            if window:
                live = sum(b != NULL_BLOCK for b in bm.block_tables[seq_id])
                assert live <= max_live_blocks(window, bs), f"decoding seq {seq_id} holds {live} blocks"
        bm.check_integrity()
    assert not sched.has_work() and not in_flight
    return sched, outputs, peak


def _finals(outputs):
    """(request, choice) -> (finish reason, tokens sent, error), for the choices that finished."""
    tokens, finals = {}, {}
    for o in outputs:
        key = (o.request_id, o.choice_idx)
        tokens[key] = tokens.get(key, 0) + len(o.new_token_ids)
        if o.finish_reason is not None:
            finals[key] = (o.finish_reason, tokens[key], o.error)
    return finals


def _shared_prompts(k, length, seed=1):
    rng = random.Random(seed)
    head = [rng.randrange(6, 9) for _ in range(length // 2)]  # a common half: prefix-cache hits
    return [head + [rng.randrange(6, 9) for _ in range(length - len(head))] for _ in range(k)]


@pytest.mark.parametrize("bs", [4, 16])
def test_long_generations_hold_only_the_window(bs):
    window = 32
    reqs = [(p, 300, 1) for p in _shared_prompts(3, 40)]
    sched, outputs, peak = run_windowed(window, bs, 200, reqs)
    finals = _finals(outputs)
    assert len(finals) == 3 and set(finals.values()) == {("length", 300, None)}
    assert peak <= max_live_blocks(window, bs) + -(-64 // bs) + 1
    _, _, peak_off = run_windowed(0, bs, 200, reqs)
    assert peak_off == -(-340 // bs) > peak


def test_forks_prefix_hits_and_recompute_in_a_small_pool():
    reqs = [(p, 200, n) for p, n in zip(_shared_prompts(4, 48), (2, 1, 3, 1))]
    sched, outputs, _ = run_windowed(32, 4, 48, reqs, max_num_batched_tokens=32)
    finals = _finals(outputs)
    assert len(finals) == 7 and set(finals.values()) == {("length", 200, None)}
    assert sched.stats.num_recomputes > 0  # 7 sequences of up to 9 live blocks in 48
    assert sched.blocks.num_hit_tokens > 0


def test_swap_preemption_in_a_small_pool():
    reqs = [(p, 200, n) for p, n in zip(_shared_prompts(4, 40, seed=2), (1, 2, 1, 2))]
    sched, outputs, _ = run_windowed(32, 4, 44, reqs, num_cpu_blocks=64, preemption_mode="swap",
                                     max_num_batched_tokens=32)
    finals = _finals(outputs)
    assert len(finals) == 6 and set(finals.values()) == {("length", 200, None)}
    assert sched.stats.num_swap_outs > 0



def test_the_pool_shape_carries_the_window_every_rank_reports():
    from services.scheduler.liveness import PoolShape
    from shared.messages import ExecutorReady

    ranks = [ExecutorReady(r, 2, 100, 16, 4096, model="m", sliding_window=w) for r, w in enumerate((1024, 1024))]
    assert PoolShape.of(ranks).sliding_window == 1024
    ranks[1].sliding_window = 0  # a rank that attends everything: no freeing
    assert PoolShape.of(ranks).sliding_window == 0



@pytest.mark.parametrize("window", [0, 32])
def test_a_sequence_longer_than_the_pool_is_prefilled_again_in_chunks_with_a_window(window):
    """A resumed request (as a recompute-preempted one) of 8 + 150 tokens needs 40 blocks of 4 at
    once without a window, more than the pool's 24: it is stopped (outgrown). With W = 32 its
    chunks of 32 tokens need at most 9 + 8 blocks at a time, and it goes on."""
    bm = BlockManager(24, 4, watermark=0.0, enable_prefix_caching=False, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_model_len=1024), bm)
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    resumed = np.full(150, 7, np.int32)
    sched.add_request(AddRequest("r", np.full(8, 6, np.int32), params, 0.0, resumed_token_ids=resumed))
    outputs = []
    while sched.has_work():
        step = sched.schedule()
        if step is not None:
            sampled = step.seq_ids[step.sample_mask]
            sched.update(StepResult(step.step_id, sampled, np.full(len(sampled), 5, np.int64)))
        outputs += sched.take_outputs()
        bm.check_integrity()
    finals = _finals(outputs)
    assert finals == ({("r", 0): ("length", 10, None)} if window else {("r", 0): ("length", 0, None)})


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_scheduling_with_a_window(preemption_mode):
    """The next step planned while one is in flight: its sequences trimmed at counts that include
    the step in flight, whose reads come first (the executors run steps in order)."""
    reqs = [(p, 150, n) for p, n in zip(_shared_prompts(4, 40, seed=3), (1, 2, 1, 1))]
    sched, outputs, _ = run_windowed(32, 4, 40, reqs, num_cpu_blocks=64, preemption_mode=preemption_mode,
                                     max_num_batched_tokens=32, async_scheduling=True)
    assert set(_finals(outputs).values()) == {("length", 150, None)} and len(_finals(outputs)) == 5
    assert sched.stats.num_preemptions > 0
