"""The steps sent to the executors and not yet answered: one in lock-step, two with async scheduling,
where the next step is planned while the executors compute the one before. Plain Python, no I/O.

Sending a step moves its sequences ahead (``add``): each counts the step's new tokens as computed,
and one placeholder more when the step samples it (its token is known when the step's result comes
back, and ``Scheduler.update`` puts it in the placeholder's place). A step may be planned while
another is in flight (``can_plan_ahead``) unless that one holds beams (a beam search rewrites its
beams from the result: those steps run lock-step) or crash suspects run alone (``recovery``
counts each crash against the steps in flight; one step at a time keeps the count as exact as it
was before).

A sequence that ends while a later step in flight still computes for it (it stopped in step N, and
step N + 1 already feeds it the token it stopped on; or it was aborted) keeps its device blocks
until that step is done (``hold``, then ``release`` with that step's result), so that the pool's
books (and the playground's map) show them as its own while they are written for it. Safety does
not depend on it: the executors run steps in the order sent, so a block freed while a step in
flight writes it (as a recompute preemption does, at once) is written by that step before any
later step that is given the block.
"""

from __future__ import annotations

from .step_builder import Scheduled


class StepsInFlight:
    def __init__(self) -> None:
        self._steps: dict[int, list[Scheduled]] = {}  # step id -> its sequences, in the order sent
        self._last_step: dict[int, int] = {}  # seq id -> the last step in flight that schedules it
        self._held: dict[int, list[int]] = {}  # step id -> sequences whose blocks wait for it

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step_id: int, scheduled: list[Scheduled]) -> None:
        """``scheduled`` went out as step ``step_id``: move its sequences ahead."""
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.num_placeholders += s.samples
            self._last_step[s.seq.seq_id] = step_id
        self._steps[step_id] = scheduled

    def pop(self, step_id: int) -> list[Scheduled] | None:
        """The sequences of step ``step_id``, now answered; None if it is not in flight."""
        scheduled = self._steps.pop(step_id, None)
        for s in scheduled or ():
            if self._last_step.get(s.seq.seq_id) == step_id:
                del self._last_step[s.seq.seq_id]
        return scheduled

    def hold(self, seq_id: int) -> bool:
        """Keep the blocks of ``seq_id`` (it ended) until the last step in flight that schedules it
        is done; False when none does (free them now)."""
        step_id = self._last_step.get(seq_id)
        if step_id is None:
            return False
        self._held.setdefault(step_id, []).append(seq_id)
        return True

    def schedules(self, seq_id: int) -> bool:
        """Whether a step in flight computes for ``seq_id``."""
        return seq_id in self._last_step

    def release(self, step_id: int) -> list[int]:
        """The sequences whose blocks waited for step ``step_id``: free them now."""
        return self._held.pop(step_id, [])

    def can_plan_ahead(self) -> bool:
        """Whether the next step may be planned before the one in flight is answered (crash
        suspects aside: the scheduler knows them)."""
        if len(self._steps) != 1:
            return False
        (scheduled,) = self._steps.values()
        return not any(s.seq.sampling.use_beam_search for s in scheduled)

    def has_drafts(self) -> bool:
        """Whether a step in flight verifies speculative drafts (``speculation``)."""
        return any(s.draft_token_ids for scheduled in self._steps.values() for s in scheduled)

    def request_ids(self) -> list[str]:
        """The requests of every step in flight (with repeats)."""
        return [s.seq.request_id for scheduled in self._steps.values() for s in scheduled]

    def clear(self) -> None:
        """Forget every step (lost with the executors): nothing is held any more."""
        self._steps.clear()
        self._last_step.clear()
        self._held.clear()
