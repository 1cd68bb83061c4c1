"""Continuous batching policy: which sequences run in the next step. Plain Python, no I/O.

Each call to ``schedule`` builds one ``Step``: running sequences first (decodes, and prefills
still in progress, oldest first), then waiting sequences admitted first come first served while
the sequence budget, the token budget and free blocks (above the watermark) allow. A long prompt
is prefilled in chunks of at most the remaining token budget. When a running sequence cannot get
a block, the most recently arrived running sequence is preempted by recompute: its blocks are
freed and it goes back to the head of the queue, to be prefilled again with its generated tokens.
``update`` applies a step's sampled tokens and returns the deltas for the frontend.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from shared.messages import AddRequest, NewSequence, RequestOutput, Step, StepResult

from .block_manager import AllocStatus, BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


@dataclass
class _Scheduled:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.requests: dict[str, list[Sequence]] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self._freed_seq_ids: list[int] = []  # announced sequences the executors may forget
        self._in_flight: dict[int, list[_Scheduled]] = {}
        self.num_preemptions = 0
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
        seqs = []
        for choice_idx in range(req.sampling.n):
            seq = Sequence(
                seq_id=self._next_seq_id, request_id=req.request_id, choice_idx=choice_idx,
                prompt_token_ids=prompt, sampling=req.sampling,
                eos_token_ids=frozenset(req.eos_token_ids), arrival_time=req.arrival_time,
            )
            self._next_seq_id += 1
            seqs.append(seq)
            self.waiting.append(seq)
        self.requests[req.request_id] = seqs
        return []

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks at once."""
        for seq in self.requests.pop(request_id, ()):
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            self._release(seq, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> Step | None:
        """Pick the next batch and reserve its slots; None when nothing can run."""
        token_budget = self.config.max_num_batched_tokens
        scheduled: list[_Scheduled] = []

        # 1. Running sequences, oldest first; preempt the newest when blocks run out.
        idx = 0
        while idx < len(self.running) and token_budget > 0:
            seq = self.running[idx]
            num_new = min(seq.num_pending_tokens, token_budget)
            while not self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(_Scheduled(seq, num_new))
                token_budget -= num_new
                idx += 1
                continue
            break  # seq itself was preempted: everything after it is gone too

        # 2. Waiting sequences, first come first served.
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_pending_tokens, token_budget)
            status = self.blocks.can_admit(seq.num_computed_tokens + num_new, seq.num_tokens)
            if status is not AllocStatus.OK:
                break
            self.waiting.popleft()
            self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(_Scheduled(seq, num_new))
            token_budget -= num_new

        if not scheduled:
            return None
        self._account_utilization(scheduled)
        return self._build_step(scheduled)

    def _account_utilization(self, scheduled: list[_Scheduled]) -> None:
        """Add this step's slots holding tokens and slots allocated (all running sequences)."""
        new = {s.seq.seq_id: s.num_new_tokens for s in scheduled}
        self.num_steps += 1
        self.sum_slots_used += sum(s.num_computed_tokens + new.get(s.seq_id, 0) for s in self.running)
        self.sum_slots_allocated += sum(
            len(self.blocks.block_tables.get(s.seq_id, ())) for s in self.running
        ) * self.blocks.block_size

    def _build_step(self, scheduled: list[_Scheduled]) -> Step:
        # Decodes (one new token, nothing else pending) first, then prefill chunks.
        decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.seq.num_pending_tokens == 1]
        prefills = [s for s in scheduled if not (s.num_new_tokens == 1 and s.seq.num_pending_tokens == 1)]
        ordered = decodes + prefills
        num_seqs = len(ordered)
        max_blocks = max(len(self.blocks.block_tables[s.seq.seq_id]) for s in ordered)
        block_tables = np.zeros((num_seqs, max_blocks), np.int32)
        query_start_loc = np.zeros(num_seqs + 1, np.int32)
        context_lens = np.zeros(num_seqs, np.int32)
        sample_mask = np.zeros(num_seqs, bool)
        tokens, positions, slots = [], [], []
        new_seqs = []
        for i, s in enumerate(ordered):
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = self.blocks.block_tables[seq.seq_id]
            block_tables[i, : len(table)] = table
            query_start_loc[i + 1] = query_start_loc[i] + s.num_new_tokens
            context_lens[i] = end
            sample_mask[i] = end == seq.num_tokens
            for pos in range(start, end):
                tokens.append(seq.token_id(pos))
                positions.append(pos)
                slots.append(self.blocks.slot(seq.seq_id, pos))
            if not seq.announced:
                seq.announced = True
                new_seqs.append(NewSequence(seq.seq_id, seq.request_id, seq.sampling))
        step = Step(
            step_id=self._next_step_id,
            num_decodes=len(decodes),
            seq_ids=np.array([s.seq.seq_id for s in ordered], np.int64),
            input_token_ids=np.array(tokens, np.int64),
            positions=np.array(positions, np.int64),
            slot_mapping=np.array(slots, np.int64),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            sample_mask=sample_mask,
            new_seqs=new_seqs,
            finished_seq_ids=self._freed_seq_ids,
        )
        self._freed_seq_ids = []
        self._in_flight[step.step_id] = ordered
        self._next_step_id += 1
        return step

    def update(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's sampled tokens; finish sequences that stop; return frontend deltas."""
        scheduled = self._in_flight.pop(result.step_id)
        if result.error is not None:
            return self._fail_step(scheduled, result.error)
        sampled = dict(zip(result.seq_ids.tolist(), result.token_ids.tolist()))
        outputs = []
        for s in scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step was in flight
            seq.num_computed_tokens += s.num_new_tokens
            token_id = sampled.get(seq.seq_id)
            if token_id is None:
                continue  # a prefill chunk that is not the last one
            seq.append_token(token_id)
            reason = seq.stop_reason(self.config.max_model_len)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            outputs.append(self._delta(seq))
        return outputs

    # ------------------------------------------------------------------ helpers

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks now, prefill prompt + output again later."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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

    def stats(self) -> dict[str, int]:
        """Counts the metrics read: sequences, blocks, and slots holding tokens vs allocated."""
        slots_used = sum(s.num_computed_tokens for s in self.running)
        slots_alloc = sum(len(t) for t in self.blocks.block_tables.values()) * self.blocks.block_size
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_blocks_total": self.blocks.num_blocks,
            "num_blocks_used": self.blocks.num_used_blocks,
            "num_slots_used": slots_used,
            "num_slots_allocated": slots_alloc,
            "num_steps": self.num_steps,
            "sum_slots_used": self.sum_slots_used,
            "sum_slots_allocated": self.sum_slots_allocated,
            "num_preemptions": self.num_preemptions,
        }
