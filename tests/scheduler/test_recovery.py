"""The scheduler when its executors lose their state (``Scheduler.reset_executor_state``): every
sequence starts over by recompute and continues where it was, a request that keeps crashing the
executor is failed alone, and a request resumed after a scheduler restart continues exactly.

The "executor" is the in-process runner; a crash is a step that never returns, after which the
runner forgets every sequence and its KV pool is overwritten with noise (a new process's pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scheduler.recovery import MAX_CRASHES, CrashLedger
from shared.messages import AddRequest, SamplingParams, Step, StepResult
from tests.doubles.engine import InProcessEngine, tiny_llama


class ExecutorCrashed(Exception):
    pass


class CrashingEngine(InProcessEngine):
    """``InProcessEngine`` whose executor dies on a step holding a request in ``poison`` or when
    ``crash_next`` is set. Records which requests each executed step held."""

    def __init__(self, *args, poison: frozenset[str] = frozenset(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poison = poison
        self.crash_next = False
        self.num_crashes = 0
        self.step_requests: list[set[str]] = []  # per step that ran or crashed
        self.step_suspects: list[set[str]] = []  # the crash suspects when each step went out
        self._owner: dict[int, str] = {}

    def execute(self, step: Step) -> StepResult:
        for new in step.new_seqs:
            self._owner[new.seq_id] = new.request_id
        held = {self._owner[s] for s in step.seq_ids.tolist()}
        self.step_requests.append(held)
        self.step_suspects.append(set(self.scheduler.crashes.suspects))
        if self.crash_next or held & self.poison:
            self.crash_next = False
            raise ExecutorCrashed()
        return super().execute(step)

    def step(self):
        try:
            return super().step()
        except ExecutorCrashed:
            self.num_crashes += 1
            self.scheduler.reset_executor_state(f"rank 0 crashed ({self.num_crashes})")
            self.runner.forget_sequences()
            for key_cache, value_cache in self.runner.kv_caches:  # a new process: its pool holds noise
                key_cache.normal_()
                value_cache.normal_()
            self.blocks.check_integrity()
            return []


def _workload(num: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(n),), generator=gen).tolist() for n in torch.randint(3, 20, (num,), generator=gen)]
    max_new = [int(m) for m in torch.randint(15, 35, (num,), generator=gen)]
    return prompts, max_new


def _add_all(engine, prompts, max_new, **sampling):
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert engine.add(f"r{i}", p, temperature=0.0, max_tokens=m, ignore_eos=True, **sampling) == []


def _run(engine) -> dict[str, list[int]]:
    """Step until done; every request's tokens, over all of its outputs since the start."""
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
    for out in engine.scheduler.take_outputs():  # failures decided by the last reset
        engine.outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work()
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in engine.outputs.items()}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def uninterrupted_run(model):
    """The workload run to its end without a crash: ``(prompts, max_new, outputs)``."""
    prompts, max_new = _workload()
    engine = InProcessEngine(model, num_blocks=256)
    _add_all(engine, prompts, max_new)
    return prompts, max_new, _run(engine)


@pytest.fixture(scope="module")
def workload(model):
    return uninterrupted_run(model)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("crash_after", [1, 6, 25])
def test_streams_continue_identically_after_a_crash(model, workload, mode, crash_after):
    """Under KV pressure (preemptions, swaps), the executor dies with a step in flight: every
    request ends with exactly the tokens of an uninterrupted run, and every block is free."""
    prompts, max_new, expected = workload
    engine = CrashingEngine(model, num_blocks=40, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    _add_all(engine, prompts, max_new)
    for _ in range(crash_after):
        engine.step()
    swapped_at_crash = sum(len(g) for g in engine.scheduler.swapped)
    engine.crash_next = True
    tokens = _run(engine)
    assert engine.num_crashes == 1
    assert tokens == expected
    assert all(out[-1].finish_reason == "length" for out in engine.outputs.values())
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.blocks.cpu_free_queue) == engine.blocks.num_cpu_blocks
    assert engine.scheduler.num_unfinished_requests == 0
    if mode == "swap" and crash_after == 25:
        assert swapped_at_crash > 0, "the workload should have had swapped groups at the crash"


