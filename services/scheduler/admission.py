"""Admission: the checks ``Scheduler.add_request`` makes before queueing a request (some can never
run), and the slots a sequence takes when it is admitted."""

from __future__ import annotations

from shared.messages import AddRequest

from .block_manager import AllocStatus, BlockManager
from .groups import num_sequences
from .plan import SchedulerConfig
from .sequence import Sequence


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
