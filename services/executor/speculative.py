"""Verifying speculative decoding's proposals in the step that feeds them (``Step.num_draft_tokens``).

A speculating sequence's new rows are its last known token followed by ``k`` proposed tokens
(drafts); each row's logits give the model's distribution for the position after it, so row
``j`` judges draft ``j`` and row ``k`` gives the token after the last draft. Its result is the
number of drafts accepted, ``a``, and one sampled token: at row ``a``, in place of the first
rejected draft (or after them all).

The acceptance rule keeps the target distribution exactly (Leviathan et al. 2023; Chen et al.
2023) for a deterministic proposal (prompt lookup: q is one-hot at draft x): x is accepted with
probability p(x), p the request's distribution as ``Sampler.sample`` would draw from (logit bias,
temperature, min-p, top-k, top-p); on rejection the token is drawn from p without x, renormalized.
So the token at each position is distributed as p: P(x) = p(x), P(y) = (1 - p(x)) p(y) / (1 - p(x)).
Greedy rows accept while the argmax equals the draft, and take the argmax at the first mismatch: the
tokens decoding without speculation would give. Uniform draws come from the sequence's generator
(``Sampler.generator_for``), so a seeded request is reproducible.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cpu.argmax import argmax_

from . import logits_processors as lp
from .draw import draw
from .sampler import Sampler


def verification_rows(step) -> tuple[np.ndarray, np.ndarray]:
    """The hidden rows whose logits a step with drafts needs, in order, and how many per sampled
    sequence (1 + its drafts): every row of a speculating sequence, the last of any other."""
    mask = step.sample_mask
    ends = step.query_start_loc[1:][mask]
    counts = (step.num_draft_tokens[mask] + 1).astype(np.int64)
    rows = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)]) if len(ends) else ends
    return rows.astype(np.int64), counts


def accept_greedy(best: np.ndarray, drafts: np.ndarray) -> tuple[int, int]:
    """(drafts accepted, the token after them) for argmax tokens ``best`` [k + 1]."""
    mismatch = np.flatnonzero(best[:len(drafts)] != drafts)
    accepted = int(mismatch[0]) if len(mismatch) else len(drafts)
    return accepted, int(best[accepted])


def accept_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> tuple[int, int]:
    """(drafts accepted, the token after them) for target probabilities ``probs`` [k + 1, V]
    (rows need not sum to one) and a one-hot proposal at each draft."""
    totals = probs.sum(-1)
    for j, x in enumerate(drafts):
        u = float(torch.rand(1, generator=generator, device=probs.device)[0])
        if u * float(totals[j]) < float(probs[j, x]):
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        return j, _draw_one(residual, generator)
    return len(drafts), _draw_one(probs[len(drafts)], generator)


def _draw_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    u = torch.rand(1, generator=generator, device=probs.device)
    token = int(draw(probs.unsqueeze(0), u)[0])
    return token if token >= 0 else int(torch.argmax(probs))


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution ``Sampler`` draws from for rows of one request: temperature, then min-p,
    top-k and top-p, softmax."""
    rows = logits.shape[0]
    scaled = logits.float() / params.temperature
    kept = lp.truncate(scaled, min_p=[params.min_p] * rows, top_k=[params.top_k or 0] * rows,
                       top_p=[params.top_p] * rows)
    return kept.softmax(-1)


def verify(sampler: Sampler, logits: torch.Tensor, seq_ids: list[int], counts: np.ndarray,
           drafts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence (``counts[i]`` rows of ``logits`` each, ``drafts[i]`` its proposed tokens):
    (tokens [N] int64, drafts accepted [N] int32)."""
    row_ids = np.repeat(np.asarray(seq_ids, np.int64), counts).tolist()
    processed, params = sampler.processed(logits, row_ids)
    best = argmax_(processed).cpu().numpy()
    tokens = np.zeros(len(seq_ids), np.int64)
    accepted = np.zeros(len(seq_ids), np.int32)
    start = 0
    for i, (seq_id, count) in enumerate(zip(seq_ids, counts.tolist())):
        rows, p = slice(start, start + count), params[start]
        if p.greedy:
            accepted[i], tokens[i] = accept_greedy(best[rows], drafts[i])
        else:
            probs = target_probs(processed[rows], p)
            accepted[i], tokens[i] = accept_random(probs, drafts[i].tolist(),
                                                   sampler.generator_for(seq_id, logits.device))
        start += count
    return tokens, accepted


def _spread(values: np.ndarray, rows: np.ndarray, num_rows: int) -> np.ndarray:
    """``values`` of some rows placed at ``rows`` of an array of ``num_rows`` (zeros elsewhere)."""
    out = np.zeros((num_rows, *values.shape[1:]), values.dtype)
    out[rows] = values
    return out


def sample_with_drafts(sampler: Sampler, compute_logits, step, hidden: torch.Tensor) -> dict | None:
    """A step with drafts sampled: ``StepResult``'s fields (seq_ids, token_ids, num_accepted, and the
    plain rows' logprobs and failures), or None on a rank that gets no logits. Speculating sequences
    are verified (``verify``); the others are sampled by ``Sampler.sample`` as in any step."""
    rows, counts = verification_rows(step)
    logits = compute_logits(hidden[torch.from_numpy(rows).to(hidden.device)])
    if logits is None:
        return None
    seq_ids = step.seq_ids[step.sample_mask]
    n, last = len(seq_ids), np.cumsum(counts) - 1
    fields = {"seq_ids": seq_ids, "token_ids": np.zeros(n, np.int64), "num_accepted": np.zeros(n, np.int32)}
    plain, spec = np.flatnonzero(counts == 1), np.flatnonzero(counts > 1)
    if len(plain):
        out = sampler.sample(logits[torch.from_numpy(last[plain])], seq_ids[plain].tolist())
        fields["token_ids"][plain] = out.token_ids.cpu().numpy()
        if len(out.logprobs):
            fields.update(logprobs=_spread(out.logprobs, plain, n), top_token_ids=_spread(out.top_token_ids, plain, n),
                          top_logprobs=_spread(out.top_logprobs, plain, n))
        if out.failed:
            fields.update(failed_seq_ids=np.asarray(list(out.failed), np.int64), failure=next(iter(out.failed.values())))
    if len(spec):
        ends = step.query_start_loc[1:][step.sample_mask][spec]
        drafts = [step.input_token_ids[e - c + 1:e] for e, c in zip(ends, counts[spec])]
        spec_rows = np.concatenate([np.arange(e - c + 1, e + 1) for e, c in zip(last[spec], counts[spec])])
        tokens, accepted = verify(sampler, logits[torch.from_numpy(spec_rows)], seq_ids[spec].tolist(),
                                  counts[spec], drafts)
        fields["token_ids"][spec], fields["num_accepted"][spec] = tokens, accepted
    return fields