def test_reset_frees_blocks_swap_and_prefix_cache(model):
    engine = InProcessEngine(model, num_blocks=40, preemption_mode="swap", num_cpu_blocks=64)
    prompts, max_new = _workload()
    _add_all(engine, prompts, max_new)
    while not engine.scheduler.swapped:
        engine.step()
    sched = engine.scheduler
    assert engine.blocks.num_cached_blocks + engine.blocks.num_used_blocks > 0
    running = {s.seq_id for s in sched.running}
    in_flight = sched.schedule()
    sched.reset_executor_state("rank 0 died")
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks == 40 and not engine.blocks.cached and not engine.blocks.block_tables
    assert len(engine.blocks.cpu_free_queue) == 64 and not engine.blocks.cpu_tables
    assert not sched.running and not sched.swapped
    assert all(s.num_computed_tokens == 0 and not s.announced for s in sched.waiting)
    assert [s.arrival_time for s in sched.waiting] == sorted(s.arrival_time for s in sched.waiting)
    assert sched.update(StepResult(in_flight.step_id, in_flight.seq_ids, in_flight.seq_ids)) is None  # ignored
    assert {s.seq_id for s in sched.waiting} >= running
    assert sched.take_outputs() == []  # one crash fails nobody
    assert sched.crashes.suspects  # the requests of the lost step


def test_a_request_that_crashes_the_executor_every_time_is_failed_alone(model, workload):
    prompts, max_new, expected = workload
    engine = CrashingEngine(model, num_blocks=256, poison=frozenset({"poison"}))
    _add_all(engine, prompts[:5], max_new[:5])
    engine.step()
    engine.add("poison", [9, 8, 7, 6, 5], temperature=0.0, max_tokens=20, ignore_eos=True)
    _add_all_rest = [(f"r{i}", prompts[i], max_new[i]) for i in range(5, len(prompts))]
    for request_id, prompt, m in _add_all_rest:
        engine.add(request_id, prompt, temperature=0.0, max_tokens=m, ignore_eos=True)
    tokens = _run(engine)
    assert engine.num_crashes == MAX_CRASHES
    [failure] = engine.outputs["poison"]
    assert failure.finish_reason == "error" and failure.request_finished
    assert f"{MAX_CRASHES} executor crashes" in failure.error
    assert {k: v for k, v in tokens.items() if k != "poison"} == expected
    crashed_steps = [i for i, held in enumerate(engine.step_requests) if "poison" in held]
    assert len(crashed_steps) == MAX_CRASHES
    assert engine.step_requests[crashed_steps[-1]] == {"poison"}  # its second crash: it ran alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_suspects_run_alone_until_caught_up_then_batching_resumes(model, workload):
    prompts, max_new, expected = workload
    engine = CrashingEngine(model, num_blocks=256)
    _add_all(engine, prompts[:4], max_new[:4])
    engine.step()
    engine.step()
    engine.crash_next = True
    engine.step()
    suspects = set(engine.step_requests[-1])
    assert len(suspects) == 4
    _add_all_late = [(f"r{i}", prompts[i], max_new[i]) for i in range(4, 6)]
    for request_id, prompt, m in _add_all_late:  # they arrive after the crash: not suspects
        engine.add(request_id, prompt, temperature=0.0, max_tokens=m, ignore_eos=True)
    tokens = _run(engine)
    after = list(zip(engine.step_requests[3:], engine.step_suspects[3:]))
    for held, suspects_then in after:  # a suspect never shares a step
        assert len(held) == 1 or not held & suspects_then
    assert {next(iter(held)) for held, _ in after if len(held) == 1 and held & suspects} == suspects
    late = {"r4", "r5"}
    while_suspects = [held for held, suspects_then in after if suspects_then]
    assert any(held & late for held in while_suspects)  # the others' turns came between
    assert any(len(held & suspects) > 1 for held, _ in after)  # then batching resumed
    assert tokens == {k: v for k, v in expected.items() if k in tokens} and len(tokens) == 6


