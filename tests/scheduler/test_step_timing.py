"""When the scheduler plans the step after the one in flight (``services/scheduler/step_timing.py``),
on made-up clock readings."""

from __future__ import annotations

import math

import pytest

from services.scheduler import step_timing
from services.scheduler.step_timing import PlanAheadTimer


def _run_steps(timer: PlanAheadTimer, steps: list[tuple[int, float]], start: float = 0.0,
               plan_s: float = 0.002) -> float:
    """Steps of (tokens, compute seconds) one after another, lock-step; returns the clock after."""
    now, step_id = start, 0
    for tokens, seconds in steps:
        timer.sent(step_id, tokens, now, plan_s)
        now += seconds
        timer.answered(step_id, now)
        step_id += 1
        now += plan_s
    return now


def test_plans_at_once_until_enough_steps_are_seen():
    timer = PlanAheadTimer()
    assert timer.plan_ahead_at() == -math.inf  # nothing in flight
    now = _run_steps(timer, [(64, 0.08)] * (step_timing.MIN_SAMPLES - 1))
    timer.sent(99, 64, now, 0.002)
    assert timer.expected_seconds(64) is None
    assert timer.plan_ahead_at() == -math.inf  # as before this module: plan at once


def test_a_decode_step_is_planned_shortly_before_its_expected_end():
    """Steady 80 ms decode steps: the next one is planned at 75% of 80 ms, less twice the planning
    time, after the step in flight started; and not while two steps are in flight."""
    timer = PlanAheadTimer()
    now = _run_steps(timer, [(64, 0.080)] * 10, plan_s=0.002)
    assert timer.expected_seconds(64) == pytest.approx(0.080)
    timer.sent(10, 64, now, 0.002)
    assert timer.plan_ahead_at() == pytest.approx(now + 0.75 * 0.080 - 2 * 0.002)
    timer.sent(11, 64, now + 0.05, 0.002)  # planned ahead anyway: two in flight
    assert timer.plan_ahead_at() == -math.inf


def test_a_step_planned_ahead_starts_when_the_one_before_is_answered():
    """Step 11 went out while step 10 ran: its compute time counts from 10's answer, both in what
    it teaches the fit and in when the step after it is planned."""
    timer = PlanAheadTimer()
    now = _run_steps(timer, [(32, 0.050)] * 8, plan_s=0.001)
    timer.sent(10, 32, now, 0.001)
    timer.sent(11, 32, now + 0.030, 0.001)  # while 10 runs
    timer.answered(10, now + 0.050)
    assert timer.plan_ahead_at() == pytest.approx(now + 0.050 + 0.75 * 0.050 - 2 * 0.001, abs=1e-4)
    timer.answered(11, now + 0.100)  # 50 ms of compute, not 70 since it was sent
    assert timer.expected_seconds(32) == pytest.approx(0.050)


def test_the_fit_follows_token_counts_and_shrugs_off_outliers():
    """Steps cost 30 ms plus 0.5 ms a token; two slow outliers (a first step loading kernels, a
    neighbour's burst) do not move the expectation of a step of a size never seen."""
    timer = PlanAheadTimer()
    sizes = [1, 8, 16, 64, 128, 256, 33, 5, 90, 200]
    steps = [(n, 0.030 + 0.0005 * n) for n in sizes]
    steps[0] = (1, 3.0)
    steps[5] = (256, 1.5)
    _run_steps(timer, steps)
    assert timer.expected_seconds(2048) == pytest.approx(0.030 + 0.0005 * 2048, rel=0.02)
    assert timer.expected_seconds(1) == pytest.approx(0.0305, rel=0.02)


def test_an_overdue_step_lets_the_next_be_planned_now():
    timer = PlanAheadTimer()
    now = _run_steps(timer, [(16, 0.040)] * 6)
    timer.sent(6, 16, now, 0.002)
    assert timer.plan_ahead_at() < now + 0.040  # due before the step's expected end


def test_forget_starts_over():
    timer = PlanAheadTimer()
    now = _run_steps(timer, [(16, 0.040)] * 6)
    timer.sent(6, 16, now, 0.002)
    timer.forget()  # new executors: unknown speed, the old step is gone
    assert timer.expected_seconds(16) is None
    timer.sent(0, 16, now + 1, 0.002)
    assert timer.plan_ahead_at() == -math.inf


def test_fraction_zero_plans_at_once_as_before():
    """``--plan-ahead-at 0``: the step after the one in flight is planned as soon as that one is sent."""
    timer = PlanAheadTimer(0.0)
    now = _run_steps(timer, [(64, 0.080)] * 10)
    timer.sent(10, 64, now, 0.002)
    assert timer.expected_seconds(64) == pytest.approx(0.080)
    assert timer.plan_ahead_at() == -math.inf
    timer.forget()
    assert timer.fraction == 0.0


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_the_scheduler_refuses_a_fraction_outside_0_1(value):
    from services.scheduler.main import SchedulerProcessConfig
    from shared.endpoints import Endpoints

    with pytest.raises(ValueError, match="--plan-ahead-at must be between 0 and 1"):
        SchedulerProcessConfig(endpoints=Endpoints("ipc:///tmp/a", "ipc:///tmp/b", "ipc:///tmp/c"),
                               plan_ahead_at=value)
