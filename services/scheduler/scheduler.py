"""Continuous batching policy: which sequences run in the next step. Plain Python, no I/O.

Each call to ``schedule`` builds one ``Step``: running sequences first (decodes, and prefills
still in progress, oldest first), then swapped groups coming back, then waiting sequences
admitted first come first served (reusing their prefix-cache hits) while the sequence budget, the
token budget and free blocks (above the watermark) allow; nothing new is admitted while a group
is swapped out. A long prompt is prefilled in chunks of at most the remaining token budget. When
a running sequence cannot get a block, the most recently arrived group is preempted, all its
sequences together: swapped to the CPU pool (``preemption_mode="swap"``, when there is room) or
freed and re-queued at the head to be prefilled again with its generated tokens (recompute).
``update`` applies a step's sampled tokens and returns the deltas for the frontend.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from shared.messages import AddRequest, RequestOutput, Step, StepResult

from .block_manager import AllocStatus, BlockManager
from .groups import SequenceGroupsMixin
from .logprobs import attach_logprobs
from .plan import Plan as _Plan
from .plan import SchedulerConfig
from .sequence import Sequence, SequenceStatus
from .stats import SchedulerStatsMixin
from .step_builder import Scheduled as _Scheduled
from .step_builder import build_step

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler(SequenceGroupsMixin, SchedulerStatsMixin):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self._init_groups()
        self._early_outputs: list[RequestOutput] = []
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.swapped: deque[list[Sequence]] = deque()  # groups whose blocks are in the CPU pool
        self.requests: dict[str, list[Sequence]] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self._freed_seq_ids: list[int] = []  # announced sequences the executors may forget
        self._in_flight: dict[int, list[_Scheduled]] = {}
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_recomputes = 0
        self.max_num_running = 0
        self.num_steps = 0
        self.sum_slots_used = 0
        self.sum_slots_allocated = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: AddRequest) -> list[RequestOutput]:
        """Queue a request; returns an immediate error output if it can never run."""
        prompt = [int(t) for t in req.prompt_token_ids]
        if not prompt:
            return [self._error(req.request_id, "the prompt is empty")]
        if req.request_id in self.requests:
            return [self._error(req.request_id, f"request id {req.request_id} is already in use")]
        if len(prompt) >= self.config.max_model_len:
            return [self._error(
                req.request_id,
                f"the prompt has {len(prompt)} tokens; the limit is {self.config.max_model_len - 1}",
            )]
        if self.blocks.can_admit(len(prompt) + 1, len(prompt) + 1) is AllocStatus.NEVER:
            return [self._error(
                req.request_id,
                f"the prompt needs {self.blocks.blocks_needed(len(prompt) + 1)} KV blocks; the pool "
                f"has {self.blocks.num_blocks} ({self.blocks.watermark_blocks} kept as watermark)",
            )]
        num_seqs = req.sampling.n if req.sampling.use_beam_search else max(req.sampling.n, req.sampling.best_of or 0)
        needed = self.blocks.blocks_needed(len(prompt)) + num_seqs  # shared prompt + one block each
        usable = self.blocks.num_blocks - self.blocks.watermark_blocks
        if num_seqs > 1 and needed > usable:
            return [self._error(
                req.request_id,
                f"{num_seqs} sequences (n/best_of) need at least {needed} KV blocks together; the pool "
                f"has {usable} usable",
            )]
        seqs = []
        group_sampling, num_seqs = self._group_sampling(req.request_id, req.sampling, len(prompt), req.eos_token_ids)
        for choice_idx in range(num_seqs):
            sampling = group_sampling
            if sampling.seed is not None and choice_idx:  # distinct, reproducible streams
                sampling = dataclasses.replace(sampling, seed=(sampling.seed + choice_idx) % 2**63)
            seq = Sequence(
                seq_id=self._next_seq_id, request_id=req.request_id, choice_idx=choice_idx,
                prompt_token_ids=prompt, sampling=sampling,
                eos_token_ids=frozenset(req.eos_token_ids), arrival_time=req.arrival_time,
            )
            self._next_seq_id += 1
            seqs.append(seq)
        # The first sequence prefills the prompt; the others fork from it once the prompt is in
        # the cache, sharing its blocks (the last, partly filled one is copied on first write).
        self.waiting.append(seqs[0])
        seqs[0].pending_children = seqs[1:]
        self.requests[req.request_id] = seqs
        self._start_groups(req.request_id, seqs, req.sampling)
        return []

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        self._forget_groups(request_id)
        for seq in self.requests.pop(request_id, ()):
            if seq.status is SequenceStatus.WAITING:
                if seq in self.waiting:  # else a child not yet forked
                    self.waiting.remove(seq)
            elif seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq.status is SequenceStatus.SWAPPED:
                self.swapped = deque(g for g in self.swapped if seq not in g)
                self.blocks.free_swapped(seq.seq_id)
            self._release(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> Step | None:
        """Pick the next batch and reserve its slots; None when nothing can run."""
        plan = _Plan(self.config.max_num_batched_tokens)

        # 1. Running sequences, oldest first; preempt the newest group when blocks run out.
        idx = 0
        while idx < len(self.running) and plan.token_budget > 0:
            seq = self.running[idx]
            if seq.num_pending_tokens == 0:  # a beam waiting for its group's decision
                idx += 1
                continue
            num_new = min(seq.num_pending_tokens, plan.token_budget)
            if self._make_room(seq, num_new, plan):
                plan.add(seq, num_new)
                self._fork_children(seq, num_new, plan)
                idx += 1
            else:
                break  # seq itself was preempted, and with it every newer sequence

        # 2. Swapped groups come back before anything new is admitted.
        while not plan.preempted and self.swapped and len(self.running) < self.config.max_num_seqs:
            group = self.swapped[0]
            ids = [s.seq_id for s in group]
            if not self.blocks.can_swap_in(ids):
                break
            self.swapped.popleft()
            plan.swap_in.extend(self.blocks.swap_in(ids))
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._insert_running(seq)
                num_new = min(seq.num_pending_tokens, plan.token_budget)
                if num_new and self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                                          seq.num_computed_tokens):
                    plan.add(seq, num_new)

        # 3. Waiting sequences, first come first served.
        while (not self.swapped and self.waiting and plan.token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            cached = self._prefix_hits(seq)
            num_computed = len(cached) * self.blocks.block_size
            num_new = min(seq.num_tokens - num_computed, plan.token_budget)
            reserve = self._admission_tokens(seq, num_computed + num_new)
            status = self.blocks.can_admit(reserve, seq.num_tokens, cached)
            if status is AllocStatus.NEVER:  # it grew larger than the whole pool: stop it there
                self.waiting.popleft()
                self._outgrown(seq)
                continue
            if status is not AllocStatus.OK:
                break
            if not self.blocks.allocate_slots(seq.seq_id, reserve, num_computed, cached):
                break
            self.waiting.popleft()
            self.blocks.record_lookup(seq.num_tokens, num_computed)
            if not seq.announced:
                seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            plan.add(seq, num_new)
            self._fork_children(seq, num_new, plan)

        self.max_num_running = max(self.max_num_running, len(self.running))
        if not plan.scheduled and not plan.swap_out and not plan.swap_in:
            return None
        self._account_utilization(plan.scheduled)
        step = build_step(self._next_step_id, plan.scheduled, self.blocks, self._freed_seq_ids,
                          plan.swap_out, plan.swap_in, self.blocks.take_copies())
        self._freed_seq_ids = []
        self._in_flight[step.step_id] = plan.scheduled
        self._next_step_id += 1
        return step

    def _outgrown(self, seq: Sequence) -> None:
        """A preempted sequence that no longer fits in the pool ends with ``length``."""
        request_id = seq.request_id
        outputs = [RequestOutput(request_id, seq.choice_idx, seq.output_token_ids[seq.num_output_sent:], "length",
                                 num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                                 num_preemptions=seq.num_preemptions)]
        if request_id in self.beam_searches or request_id in self.best_of:
            outputs = [self._error(request_id, "the sequence group outgrew the KV pool")]
            self.abort_request(request_id)
        else:
            self._release(seq, "length")
            if all(s.status is SequenceStatus.FINISHED for s in self.requests.get(request_id, [])):
                self.requests.pop(request_id, None)
        self._early_outputs += outputs

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs decided while scheduling rather than by a step's results."""
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def _admission_tokens(self, seq: Sequence, num_tokens: int) -> int:
        """Slots a newly admitted sequence takes: what it computes now, or a whole reservation."""
        if self.config.kv_policy == "contiguous":
            want = seq.num_prompt_tokens + seq.sampling.max_tokens
            return max(min(want, self.config.max_model_len), num_tokens)
        return num_tokens

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold this sequence's leading tokens (at least one token is left)."""
        if not self.blocks.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.blocks.block_size
        if len(seq.block_hashes) < limit:
            self.blocks.prefix_hashes(seq.token_ids, limit, seq.block_hashes)
        return self.blocks.match_prefix(seq.block_hashes, seq.num_tokens)

    def _cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are now full of computed tokens."""
        full = seq.num_computed_tokens // self.blocks.block_size
        if self.blocks.enable_prefix_caching and full > 0:
            if len(seq.block_hashes) < full:
                self.blocks.prefix_hashes(seq.token_ids, full, seq.block_hashes)
            self.blocks.cache_full_blocks(seq.seq_id, seq.block_hashes[:full])

    def _make_room(self, seq: Sequence, num_new: int, plan: _Plan) -> bool:
        """Allocate ``seq``'s slots, preempting the newest groups as needed; False if ``seq`` went."""
        while not self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                             seq.num_computed_tokens):
            victim = self.running[-1]
            group = [s for s in self.requests[victim.request_id] if s.status is SequenceStatus.RUNNING]
            plan.drop(group)
            self._preempt(group, plan)
            if seq in group:
                return False
        return True

    def _fork_children(self, parent: Sequence, num_new: int, plan: _Plan) -> None:
        """When ``parent`` finishes its prompt in this step, its siblings start sharing its blocks.

        Each child joins the step with no new token, right after the parent, so its first token
        is sampled from the parent's last hidden state.
        """
        if not parent.pending_children or parent.num_computed_tokens + num_new < parent.num_tokens:
            return
        plan.scheduled[-1].is_fork_parent = True
        for child in parent.pending_children:
            self.blocks.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens + num_new
            child.block_hashes = list(parent.block_hashes)
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            self._insert_running(child)
            plan.scheduled.append(_Scheduled(child, 0))
        parent.pending_children = []

    def _insert_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: (s.arrival_time, s.seq_id))

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; finish sequences that stop; return frontend deltas."""
        scheduled = self._in_flight.pop(result.step_id)
        if result.error is not None:
            return self._fail_step(scheduled, result.error)
        sampled = dict(zip(result.seq_ids.tolist(), result.token_ids.tolist()))
        rows = {seq_id: row for row, seq_id in enumerate(result.seq_ids.tolist())}  # for logprobs
        outputs: list[RequestOutput] = []
        beam_requests: set[str] = set()
        for s in scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step was in flight
            seq.num_computed_tokens += s.num_new_tokens
            self._cache_computed_blocks(seq)
            token_id = sampled.get(seq.seq_id)
            if token_id is None:
                continue  # a prefill chunk that is not the last one
            row = rows[seq.seq_id]
            if self._take_group_token(seq, result, row):
                beam_requests.add(seq.request_id)
                continue
            seq.append_token(token_id)
            if len(result.logprobs) > row:
                seq.cum_logprob += float(result.logprobs[row])
            reason = seq.stop_reason(self.config.max_model_len)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            delta = self._delta(seq)
            attach_logprobs(delta, result, row, seq.sampling.logprobs)
            outputs += self._route_delta(seq, delta)
        for request_id in beam_requests:
            outputs += self._advance_beams(request_id)
        return outputs

    # ------------------------------------------------------------------ helpers

    def _preempt(self, group: list[Sequence], plan: _Plan) -> None:
        """Preempt a whole group: swap its blocks out when configured and possible, else recompute."""
        ids = [s.seq_id for s in group]
        for seq in group:
            self.running.remove(seq)
            seq.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted = True
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(ids):
            plan.swap_out.extend(self.blocks.swap_out(ids))
            for seq in group:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            self.num_swap_outs += 1
            return
        for seq in reversed(group):  # recompute: free now, prefill prompt + output again later
            self.blocks.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.beam_candidates = None  # the re-prefill samples them again
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.num_recomputes += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        siblings = self.requests.get(seq.request_id, [])
        self._release(seq, reason)
        if all(s.status is SequenceStatus.FINISHED for s in siblings):
            self.requests.pop(seq.request_id, None)

    def _release(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.blocks.free(seq.seq_id)
        if seq.announced:
            self._freed_seq_ids.append(seq.seq_id)

    def _delta(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_output_sent:]
        seq.num_output_sent = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id, choice_idx=seq.choice_idx, new_token_ids=new,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_preemptions=seq.num_preemptions, num_cached_tokens=seq.num_cached_tokens,
        )

    def _fail_step(self, scheduled: list[_Scheduled], error: str) -> list[RequestOutput]:
        outputs = []
        for request_id in {s.seq.request_id for s in scheduled}:
            if request_id in self.requests:
                self.abort_request(request_id)
                outputs.append(self._error(request_id, f"the executor failed: {error}"))
        return outputs

    @staticmethod
    def _error(request_id: str, message: str) -> RequestOutput:
        return RequestOutput(request_id, 0, [], finish_reason="error", error=message)