def test_groups_survive_a_crash(model):
    """n, best_of and beam search across a crash, against the same requests uninterrupted."""
    requests = [("n", dict(n=3, temperature=0.0)), ("best", dict(n=2, best_of=3, temperature=0.0)),
                ("beam", dict(n=3, use_beam_search=True, temperature=0.0))]
    results = []
    for crash in (False, True):
        engine = CrashingEngine(model, num_blocks=128)
        for request_id, sampling in requests:
            engine.add(request_id, [3, 14, 15, 92, 65], max_tokens=12, ignore_eos=True, **sampling)
        for _ in range(4):
            engine.step()
        engine.crash_next = crash
        _run(engine)
        results.append({rid: _merge(outs) for rid, outs in engine.outputs.items()})
        assert engine.num_crashes == int(crash)
        assert engine.blocks.num_free_blocks == 128
    assert results[0] == results[1]
    assert [len(results[1][rid]) for rid in ("n", "best", "beam")] == [3, 2, 3]


def _merge(outputs) -> dict[int, tuple[list[int], str | None]]:
    """choice -> (its tokens, its finish reason)."""
    choices: dict[int, tuple[list[int], str | None]] = {}
    for out in outputs:
        token_ids, _ = choices.get(out.choice_idx, ([], None))
        choices[out.choice_idx] = (token_ids + out.new_token_ids, out.finish_reason)
    return choices


@pytest.mark.parametrize("sampling", [{}, {"frequency_penalty": 0.8, "repetition_penalty": 1.3, "min_tokens": 12}],
                         ids=["plain", "penalties"])
def test_a_resumed_request_continues_exactly(model, sampling):
    """``resumed_token_ids`` (a scheduler restart): the outputs continue as if never interrupted,
    counting the resumed tokens for max_tokens, min_tokens and penalties, and never sent again."""
    prompt = [11, 22, 33, 44, 55, 66]
    params = dict(temperature=0.0, max_tokens=24, eos_token_ids=[7], **sampling)
    whole = InProcessEngine(model, num_blocks=64)
    whole.add("r", prompt, eos=[7], **params)
    expected = _run(whole)["r"]
    assert len(expected) > 12
    resumed = InProcessEngine(model, num_blocks=64)
    request = AddRequest("r.1", np.array(prompt, np.int32), SamplingParams(**params), 0.0,
                         resumed_token_ids=np.array(expected[:9], np.int32))
    resumed.add_request(request)
    assert resumed.scheduler.take_outputs() == []
    assert _run(resumed)["r.1"] == expected[9:]


def test_a_resumed_request_must_be_a_single_sequence(model):
    engine = InProcessEngine(model, num_blocks=64)
    for sampling in (SamplingParams(n=2), SamplingParams(best_of=2), SamplingParams(use_beam_search=True)):
        engine.add_request(AddRequest("x", np.array([1, 2], np.int32), sampling, 0.0,
                                      resumed_token_ids=np.array([3], np.int32)))
        [out] = engine.scheduler.take_outputs()
        assert out.finish_reason == "error" and "resumed" in out.error


def test_crash_ledger_counts_crashes_and_alternates_turns():
    ledger = CrashLedger()
    assert ledger.turns({"a"}) == [None]
    assert ledger.record(["a", "b", "a"]) == []
    assert list(ledger.suspects) == ["a", "b"]
    assert ledger.turns({"a", "b"}) == ["a", None]
    assert ledger.turns({"a", "b"}) == [None, "a"]
    assert ledger.record(["a"]) == ["a"]  # its second crash
    assert list(ledger.suspects) == ["b"] and "a" not in ledger.crashes
    assert ledger.current({"c"}) is None  # b ended meanwhile
    assert not ledger.crashes and not ledger.suspects
    assert ledger.record(["c"]) == []
    ledger.clear("c")
    assert ledger.record(["c"]) == []  # cleared: its count started over
