"""Pooling for embedding requests: the sum of the final hidden states (after the final norm) of the
last ``Step.num_pooled_tokens[i]`` rows of each pooled sequence's chunk, one float32 row per such
sequence in step order (``StepResult.pooled``). The scheduler asks for the rows (the last position
for last-token pooling, every position of every chunk for mean pooling) and keeps the sums across
chunks; the executor keeps nothing. Every rank of a tensor-parallel group holds the whole hidden
state; only rank 0 replies."""

from __future__ import annotations

import numpy as np
import torch

from shared.messages import Step


def pool_rows(step: Step, hidden: torch.Tensor) -> dict[str, np.ndarray]:
    """The ``StepResult`` field of the step's pooled sums (``pooled``); empty when it pools nothing."""
    if not len(step.num_pooled_tokens) or not step.num_pooled_tokens.any():
        return {}
    ends = step.query_start_loc[1:].tolist()
    sums = [hidden[end - n:end].float().sum(dim=0)
            for end, n in zip(ends, step.num_pooled_tokens.tolist()) if n]
    return {"pooled": torch.stack(sums).cpu().numpy().astype(np.float32)}
