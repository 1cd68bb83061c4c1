"""Turn logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A request with a ``seed`` gets its own ``torch.Generator``, so its samples do not depend on what
else is in the batch; requests without one share the sampler's generator.
"""

from __future__ import annotations

import torch

from shared.messages import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._params: dict[int, SamplingParams] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._shared = torch.Generator().manual_seed(seed)

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self._params[seq_id] = params
        if params.seed is not None and not params.greedy:
            self._generators[seq_id] = torch.Generator().manual_seed(params.seed)

    def remove(self, seq_id: int) -> None:
        self._params.pop(seq_id, None)
        self._generators.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._params)

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> torch.Tensor:
        """logits: [N, vocab] fp32 for the sequences ``seq_ids``; returns [N] int64 token ids."""
        tokens = torch.argmax(logits, dim=-1)
        for row, seq_id in enumerate(seq_ids):
            params = self._params[seq_id]
            if params.greedy:
                continue
            gen = self._generators.get(seq_id, self._shared)
            tokens[row] = _sample_row(logits[row], params, gen)
        return tokens


def _sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from ``logits`` ([vocab] fp32) under temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k is not None and 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))
