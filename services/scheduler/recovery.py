"""When the executors lose their state (a rank died, hung, or was replaced): every sequence starts
over by recompute, and a request that keeps killing executors is failed alone. Plain Python, no I/O.

The KV pools died with the process, so a lost executor is a recompute preemption of everything at
once (``requeue_all``): each sequence keeps its prompt and outputs (the outputs already sent stay
sent), goes back to the waiting queue in arrival order with nothing computed and nothing announced,
and is prefilled again by the new executor.

Crashes are counted per request (``CrashLedger``): each request in a step in flight when the
executors were lost counts one and becomes a *suspect*. Suspects then run one at a time, each
alone in its steps, until it has caught up (prefilled everything it had again and sampled the next
token); then it is cleared. A crash while a suspect runs alone is its own, so a request is failed
when it has been in ``MAX_CRASHES`` crashes, and no innocent request ever shares a step with a
suspect. Steps alternate between the first suspect alone and everything but the suspects (``turns``),
so the others keep going and free the blocks the suspect may need.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable

from .groups import SequenceGroup
from .sequence import Sequence, SequenceStatus
from .stats import SchedulerStats

MAX_CRASHES = 2


class CrashLedger:
    """Crash counts of the suspects, and the order in which they run alone."""

    def __init__(self) -> None:
        self.crashes: dict[str, int] = {}  # request id -> crashes it was in, while a suspect
        self.suspects: deque[str] = deque()  # in the order they run alone
        self._suspect_turn = True  # whether the next step is the first suspect's

    def record(self, request_ids: Iterable[str]) -> list[str]:
        """One crash for each request of the lost step; returns those to fail (``MAX_CRASHES``)."""
        failed = []
        for request_id in dict.fromkeys(request_ids):
            num = self.crashes.get(request_id, 0) + 1
            if num >= MAX_CRASHES:
                failed.append(request_id)
                self.clear(request_id)
                continue
            self.crashes[request_id] = num
            if request_id not in self.suspects:
                self.suspects.append(request_id)
        return failed

    def current(self, unfinished: Container[str]) -> str | None:
        """The suspect that runs alone now (suspects that ended meanwhile are dropped), or None."""
        while self.suspects and self.suspects[0] not in unfinished:
            self.crashes.pop(self.suspects.popleft(), None)
        return self.suspects[0] if self.suspects else None

    def turns(self, unfinished: Container[str]) -> list[str | None]:
        """Whom the next step is for, and whom instead if nothing of theirs can run: the first
        suspect alone (its request id), or everyone but the suspects (None). Turns alternate."""
        suspect = self.current(unfinished)
        if suspect is None:
            return [None]
        turn = [suspect, None] if self._suspect_turn else [None, suspect]
        self._suspect_turn = not self._suspect_turn
        return turn

    def release_caught_up(self, groups: dict[str, SequenceGroup]) -> None:
        """Clear the first suspect once it has caught up (after a step that did not crash)."""
        suspect = self.current(groups)
        if suspect is not None and caught_up(groups[suspect]):
            self.clear(suspect)

    def clear(self, request_id: str) -> None:
        self.crashes.pop(request_id, None)
        if request_id in self.suspects:
            self.suspects.remove(request_id)


def caught_up(group: SequenceGroup) -> bool:
    """Every live sequence of ``group`` runs with at most its next token to feed (nothing left to
    prefill, no sample waiting to fork)."""
    return all(s.status is SequenceStatus.RUNNING and s.num_pending_tokens <= 1 and not s.pending_children
               for s in group.live)


def requeue_all(running: list[Sequence], swapped: Iterable[list[Sequence]], waiting: Iterable[Sequence],
                stats: SchedulerStats) -> deque[Sequence]:
    """Every sequence, waiting in arrival order with nothing computed and nothing announced (the
    caller empties the block manager). Each running or swapped group counts one recompute
    preemption, and its sequences one preemption each."""
    preempted = [*running, *(seq for group in swapped for seq in group)]
    for request_id in dict.fromkeys(seq.request_id for seq in preempted):
        stats.record_preemption(swapped=False)
    for seq in preempted:
        seq.num_preemptions += 1
    seqs = [*preempted, *waiting]
    for seq in seqs:
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.announced = False  # the new executors know no sequence
        seq.beam_candidates = None  # the re-prefill samples them again
        seq.num_placeholders = 0  # their tokens were lost with the steps in flight
    return deque(sorted(seqs, key=lambda s: (s.arrival_time, s.seq_id)))


def crash_message(cause: str) -> str:
    return (f"the request was running in {MAX_CRASHES} executor crashes in a row (last: {cause}); it was "
            f"failed alone so that the other requests can run")
