"""Continuous batching policy: which sequences run in the next step. Plain Python, no I/O.

Each call to ``schedule`` builds one ``Step`` in three phases: running sequences first (decodes,
and prefills still in progress, oldest first), then swapped groups coming back, then waiting
sequences admitted first come first served (reusing their prefix-cache hits) while the sequence
budget, the token budget and free blocks (above the watermark) allow; nothing new is admitted
while a group is swapped out. A long prompt is prefilled in chunks of at most the remaining token
budget. When a running sequence cannot get a block, the most recently arrived group is preempted,
all its sequences together: swapped to the CPU pool (``preemption_mode="swap"``, when there is
room) or freed and re-queued at the head to be prefilled again with its generated tokens
(recompute; ``preemption``). ``update`` applies a step's sampled tokens (``step_results``).
``reset_executor_state`` starts every sequence over when the executors lost their state
(``recovery``).

Async scheduling: the next step may be planned while the one before is in flight
(``can_schedule_ahead``), each sequence that one samples holding a placeholder for its token
(``in_flight``); ``update`` puts the token in its place, or drops what the next step computes for a
sequence that stopped on it. Outputs are lock-step's, but for unseeded random samples (the shared
generator draws for other rows).

The scheduler owns where each sequence is (its queues, the block manager); each request's
``SequenceGroup`` owns what its sequences say, and answers events with fork/finish/output
decisions that ``_apply`` carries out. Every output leaves through one outbox: ``take_outputs``.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from shared.messages import AddRequest, EngineStats, RequestOutput, Step, StepResult

from .admission import admit, refusal
from .block_manager import AllocStatus, BlockManager
from .groups import GroupUpdate, SequenceGroup, new_group
from .in_flight import StepsInFlight
from .outputs import error_output
from .plan import Plan, SchedulerConfig
from .preemption import preempt_newest
from .recovery import CrashLedger, crash_message, requeue_all
from .sequence import ErrorKind, Sequence, SequenceStatus
from .speculation import Speculator
from .stats import SchedulerStats
from .step_builder import build_step
from .step_results import apply_samples, failed_request_ids

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.stats = SchedulerStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.swapped: deque[list[Sequence]] = deque()  # groups whose blocks are in the CPU pool
        self.groups: dict[str, SequenceGroup] = {}  # unfinished requests
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._freed_seq_ids: list[int] = []  # announced sequences the executors may forget
        self._in_flight = StepsInFlight()
        self._outbox: list[RequestOutput] = []
        self.crashes = CrashLedger()  # requests that were in a step lost with its executors
        self.speculator = Speculator(config.speculative, self.stats, block_manager) if config.speculative else None

    # ------------------------------------------------------------------ requests in, outputs out

    def add_request(self, req: AddRequest) -> None:
        """Queue a request; one that can never run gets its error output at once."""
        reason = refusal(req, self.config, self.blocks)
        if reason is None and req.request_id in self.groups:
            reason = f"request id {req.request_id} is already in use"
        if reason is not None:
            self._outbox.append(error_output(req.request_id, reason))
            return
        group = new_group(req, self.config.max_model_len, self._seq_ids)
        # The first sequence prefills the prompt; the others fork from it once the prompt is in
        # the cache, sharing its blocks (the last, partly filled one is copied on first write).
        first = group.seqs[0]
        first.pending_children = group.seqs[1:]
        self.waiting.append(first)
        self.groups[req.request_id] = group

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is, sending nothing; its blocks are freed (``in_flight``: maybe later)."""
        group = self.groups.get(request_id)
        if group is not None:
            self._apply(group, group.abort())

    def take_outputs(self) -> list[RequestOutput]:
        """Every output decided since the last call, in order: the only way outputs leave."""
        outputs, self._outbox = self._outbox, []
        return outputs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    def engine_stats(self) -> EngineStats:
        """Queue sizes, block counts and the running counters, for the frontends."""
        return self.stats.snapshot(self.running, len(self.waiting), sum(len(g) for g in self.swapped), self.blocks)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> Step | None:
        """Pick the next batch and reserve its slots; None when nothing can run. While requests are
        suspected of crashing the executors, the first runs alone every other step (``recovery``)."""
        for only in self.crashes.turns(self.groups):  # the next turn first; the other if it is empty
            plan = self._plan(only)
            if not plan.empty:
                break
        self.stats.max_num_running = max(self.stats.max_num_running, len(self.running))
        if plan.empty:
            return None
        self.stats.record_step(plan.scheduled, self.running, self.blocks)
        step = build_step(next(self._step_ids), plan.scheduled, self.blocks, self._freed_seq_ids,
                          plan.swap_out, plan.swap_in, self.blocks.take_copies())
        self._freed_seq_ids = []
        self._in_flight.add(step.step_id, plan.scheduled)
        return step

    def can_schedule_ahead(self) -> bool:
        """Whether ``schedule`` may plan the next step before the one in flight is answered (async
        scheduling): not while beams or crash suspects run (``in_flight``), nor while a running
        sequence's prompt is being scored (``PromptScores``: its next chunk, or its first decode,
        must come after the scores of the chunk in flight), nor while one is mean-pooled (``Pooling``))."""
        return (not self.crashes.suspects and self._in_flight.can_plan_ahead()
                and (self.speculator is None or not self.speculator.wants_lockstep(self.running, self._in_flight))
                and not any(seq.prompt_scores is not None and not seq.prompt_scores.complete
                            for seq in self.running)
                and not any(seq.pooling is not None and seq.pooling.needs_every_position for seq in self.running))

    def _plan(self, only: str | None) -> Plan:
        """Running, then swapped, then waiting sequences, those the plan allows (``only``: that
        request alone; None: any but the suspects)."""
        plan = Plan(self.config.max_num_batched_tokens, only, frozenset(self.crashes.suspects))
        if plan.suspects:  # the waiting sequences this plan allows go first
            self.waiting = deque(sorted(self.waiting, key=lambda s: not plan.allows(s)))
        self._schedule_running(plan)
        self._schedule_swapped(plan)
        self._schedule_waiting(plan)
        return plan

    def _schedule_running(self, plan: Plan) -> None:
        """Running sequences, oldest first; the newest groups are preempted when blocks run out."""
        idx = 0
        while idx < len(self.running) and plan.token_budget > 0:
            seq = self.running[idx]
            if (seq.num_pending_tokens == 0  # a beam waiting for its group's decision
                    or seq.ends_by_length_ahead(self.config.max_model_len) or not plan.allows(seq)):
                idx += 1
                continue
            drafts = self.speculator.drafts(seq, plan.token_budget, len(self.running) - idx - 1,
                                            self.config.max_model_len, bool(self.waiting or self.swapped),
                                            len(self.running)) if self.speculator else []
            num_new = min(seq.num_pending_tokens, plan.token_budget) + len(drafts)
            if not self._make_room(seq, num_new, plan):
                break  # seq itself was preempted, and with it every newer sequence
            self._add_to_plan(plan, seq, num_new, drafts)
            idx += 1

    def _schedule_swapped(self, plan: Plan) -> None:
        """Swapped groups come back, oldest first, before anything new is admitted."""
        while not plan.preempted and self.swapped and len(self.running) < self.config.max_num_seqs:
            group = self.swapped[0]
            ids = [s.seq_id for s in group]
            if not plan.allows(group[0]) or not self.blocks.can_swap_in(ids):
                break
            self.swapped.popleft()
            plan.swap_in.extend(self.blocks.swap_in(ids))
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._insert_running(seq)
                num_new = min(seq.num_pending_tokens, plan.token_budget)
                self.blocks.free_out_of_window(seq.seq_id, seq.num_computed_tokens)
                if num_new and self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                                          seq.num_computed_tokens):
                    self._add_to_plan(plan, seq, num_new)

    def _schedule_waiting(self, plan: Plan) -> None:
        """Waiting sequences, first come first served, while budgets and blocks allow."""
        while (not self.swapped and self.waiting and plan.token_budget > 0 and plan.allows(self.waiting[0])
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            status, num_new = admit(seq, plan.token_budget, self.blocks, self.config)
            if status is AllocStatus.NEVER:  # it grew larger than the whole pool: stop it there
                self.waiting.popleft()
                group = self.groups[seq.request_id]
                self._apply(group, group.on_outgrown(seq))
                continue
            if status is not AllocStatus.OK:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            self._add_to_plan(plan, seq, num_new)

    def update(self, result: StepResult) -> None:
        """Apply a step's sampled tokens (each group decides what follows), then free the blocks that
        waited for the step. A result for a step not in flight (lost with its executors) is ignored."""
        scheduled = self._in_flight.pop(result.step_id)
        if scheduled is None:
            return
        if result.error is not None:
            self._fail([s.seq.request_id for s in scheduled], f"the executor failed: {result.error}")
        else:
            if len(result.failed_seq_ids):  # before the samples: theirs are not to be kept
                self._fail(failed_request_ids(scheduled, result),
                           f"the executor could not run this request as asked: {result.failure}")
            apply_samples(scheduled, result, self.blocks, self.groups, self._apply, self.speculator)
            self.crashes.release_caught_up(self.groups)
        for seq_id in self._in_flight.release(result.step_id):
            self.blocks.free(seq_id)
            self._freed_seq_ids.append(seq_id)

    def reset_executor_state(self, cause: str) -> None:
        """The executors lost their KV pools and sequences (a rank died, hung or was replaced).

        Every group is preempted by recompute (swap space died too) and every sequence goes back to
        the waiting queue unannounced; all blocks are freed and the prefix cache emptied. The steps
        in flight are forgotten and each of their requests counts a crash; one in its second fails
        with ``cause`` (see ``recovery``). Sequences keep their tokens: nothing sent is sent again."""
        lost = self._in_flight.request_ids()
        self._in_flight.clear()
        self._freed_seq_ids = []
        self.waiting = requeue_all(self.running, self.swapped, self.waiting, self.stats)
        self.running, self.swapped = [], deque()
        self.blocks.reset()
        self._fail(self.crashes.record(lost), crash_message(cause))

    # ------------------------------------------------------------------ applying decisions

    def _apply(self, group: SequenceGroup, update: GroupUpdate) -> None:
        """Carry out a group's decision: start its forks, free its finished sequences, send its outputs."""
        for fork in update.forks:
            self.blocks.fork(fork.parent.seq_id, fork.child.seq_id)
            self._insert_running(fork.child)
        for seq in update.finished:
            self._dequeue(seq)
            seq.status = SequenceStatus.FINISHED
            if self.speculator is not None:
                self.speculator.forget(seq.seq_id)
            if self._in_flight.hold(seq.seq_id):
                continue  # a step in flight still computes for it
            self.blocks.free(seq.seq_id)
            if seq.announced:
                self._freed_seq_ids.append(seq.seq_id)
        self._outbox += update.outputs
        if group.done:
            self.groups.pop(group.request_id, None)

    def _dequeue(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it (a sample not yet forked is in none)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped = deque(kept for g in self.swapped if (kept := [s for s in g if s is not seq]))
            self.blocks.free_swapped(seq.seq_id)

    def _fail(self, request_ids: list[str], message: str) -> None:
        for request_id in dict.fromkeys(request_ids):
            group = self.groups.get(request_id)
            if group is not None:
                self._apply(group, group.fail(message, ErrorKind.ENGINE))

    # ------------------------------------------------------------------ blocks and queues

    def _make_room(self, seq: Sequence, num_new: int, plan: Plan) -> bool:
        """Allocate ``seq``'s slots, preempting the newest groups as needed (``preemption``); False if
        ``seq`` went. Its blocks out of the sliding window go first (``sliding_window``)."""
        self.blocks.free_out_of_window(seq.seq_id, seq.num_computed_tokens)
        while not self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                             seq.num_computed_tokens):
            group, swapped = preempt_newest(self.running, self.groups, plan, self.blocks,
                                            self.config.preemption_mode, self.stats)
            if swapped:
                self.swapped.append(group)
            else:
                self.waiting.extendleft(reversed(group))  # to wait at the head, in order
            if seq in group:
                return False
        return True

    def _add_to_plan(self, plan: Plan, seq: Sequence, num_new: int, drafts: list[int] = ()) -> None:
        """``seq`` computes ``num_new`` tokens (``drafts`` among them); the samples waiting for its
        prompt fork if it completes."""
        plan.add(seq, num_new, drafts)
        for child in plan.fork_children(seq, num_new, self.blocks):
            self._insert_running(child)

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: (s.arrival_time, s.seq_id))
