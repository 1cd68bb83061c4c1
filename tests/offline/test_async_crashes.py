"""Executor crashes under async scheduling: a crash with two steps in flight recovers as in
lock-step (``test_recovery``'s crashing engine and reference run), and a request that crashes the
executor every time is failed alone.
"""

from __future__ import annotations

import pytest

from tests.doubles.engine import tiny_llama
from tests.scheduler.test_recovery import CrashingEngine, _add_all, _run, uninterrupted_run


@pytest.fixture(scope="module")
def crash_model():
    return tiny_llama(seed=5)


@pytest.fixture(scope="module")
def crash_workload(crash_model):
    return uninterrupted_run(crash_model)


def _crashing_engine(model, **kwargs):
    """``test_recovery``'s crashing engine, overlapped; records how many steps were in flight at
    each crash."""
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
