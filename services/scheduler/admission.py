"""Admission: the checks ``Scheduler.add_request`` makes before queueing a request (some can never
run), and the prefix-cache hits and slots a waiting sequence takes when it is admitted."""

from __future__ import annotations

from shared.messages import AddRequest

from .block_manager import AllocStatus, BlockManager
from .groups import num_sequences
from .plan import SchedulerConfig
from .prefix import prefix_hits
from .sequence import Sequence
from .tier_admission import revive_host_hits


def refusal(request: AddRequest, config: SchedulerConfig, blocks: BlockManager) -> str | None:
    """Why ``request`` can never run here (the message for its error output), or None if it can."""
    num_prompt_tokens = len(request.prompt_token_ids)
    num_resumed = len(request.resumed_token_ids)
    if not num_prompt_tokens:
        return "the prompt is empty"
    if num_prompt_tokens + num_resumed >= config.max_model_len:
        return f"the prompt has {num_prompt_tokens + num_resumed} tokens; the limit is {config.max_model_len - 1}"
    if num_resumed and num_sequences(request.sampling) + request.sampling.use_beam_search > 1:
        return "a resumed request (resumed_token_ids) must have n = 1, without best_of or beam search"
    if blocks.can_admit(num_prompt_tokens + 1, num_prompt_tokens + 1) is AllocStatus.NEVER:
        return (f"the prompt needs {blocks.blocks_needed(num_prompt_tokens + 1)} KV blocks; the pool has "
                f"{blocks.num_blocks} ({blocks.watermark_blocks} kept as watermark)")
    num_seqs = num_sequences(request.sampling)
    needed = blocks.blocks_needed(num_prompt_tokens) + num_seqs  # the shared prompt + one block each
    usable = blocks.num_blocks - blocks.watermark_blocks
    if num_seqs > 1 and needed > usable:
        return (f"{num_seqs} sequences (n/best_of) need at least {needed} KV blocks together; the pool has "
                f"{usable} usable")
    return None


def admission_tokens(seq: Sequence, num_tokens: int, config: SchedulerConfig) -> int:
    """Slots a newly admitted sequence takes: what it computes now (``num_tokens``), or under the
    contiguous policy a whole reservation of prompt + ``max_tokens``."""
    if config.kv_policy == "contiguous":
        want = seq.num_prompt_tokens + seq.sampling.max_tokens
        return max(min(want, config.max_model_len), num_tokens)
    return num_tokens


def admit(seq: Sequence, token_budget: int, blocks: BlockManager, config: SchedulerConfig) -> tuple[AllocStatus, int]:
    """Try to admit waiting ``seq`` with its prefix-cache hits and up to ``token_budget`` tokens to
    compute. Returns the status and how many tokens it computes now; only with ``OK`` has anything
    changed (its slots are allocated and ``num_computed_tokens`` counts its hits)."""
    cached = revive_host_hits(blocks, seq, prefix_hits(blocks, seq))  # the host tier's blocks too
    num_computed = len(cached) * blocks.block_size
    num_new = min(seq.num_planned_tokens - num_computed, token_budget)
    reserve = admission_tokens(seq, num_computed + num_new, config)
    status = blocks.can_admit(reserve, seq.num_planned_tokens, cached)
    if status is AllocStatus.OK and not blocks.allocate_slots(seq.seq_id, reserve, num_computed, cached):
        status = AllocStatus.LATER
    if status is AllocStatus.OK:
        blocks.record_lookup(seq.num_tokens, num_computed)
        if not seq.announced:
            seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
        seq.num_computed_tokens = num_computed
        blocks.free_out_of_window(seq.seq_id, num_computed)  # prefix hits already out of the window
    return status, num_new
