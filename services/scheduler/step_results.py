"""A step's result read back into the sequences it computed for (``Scheduler.update``): prompt scores
added, placeholders given back, newly computed blocks offered to the prefix cache, and each sampled
token (or each prompt done with nothing to sample) answered by its group."""

from __future__ import annotations

from collections.abc import Callable

from shared.messages import StepResult

from .block_manager import BlockManager
from .groups import GroupUpdate, SequenceGroup
from .outputs import Sample
from .prefix import cache_computed_blocks
from .sequence import SequenceStatus
from .step_builder import Scheduled


def failed_request_ids(scheduled: list[Scheduled], result: StepResult) -> list[str]:
    """The requests of the step's sequences that the executors could not run as asked."""
    failed = set(result.failed_seq_ids.tolist())
    return [s.seq.request_id for s in scheduled if s.seq.seq_id in failed]


def apply_samples(scheduled: list[Scheduled], result: StepResult, blocks: BlockManager,
                  groups: dict[str, SequenceGroup],
                  carry_out: Callable[[SequenceGroup, GroupUpdate], None], speculator=None) -> None:
    """Read ``result`` into each scheduled sequence, in order; each group's decision is carried out
    (``carry_out``) before the next sequence is read, since it may finish the sequences after it."""
    rows = {seq_id: row for row, seq_id in enumerate(result.seq_ids.tolist())}
    for s in scheduled:
        seq = s.seq
        if s.scored_rows is not None:
            seq.prompt_scores.add(result, s.scored_rows)
        if s.pooled_row is not None:
            seq.pooling.add(result, *s.pooled_row)
        if seq.status is SequenceStatus.FINISHED:
            continue  # it ended while the step was in flight (aborted, or stopped the step before)
        seq.num_placeholders -= s.samples
        if seq.status is SequenceStatus.RUNNING and seq.num_preemptions == s.num_preemptions:
            cache_computed_blocks(blocks, seq, s.context_len)
        row = rows.get(seq.seq_id)
        group = groups[seq.request_id]
        if row is not None and s.draft_token_ids:
            _apply_verdict(s, result, row, blocks, group, carry_out, speculator)
        elif row is not None:
            carry_out(group, group.on_sample(seq, Sample.from_result(result, row)))
        elif not s.samples and s.context_len == seq.num_planned_tokens:  # prompt in, max_tokens 0
            carry_out(group, group.on_prompt_done(seq))


def _apply_verdict(s: Scheduled, result: StepResult, row: int, blocks: BlockManager, group: SequenceGroup,
                   carry_out: Callable[[SequenceGroup, GroupUpdate], None], speculator) -> None:
    """A speculating sequence's result: its rejected drafts leave the cache (their slots no longer
    count; blocks taken only for them are freed), then its accepted drafts and the sampled token
    are answered one by one, until one ends it (a stop token, ``max_tokens``)."""
    seq, drafts = s.seq, s.draft_token_ids
    accepted = int(result.num_accepted[row])
    if seq.status is SequenceStatus.RUNNING and seq.num_preemptions == s.num_preemptions:
        seq.num_computed_tokens -= len(drafts) - accepted
        blocks.free_tail(seq.seq_id, seq.num_computed_tokens)
    if speculator is not None:
        speculator.record(seq.seq_id, len(drafts), accepted)
    for token_id in drafts[:accepted] + [int(result.token_ids[row])]:
        carry_out(group, group.on_sample(seq, Sample(token_id)))
        if seq.status is SequenceStatus.FINISHED:
            break
