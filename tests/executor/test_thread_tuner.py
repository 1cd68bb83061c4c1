"""Threads per step (``services/executor/thread_tuner.py``): the policy picks what its timings say,
keeps checking the other choice, leaves large steps alone; where it is enabled the thread count
changes no result (oneDNN-packed matmuls at SmolLM2's shapes, the attention kernels' partitions,
a whole engine's outputs)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels.cpu.decode import attend_rows
from services.executor.linear import PackedLinear
from services.executor.thread_tuner import (
    ThreadTuner, step_runner, thread_ladder, thread_tuner_for, tuned_execute,
)
from tests.doubles.engine import InProcessEngine, tiny_llama


def drive(tuner: ThreadTuner, num_tokens: int, ms_by_threads: dict[int, float], steps: int) -> list[int]:
    """Run ``steps`` steps of ``num_tokens`` tokens whose time depends only on the threads."""
    chosen = []
    for _ in range(steps):
        threads = tuner.choose(num_tokens)
        tuner.observe(num_tokens, threads, ms_by_threads[threads])
        chosen.append(threads)
    return chosen


def test_learns_each_group_then_runs_the_faster_and_keeps_checking_the_other():
    tuner = ThreadTuner((1, 2), min_samples=3, explore_every=16)
    chosen = drive(tuner, 8, {1: 10.0, 2: 12.0}, 64)
    assert chosen[:6].count(1) == 3 and chosen[:6].count(2) == 3  # both learned, in turn
    later = chosen[6:]
    assert later.count(2) == sum(1 for i in range(7, 65) if i % 16 == 0)  # only the exploring steps
    assert tuner.best() == {8: 1}
    # a clear loser (more than far_behind slower) is checked 4 times less often
    clear = drive(ThreadTuner((1, 2), min_samples=3, explore_every=16), 8, {1: 10.0, 2: 14.0}, 134)
    assert clear[6:].count(2) == 2  # steps 64 and 128
    # another group learns on its own, and there two threads are faster
    assert drive(tuner, 40, {1: 30.0, 2: 20.0}, 40)[6:].count(2) >= 30
    assert tuner.best() == {8: 1, 32: 2}
    assert (tuner.best_for(15), tuner.best_for(32), tuner.best_for(63)) == (1, 2, 2)  # each its group's
    assert tuner.best_for(4) is None  # a group never run


def test_a_group_has_no_best_while_it_learns():
    tuner = ThreadTuner((1, 2), min_samples=3)
    drive(tuner, 5, {1: 10.0, 2: 12.0}, 5)  # two threads ran 3 times, one thread twice
    assert tuner.best_for(5) is None and tuner.best() == {}
    drive(tuner, 5, {1: 10.0, 2: 12.0}, 1)
    assert tuner.best_for(5) == 1 and tuner.best() == {4: 1}


def test_a_group_starts_on_every_thread():
    """A group's first step runs on the default count: a fresh request's prefill is often the only
    step of its size for a while, and its time is the request's time to first token (measured on
    a fresh server, a 64-token prompt: 74-80 ms to its first token when that step ran on one
    thread of two, 55-65 ms on both)."""
    tuner = ThreadTuner((1, 2, 4))
    assert [drive(tuner, n, {1: 5.0, 2: 5.0, 4: 5.0}, 1)[0] for n in (1, 9, 70)] == [4, 4, 4]
    assert drive(tuner, 70, {1: 5.0, 2: 5.0, 4: 5.0}, 8) == [2, 1, 4, 2, 1, 4, 2, 1]  # then in turn


def test_a_change_of_load_changes_the_choice():
    tuner = ThreadTuner((1, 2), min_samples=2, explore_every=4)
    drive(tuner, 4, {1: 10.0, 2: 20.0}, 20)
    assert tuner.best() == {4: 1}
    chosen = drive(tuner, 4, {1: 30.0, 2: 20.0}, 40)  # one thread became the slow one
    assert tuner.best() == {4: 2}
    assert chosen[-12:].count(2) >= 9


def test_large_steps_always_use_every_thread_and_are_not_learned():
    tuner = ThreadTuner((1, 4), max_tokens=128)
    assert drive(tuner, 2048, {1: 1.0, 4: 100.0}, 10) == [4] * 10
    assert tuner.best() == {} and tuner.best_for(2048) is None
    assert ThreadTuner((2,)).choose(1) == 2


@pytest.mark.parametrize("candidates", [(), (2, 1), (1, 1), (0, 2)])
def test_bad_candidates_are_refused(candidates):
    with pytest.raises(ValueError, match="thread candidates"):
        ThreadTuner(candidates)


def test_the_counts_tried_are_one_doublings_and_all():
    assert [thread_ladder(n) for n in (1, 2, 3, 4, 6, 16)] == [
        (1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 4, 6), (1, 2, 4, 8, 16)]
    tuner = ThreadTuner(thread_ladder(6), min_samples=1, explore_every=2)
    chosen = drive(tuner, 10, {1: 9.0, 2: 5.0, 4: 4.0, 6: 4.5}, 40)
    assert tuner.best() == {8: 4} and set(chosen) == {1, 2, 4, 6}  # the others are still tried


def test_enabled_only_where_results_cannot_depend_on_it():
    plain = SimpleNamespace(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), backend=SimpleNamespace(partition_threads=None))
    packed = SimpleNamespace(model=torch.nn.Sequential(PackedLinear(torch.nn.Linear(4, 4))),
                             backend=SimpleNamespace(partition_threads=None))
    tuner, why = thread_tuner_for(packed, num_threads=2, world_size=1)
    assert tuner is not None and tuner.candidates == (1, 2)
    assert packed.backend.partition_threads == 2  # the partitions stop following the step's count
    assert thread_tuner_for(plain, 2, 1)[0] is None and "F.linear" in thread_tuner_for(plain, 2, 1)[1]
    assert thread_tuner_for(packed, 2, world_size=2)[0] is None
    assert thread_tuner_for(packed, 1, 1)[0] is None
    assert thread_tuner_for(packed, 2, 1, enabled=False) == (None, "--no-adaptive-threads")


@pytest.mark.slow  # packs and multiplies model-sized weights on one and two threads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_matmuls_give_the_same_bits_on_one_and_two_threads(dtype):
    # SmolLM2's layer shapes (fused qkv, o, fused gate/up, down) and a slice of its LM head, at the
    # row counts the tuner chooses for (up to its max_tokens)
    gen = torch.Generator().manual_seed(0)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 8192)]
    before = torch.get_num_threads()
    try:
        for k, n in shapes:
            layer = PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
            for rows in (1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 100, 128):
                x = torch.randn(rows, k, generator=gen).to(dtype)
                torch.set_num_threads(1)
                one = layer(x)
                torch.set_num_threads(2)
                two = layer(x)
                assert torch.equal(one, two), (k, n, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_attention_partitions_follow_partition_threads_not_the_step(dtype):
    # two rows of 9,000 tokens: few tasks, contexts long enough to partition
    rng = np.random.default_rng(1)
    num_blocks, block_size, kv_heads, head_dim = 1200, 16, 3, 64
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    if dtype == np.uint16:  # bfloat16 bits
        k, v = (torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for a in (k, v))
    q = rng.standard_normal((2, 9, head_dim), dtype=np.float32)
    tables = rng.permutation(num_blocks)[:2 * 570].reshape(2, 570).astype(np.int32)
    lens = np.array([9000, 8500], np.int32)

    def run(num_threads, partition_threads):
        out = np.zeros_like(q)
        attend_rows(out, q, k, v, tables, np.arange(2), lens, 0.125, num_threads=num_threads,
                    partition_threads=partition_threads)
        return out

    fixed = [run(t, partition_threads=2) for t in (1, 2)]
    assert np.array_equal(fixed[0], fixed[1])
    unfixed = [run(t, partition_threads=None) for t in (1, 2)]
    assert np.array_equal(unfixed[1], fixed[1])  # two threads partition as before
    assert not np.array_equal(unfixed[0], unfixed[1])  # without it, one thread sums in another order


def test_an_engine_switching_threads_every_step_gives_the_same_outputs():
    hf = tiny_llama(seed=11)
    prompts = {"a": [5, 9, 14, 3, 7, 22, 8], "b": list(range(30, 71)), "c": [11] * 19, "d": [4, 4, 2]}

    def outputs(engine):
        for request_id, prompt in prompts.items():
            engine.add(request_id, prompt, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        tokens = engine.run()
        logprobs = {r: [o.logprobs for o in outs] for r, outs in engine.outputs.items()}
        return tokens, logprobs

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = outputs(InProcessEngine(hf, backend="numba", dtype=torch.bfloat16))
        switching = InProcessEngine(hf, backend="numba", dtype=torch.bfloat16)
        tuner = ThreadTuner((1, 2), min_samples=2, explore_every=2)
        execute, used = switching.execute, []

        def tuned(step):
            return tuned_execute(tuner, execute, step, len(step.input_token_ids),
                                 lambda n: (used.append(n), torch.set_num_threads(n)))

        switching.execute = tuned
        assert outputs(switching) == fixed
        assert set(used) == {1, 2}
    finally:
        torch.set_num_threads(before)


def test_step_runner_logs_why_and_each_new_choice():
    class Log:
        def __init__(self):
            self.events = []

        def info(self, event, **fields):
            self.events.append((event, fields))

    runner = SimpleNamespace(model=torch.nn.Sequential(PackedLinear(torch.nn.Linear(4, 4))),
                             backend=SimpleNamespace(partition_threads=None),
                             execute=lambda step: len(step.input_token_ids))
    log = Log()
    before = torch.get_num_threads()
    try:
        run = step_runner(runner, 2, 1, True, log)
        step = SimpleNamespace(input_token_ids=[1, 2, 3])
        assert [run(step) for _ in range(10)] == [3] * 10
        larger = SimpleNamespace(input_token_ids=list(range(9)))
        assert [run(larger) for _ in range(10)] == [9] * 10
    finally:
        torch.set_num_threads(before)
    assert log.events[0] == ("threads per step", {"adaptive": True, "why": "one of 1, 2 threads per step, by time"})
    assert {event for event, _ in log.events} == {"threads per step"}
    chosen = [fields["by_min_tokens"] for event, fields in log.events[1:]]
    assert chosen and set(chosen[0]) == {2}  # steps of 2-3 tokens learned
    assert set(chosen[-1]) == {2, 8}  # then steps of 8-15: every group's choice is logged, not the last one's
    assert all(a != b for a, b in zip(chosen, chosen[1:]))  # logged only when a choice changed
    assert step_runner(runner, 2, 1, False, Log()) is None


class _RecordingBackend:
    """A backend double that records ``parallel_small_rows`` calls (and says the runtime spins)."""

    def __init__(self):
        self.partition_threads, self.small_rows_calls = None, []

    def parallel_small_rows(self, on):
        self.small_rows_calls.append(on)
        return on


def test_small_row_kernels_go_parallel_only_under_a_tuner():
    """With a tuner, each step's threads are chosen by its time, extra parallel regions included;
    without one (float32 on F.linear, one thread, several ranks, --no-adaptive-threads) the row
    kernels keep their thresholds."""
    def runner(linear):
        return SimpleNamespace(model=torch.nn.Sequential(linear), backend=_RecordingBackend())

    tuned = runner(PackedLinear(torch.nn.Linear(4, 4)))
    tuner, why = thread_tuner_for(tuned, 2, 1)
    assert tuner is not None and tuned.backend.small_rows_calls == [True] and "row kernels" in why
    for case, args in [(runner(torch.nn.Linear(4, 4)), (2, 1)), (runner(PackedLinear(torch.nn.Linear(4, 4))), (1, 1)),
                       (runner(PackedLinear(torch.nn.Linear(4, 4))), (2, 2))]:
        assert thread_tuner_for(case, *args)[0] is None and case.backend.small_rows_calls == []
    off = runner(PackedLinear(torch.nn.Linear(4, 4)))
    assert thread_tuner_for(off, 2, 1, enabled=False)[0] is None and off.backend.small_rows_calls == []
