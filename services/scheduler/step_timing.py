"""When to plan the next step while one is in flight (async scheduling), from how long recent steps
took. Plain Python and numpy, no I/O: the caller passes the clock's readings.

Planning step N + 1 the moment step N is sent hides the planning (schedule, encode, send: a few
milliseconds) behind N's compute, but a request that arrives while N runs then joins N + 2 at the
earliest: its prompt waits for all of N + 1, planned before it came. Planned shortly before N is
expected to end, N + 1 still goes out before the executors need it, and a request that arrives
during most of N joins N + 1, one step sooner (a decode step at batch 64 takes 75-110 ms on a
2-core Xeon; a burst's first step, one short prompt, was followed by a step planned before the rest
of the burst had arrived).

The expected time of the step in flight comes from the recent steps' compute times against their
token counts: a line fitted by Theil-Sen (the median of pairwise slopes), which a few outliers (a
first step that loads kernels, a neighbour's burst of work) do not move. A step's compute starts
when it is sent, or, planned ahead, when the step before it is answered. The plan is made at
``start + fraction * expected - lead`` (``--plan-ahead-at``, default ``PLAN_AT_FRACTION``; 0 plans at
once), the lead being twice the recent planning time: on
the early side, since a plan made after the step ended leaves the executors idle for its length.
With too few steps seen (a fresh start, executors just replaced) the next step is planned at once,
as before.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from shared.engine_flags import SchedulingFlags

WINDOW = 32  # recent steps the fit uses
MIN_SAMPLES = 4  # steps seen before the timing is trusted
# of the expected compute time, from the step's start: --plan-ahead-at's default (shared.engine_flags)
PLAN_AT_FRACTION = SchedulingFlags().plan_ahead_at
MIN_LEAD_S = 0.001


class PlanAheadTimer:
    def __init__(self, fraction: float = PLAN_AT_FRACTION) -> None:
        self.fraction = fraction  # of the expected time, from the start; 0: plan at once
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, compute seconds)
        self._in_flight: dict[int, tuple[int, float]] = {}  # step id -> (tokens, send time), in order
        self._last_answer = float("-inf")  # when the last step was answered
        self._plan_s = 0.0  # recent planning time (exponentially weighted)
        self._plan_at: float | None = None  # plan_ahead_at's answer until the steps change

    def sent(self, step_id: int, num_tokens: int, now: float, plan_seconds: float) -> None:
        """Step ``step_id`` of ``num_tokens`` tokens went out at ``now``; planning and sending it
        took ``plan_seconds``."""
        self._in_flight[step_id] = (num_tokens, now)
        self._plan_at = None
        self._plan_s = plan_seconds if self._plan_s == 0.0 else 0.8 * self._plan_s + 0.2 * plan_seconds

    def answered(self, step_id: int, now: float) -> None:
        """Step ``step_id``'s result came back at ``now`` (steps are answered in the order sent)."""
        entry = self._in_flight.pop(step_id, None)
        if entry is not None:
            num_tokens, sent = entry
            self._samples.append((num_tokens, now - max(sent, self._last_answer)))
        self._last_answer = now
        self._plan_at = None

    def forget(self) -> None:
        """The executors were replaced: their steps are gone and their speed is unknown."""
        self.__init__(self.fraction)

    def expected_seconds(self, num_tokens: int) -> float | None:
        """The compute time expected of a step of ``num_tokens`` tokens; None with too few steps seen."""
        if len(self._samples) < MIN_SAMPLES:
            return None
        tokens = np.array([s[0] for s in self._samples], np.float64)
        seconds = np.array([s[1] for s in self._samples], np.float64)
        dt = tokens[:, None] - tokens[None, :]
        pairs = dt > 0
        slope = max(float(np.median((seconds[:, None] - seconds[None, :])[pairs] / dt[pairs])), 0.0) if pairs.any() else 0.0
        return max(float(np.median(seconds + slope * (num_tokens - tokens))), 0.0)

    def plan_ahead_at(self) -> float:
        """The time from which the step after the one in flight may be planned: ``-inf`` (at once)
        unless exactly one step is in flight and its time can be expected. (Asked at every turn of
        the scheduler's loop: worked out once per step sent or answered.)"""
        if self._plan_at is None:
            self._plan_at = self._work_out_plan_at()
        return self._plan_at

    def _work_out_plan_at(self) -> float:
        if len(self._in_flight) != 1 or self.fraction <= 0:
            return float("-inf")
        ((num_tokens, sent),) = self._in_flight.values()
        expected = self.expected_seconds(num_tokens)
        if expected is None:
            return float("-inf")
        start = max(sent, self._last_answer)
        return start + self.fraction * expected - max(2 * self._plan_s, MIN_LEAD_S)
