"""Batched edits of the logits before sampling: logit bias, banned tokens, repetition penalties,
and the truncations (min-p, top-k, top-p).

Each function takes ``logits`` ``[R, vocab]`` fp32 for R rows and per-row parameters, and returns
the edited logits (a new tensor or ``logits`` edited in place, as documented). Indices arrive as
Python lists or numpy arrays built on the CPU; they are moved to the logits' device here.
"""

from __future__ import annotations

import numpy as np
import torch

NEG_INF = float("-inf")


def _in_vocab(logits: torch.Tensor, rows: list[int], token_ids: list[int], *more: list) -> tuple[list, ...]:
    """Drop the entries whose token id is outside the logits (the tokenizer may count more)."""
    vocab = logits.shape[1]
    keep = [i for i, t in enumerate(token_ids) if 0 <= t < vocab]
    if len(keep) == len(token_ids):
        return (rows, token_ids, *more)
    return tuple([seq[i] for i in keep] for seq in (rows, token_ids, *more))


def add_logit_bias(logits: torch.Tensor, rows: list[int], token_ids: list[int], values: list[float]) -> None:
    """In place: ``logits[rows[i], token_ids[i]] += values[i]`` (a token listed twice adds twice)."""
    rows, token_ids, values = _in_vocab(logits, rows, token_ids, values)
    if not rows:
        return
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(token_ids, device=dev))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def ban_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """In place: ``logits[rows[i], token_ids[i]] = -inf``."""
    rows, token_ids = _in_vocab(logits, rows, token_ids)
    if not rows:
        return
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(token_ids, device=dev))
    logits.index_put_(index, torch.tensor(NEG_INF, dtype=logits.dtype, device=dev))


def _flat_pairs(token_lists: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every known (>= 0) token of every row."""
    rows = np.concatenate([np.full(len(t), i, np.int64) for i, t in enumerate(token_lists)] + [np.zeros(0, np.int64)])
    ids = np.concatenate([np.asarray(t, np.int64) for t in token_lists] + [np.zeros(0, np.int64)])
    known = ids >= 0
    return torch.from_numpy(rows[known]).to(device), torch.from_numpy(ids[known]).to(device)


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: list[np.ndarray],
    output_tokens: list[np.ndarray],
    repetition: list[float],
    presence: list[float],
    frequency: list[float],
) -> torch.Tensor:
    """Penalize repeated tokens, row ``i`` with its own prompt and output tokens; returns new logits.

    ``repetition`` (Hugging Face / vLLM): a token that occurs in the prompt or the output has its
    logit divided by the penalty when positive, multiplied by it when not. ``presence`` is
    subtracted once from every token that occurs in the output, ``frequency`` once per occurrence
    (OpenAI's definition; prompt tokens do not count). Token ids below 0 (unknown) are skipped.
    """
    num_rows, vocab = logits.shape
    dev = logits.device
    out_rows, out_ids = _flat_pairs(output_tokens, dev)
    counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=dev)
    counts.index_put_((out_rows, out_ids), torch.ones(len(out_ids), dtype=logits.dtype, device=dev), accumulate=True)
    in_output = counts > 0
    rep = torch.tensor(repetition, dtype=logits.dtype, device=dev).unsqueeze(1)  # [R, 1]
    if any(r != 1.0 for r in repetition):
        seen = in_output.clone()
        seen[_flat_pairs(prompt_tokens, dev)] = True
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    freq = torch.tensor(frequency, dtype=logits.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor(presence, dtype=logits.dtype, device=dev).unsqueeze(1)
    return logits - freq * counts - pres * in_output.to(logits.dtype)


def truncate(
    logits: torch.Tensor, min_p: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """Keep, per row, only the tokens that survive min-p, then top-k and top-p; the rest get -inf.

    ``logits`` are already divided by the temperature. min-p drops tokens whose probability is
    below ``min_p`` times the most likely token's. top-k keeps the ``top_k`` largest (0: all).
    top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the most
    likely token always stays). Returns new logits.
    """
    dev = logits.device
    vocab = logits.shape[1]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(-1)
        threshold = torch.tensor(min_p, dtype=logits.dtype, device=dev).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [R, vocab]
    if use_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev).unsqueeze(1)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(rank >= k, NEG_INF)
    if use_p:
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        before = probs.cumsum(-1) - probs
        # top_p = 1 keeps everything, even when rounding lifts the running sum above 1.
        limit = [p if p < 1.0 else float("inf") for p in top_p]
        drop = before >= torch.tensor(limit, device=dev).unsqueeze(1)
        drop[:, 0] = False  # even when top_p rounds to 0 in float32
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(1, order, sorted_logits)
