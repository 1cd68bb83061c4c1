"""The scheduler's configuration and the plan one ``schedule`` call builds."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine_flags import SchedulingFlags
from shared.speculative import SpeculativeConfig

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .step_builder import Scheduled


_FLAGS = SchedulingFlags()  # the flags' defaults, declared there once


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _FLAGS.max_num_seqs
    max_num_batched_tokens: int = _FLAGS.max_num_batched_tokens
    max_model_len: int = 2048  # the process settles it from the executors' reports (the flag's default: none)
    preemption_mode: str = _FLAGS.preemption_mode  # or "swap"
    kv_policy: str = _FLAGS.kv_policy  # or "contiguous" (the baseline that reserves up front)
    speculative: SpeculativeConfig | None = None  # --speculative-config (``speculation``)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.kv_policy not in ("paged", "contiguous"):
            raise ValueError(f"--kv-policy must be paged or contiguous, got {self.kv_policy!r}")


@dataclass
class Plan:
    """What one ``schedule`` call has decided so far."""

    token_budget: int
    only: str | None = None  # the one request allowed to run (a crash suspect), or None: any but...
    suspects: frozenset[str] = frozenset()  # ... the crash suspects
    scheduled: list[Scheduled] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to send: no sequence to run and no block to move."""
        return not (self.scheduled or self.swap_out or self.swap_in)

    def allows(self, seq: Sequence) -> bool:
        return seq.request_id == self.only if self.only is not None else seq.request_id not in self.suspects

    def add(self, seq: Sequence, num_new: int, drafts: list[int] = ()) -> None:
        self.scheduled.append(Scheduled(seq, num_new, draft_token_ids=list(drafts)))
        self.token_budget -= num_new

    def drop(self, group: list[Sequence]) -> None:
        """Unschedule sequences that are being preempted, giving their tokens back."""
        keep = [s for s in self.scheduled if s.seq not in group]
        self.token_budget += sum(s.num_new_tokens for s in self.scheduled if s.seq in group)
        self.scheduled = keep

    def fork_children(self, parent: Sequence, num_new: int, blocks: BlockManager) -> list[Sequence]:
        """When ``parent`` finishes its prompt in this step, its siblings start sharing its blocks;
        returns them, now running, for the caller to queue.

        Each child joins the step with no new token, right after the parent, so its first token
        is sampled from the parent's last hidden state.
        """
        if (not parent.pending_children or parent.num_computed_tokens + num_new < parent.num_planned_tokens
                or parent.sampling.max_tokens == 0):  # nothing to sample: they end with the parent
            return []
        self.scheduled[-1].is_fork_parent = True
        children, parent.pending_children = parent.pending_children, []
        for child in children:
            blocks.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens + num_new
            child.block_hashes = list(parent.block_hashes)
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            self.scheduled.append(Scheduled(child, 0))
        return children
