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


# Tokens looked at first for top-p (the most likely ones, by ``torch.topk``): a row whose nucleus
# does not fit in them is sorted whole. A sort of SmolLM2's 49k logits costs ~3 ms a row on one
# core, the top 256 ~0.1 ms.
TOP_P_CANDIDATES = 256


def truncate(
    logits: torch.Tensor, min_p: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """Keep, per row, only the tokens that survive min-p, then top-k and top-p; the rest get -inf.

    ``logits`` are already divided by the temperature. min-p drops tokens whose probability is
    below ``min_p`` times the most likely token's. top-k keeps the ``top_k`` largest (0: all).
    top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the most
    likely token always stays), in the distribution left by top-k. Returns new logits, or
    ``logits`` itself when nothing applies.

    No full sort unless needed: the candidates are the ``max(top_k, TOP_P_CANDIDATES)`` most likely
    tokens of each row; only rows whose top-p nucleus is larger than that are sorted whole.
    """
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(-1)
        threshold = torch.tensor(min_p, dtype=logits.dtype, device=logits.device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]  # vocab: no top-k
    ps = [p if p < 1.0 else float("inf") for p in top_p]  # inf: no top-p (even when rounding lifts sums above 1)
    rows = [i for i, (k, p) in enumerate(zip(ks, ps)) if k < vocab or p != float("inf")]
    if not rows:
        return logits
    out = logits.clone()
    sub = logits[rows]
    num = min(vocab, max([TOP_P_CANDIDATES] + [ks[i] for i in rows if ks[i] < vocab]))
    values, order = torch.topk(sub, num, dim=-1)  # [R, num], most likely first
    row_ks, row_ps = [ks[i] for i in rows], [ps[i] for i in rows]
    values, complete = _truncate_sorted(values, torch.logsumexp(sub, -1), row_ks, row_ps)
    kept = torch.full_like(sub, NEG_INF).scatter_(1, order, values)
    redo = [j for j, ok in enumerate(complete.tolist()) if not ok]
    if redo:
        values, order = torch.sort(sub[redo], dim=-1, descending=True)
        values, _ = _truncate_sorted(values, None, [row_ks[j] for j in redo], [row_ps[j] for j in redo])
        kept[redo] = torch.full_like(values, NEG_INF).scatter_(1, order, values)
    out[rows] = kept
    return out


def _truncate_sorted(
    values: torch.Tensor, row_lse: torch.Tensor | None, ks: list[int], ps: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, on each row's ``C`` largest logits ``values`` ``[R, C]`` (descending):
    rank ``>= ks[r]`` and the tokens past the nucleus of mass ``ps[r]`` get -inf.

    ``row_lse`` ``[R]``: the log-sum-exp of each whole row (None when ``values`` are whole rows),
    the normaliser of a row without top-k. Returns the edited values and, per row, whether they
    hold every surviving token (top-k within C, or a nucleus that ends within C)."""
    dev = values.device
    num = values.shape[1]
    k = torch.tensor(ks, device=dev).unsqueeze(1)
    values = values.masked_fill(torch.arange(num, device=dev).unsqueeze(0) >= k, NEG_INF)
    within = k.squeeze(1) <= num
    if all(p == float("inf") for p in ps):
        return values, within
    lse = torch.logsumexp(values, -1)  # the distribution top-k leaves, or the whole row's
    if row_lse is not None:
        lse = torch.where(within, lse, row_lse)
    probs = (values - lse.unsqueeze(1)).exp()
    limit = torch.tensor(ps, dtype=probs.dtype, device=dev)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    before = probs.cumsum(-1) - probs
    drop = before >= limit.unsqueeze(1)
    drop[:, 0] = False  # even when top_p rounds to 0 in float32
    complete = within | (probs.sum(-1) >= limit) | (row_lse is None)
    return values.masked_fill(drop, NEG_INF), complete
