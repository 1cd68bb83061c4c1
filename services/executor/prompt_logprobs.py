"""Prompt scoring: the logprob of each prompt token given the tokens before it.

The hidden state at position ``p`` of a prefill chunk predicts the token at ``p + 1``; for the rows
the step names (``Step.num_scored_tokens``: a leading run of each scored sequence's chunk, the
positions before its last prompt token), this module takes the log-softmax of the model's raw
logits (before any logits processing, like the sampler's logprobs) and reports the next prompt
token's logprob and rank, and the most likely tokens. The next token of a chunk's last row is the
first of the next chunk, so targets come from the executor's token histories, which hold every
prompt from its ``NewSequence``.

Memory: only the scored rows get logits, ``MAX_ROWS_PER_PASS`` of them at a time (each pass holds
``[rows, vocab]`` fp32 logits and their log-softmax). Every tensor-parallel rank runs the same
passes, since ``compute_logits`` gathers the vocabulary shards; ranks other than 0 get ``None``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from shared.messages import Step

from .histories import TokenHistories

MAX_ROWS_PER_PASS = 256


def _scored_rows(step: Step, histories: TokenHistories) -> tuple[list[int], list[int]]:
    """(rows of the flat batch to score, the token id each row must predict), in step order."""
    rows: list[int] = []
    targets: list[int] = []
    starts = step.query_start_loc.tolist()
    for i, num_scored in enumerate(step.num_scored_tokens.tolist()):
        if not num_scored:
            continue
        first = starts[i]
        position = int(step.positions[first])
        history = histories.token_ids(int(step.seq_ids[i]))
        if position + 1 + num_scored > len(history):
            raise ValueError(f"step {step.step_id} scores {num_scored} tokens of sequence {int(step.seq_ids[i])} "
                             f"from position {position}, but only {len(history)} of its tokens are known")
        rows.extend(range(first, first + num_scored))
        targets.extend(history[position + 1:position + 1 + num_scored])
    return rows, targets


def score_prompts(
    step: Step,
    hidden: torch.Tensor,  # [T, hidden] the step's final hidden states
    histories: TokenHistories,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],  # [N, hidden] -> [N, vocab] or None
) -> dict[str, np.ndarray]:
    """The ``StepResult`` fields of the step's prompt scores (``prompt_logprobs`` and so on); empty
    when the step scores nothing or this rank is not rank 0."""
    if not len(step.num_scored_tokens) or not step.num_scored_tokens.any():
        return {}
    rows, targets = _scored_rows(step, histories)
    row_ids = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    parts = []
    for begin in range(0, len(rows), MAX_ROWS_PER_PASS):
        end = begin + MAX_ROWS_PER_PASS
        logits = compute_logits(hidden[row_ids[begin:end]])  # [rows, vocab] on rank 0
        if logits is not None:
            parts.append(_score(logits, target_ids[begin:end], step.num_prompt_top_logprobs))
    if not parts:
        return {}
    names = ("prompt_logprobs", "prompt_ranks", "prompt_top_token_ids", "prompt_top_logprobs")
    return {name: np.concatenate([p[i] for p in parts]) for i, name in enumerate(names)}


def _score(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> tuple[np.ndarray, ...]:
    """logits: [R, vocab], targets: [R] -> logprob [R], rank [R], top ids [R, K], top logprobs [R, K]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # ties count as ahead, as vLLM ranks them
    top = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)
    return (chosen.squeeze(1).cpu().numpy().astype(np.float32), ranks.cpu().numpy().astype(np.int64),
            top.indices.cpu().numpy().astype(np.int64), top.values.cpu().numpy().astype(np.float32))
