"""Turn the scheduler's decisions into the ``Step`` message every executor rank receives."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.messages import NewSequence, Step

from .block_manager import BlockManager
from .sequence import Sequence
from .sliding_window import NULL_BLOCK


@dataclass
class Scheduled:
    seq: Sequence
    num_new_tokens: int
    is_fork_parent: bool = False  # forked children follow it in the prefill part, sharing its last row
    scored_rows: slice | None = None  # its rows of the step's prompt scores, if any (set by build_step)
    pooled_row: tuple[int, int] | None = None  # (its row of the step's pooled sums, rows summed), if any
    # Set by build_step: its tokens in the cache once the step has run, whether it samples, and its
    # preemptions so far (one more by the time the result comes: its blocks are no longer these).
    context_len: int = 0
    samples: bool = False
    num_preemptions: int = 0
    # Speculative decoding: tokens proposed after its last one, fed (and counted in
    # ``num_new_tokens``) after it and verified in this step (``speculation``).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.seq.num_pending_tokens == 1 and not self.is_fork_parent


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, np.int64).reshape(-1, 2)


def build_step(
    step_id: int, scheduled: list[Scheduled], blocks: BlockManager, finished_seq_ids: list[int],
    swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
    block_copies: list[tuple[int, int]] = (),
) -> Step:
    """Flatten ``scheduled`` (reordered in place: decodes first, then prefill chunks) into a Step.

    A sequence not yet announced goes out as a ``NewSequence`` with its sampling parameters and
    every token it has (prompt, and outputs for a forked beam), and is marked announced. A sequence
    whose prompt is being scored gets its positions to score, and its rows of the result in
    ``Scheduled.scored_rows``. A sequence with ``max_tokens`` 0 is never sampled. A position past a
    sequence's known tokens goes out as ``PLACEHOLDER_TOKEN_ID`` (its token is sampled by the step
    in flight).
    """
    scheduled.sort(key=lambda s: not s.is_decode)  # stable: keeps arrival order in each part
    num_scored, num_top = _prompt_scoring(scheduled)
    num_seqs = len(scheduled)
    max_blocks = max((len(blocks.block_tables[s.seq.seq_id]) for s in scheduled), default=0)
    block_tables = np.zeros((num_seqs, max_blocks), np.int32)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    context_lens = np.zeros(num_seqs, np.int32)
    sample_mask = np.zeros(num_seqs, bool)
    tokens, positions, slots = [], [], []
    new_seqs = []
    for i, s in enumerate(scheduled):
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = blocks.block_tables[seq.seq_id]
        block_tables[i, : len(table)] = _kernel_table(table)
        query_start_loc[i + 1] = query_start_loc[i] + s.num_new_tokens
        context_lens[i], s.context_len = end, end - len(s.draft_token_ids)  # drafts count once accepted
        s.num_preemptions = seq.num_preemptions
        sample_mask[i] = s.samples = s.context_len == seq.num_planned_tokens and seq.sampling.max_tokens > 0
        positions += range(start, end)
        slots += [_slot(table, pos, blocks.block_size) for pos in range(start, end)]
        tokens += [seq.token_id(pos) for pos in range(start, s.context_len)] + s.draft_token_ids
        if not seq.announced:
            seq.announced = True
            new_seqs.append(NewSequence(seq.seq_id, seq.request_id, seq.sampling,
                                        np.array(seq.token_ids, np.int32), seq.num_prompt_tokens))
    return Step(
        step_id=step_id,
        num_decodes=sum(1 for s in scheduled if s.is_decode),
        seq_ids=np.array([s.seq.seq_id for s in scheduled], np.int64),
        input_token_ids=np.array(tokens, np.int64),
        positions=np.array(positions, np.int64),
        slot_mapping=np.array(slots, np.int64),
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=block_tables,
        sample_mask=sample_mask,
        new_seqs=new_seqs,
        finished_seq_ids=list(finished_seq_ids),
        swap_out=_pairs(swap_out),
        swap_in=_pairs(swap_in),
        block_copies=_pairs(list(block_copies)),
        num_scored_tokens=num_scored,
        num_prompt_top_logprobs=num_top, num_pooled_tokens=_pooling(scheduled),
        num_draft_tokens=_num_drafts(scheduled),
    )


def _num_drafts(scheduled: list[Scheduled]) -> np.ndarray:
    """``Step.num_draft_tokens``: each sequence's proposed tokens, or empty when none has any."""
    counts = np.array([len(s.draft_token_ids) for s in scheduled], np.int32)
    return counts if counts.any() else np.zeros(0, np.int32)


def _kernel_table(table: list[int]) -> list[int]:
    """A block table as the executors get it. A block freed out of the sliding window (NULL_BLOCK)
    goes out as block 0: a valid index the kernels never read (they start at max(0, p - W + 1));
    -1 would index the pool's last block in a gather, or fault, if anything dereferenced it."""
    return [0 if b == NULL_BLOCK else b for b in table]


def _slot(table: list[int], pos: int, block_size: int) -> int:
    """The slot a token at ``pos`` is written to: only ever in a live block."""
    block_id = table[pos // block_size]
    assert block_id != NULL_BLOCK, f"position {pos} is out of the window: its block was freed"
    return block_id * block_size + pos % block_size


def _prompt_scoring(scheduled: list[Scheduled]) -> tuple[np.ndarray, int]:
    """``Step.num_scored_tokens`` and ``num_prompt_top_logprobs`` for ``scheduled`` (in step order),
    and each scored sequence's ``scored_rows``."""
    num_scored = np.zeros(len(scheduled), np.int32)
    num_top = 0
    for i, s in enumerate(scheduled):
        scores, start = s.seq.prompt_scores, s.seq.num_computed_tokens
        if scores is not None and (n := scores.num_rows(start, start + s.num_new_tokens)):
            first = int(num_scored.sum())
            num_scored[i] = n
            s.scored_rows = slice(first, first + n)
            num_top = max(num_top, scores.num_top)
    return (num_scored if num_scored.any() else np.zeros(0, np.int32)), num_top


def _pooling(scheduled: list[Scheduled]) -> np.ndarray:
    """``Step.num_pooled_tokens`` for ``scheduled`` (in step order), and each pooled sequence's
    ``pooled_row``."""
    num_pooled = np.zeros(len(scheduled), np.int32)
    for i, s in enumerate(scheduled):
        pooling, start = s.seq.pooling, s.seq.num_computed_tokens
        if pooling is not None and (n := pooling.num_rows(start, start + s.num_new_tokens)):
            s.pooled_row = (int(np.count_nonzero(num_pooled)), n)
            num_pooled[i] = n
    return num_pooled if num_pooled.any() else np.zeros(0, np.int32)
