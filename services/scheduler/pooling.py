"""One embedding request's pooled hidden state (``SamplingParams.pooling``), gathered over its prefill.

An embedding request is prefill-only (``max_tokens`` 0): its sequence computes its prompt through
the same steps, blocks and prefix cache as generation and is never sampled. Each step that computes
positions to pool asks the executor for the sum of their final hidden states
(``Step.num_pooled_tokens``: the last ``n`` rows of the sequence's chunk); ``add`` keeps the sum.

- ``last``: only the prompt's last position is pooled, in the chunk that computes it; a prefix-cache
  hit skips nothing it needs (the last prompt token is always computed).
- ``mean``: every position is pooled, in order, so the sequence takes no prefix-cache hit until
  its prompt is pooled (a cached block is never computed), like a prompt being scored. A chunk
  from position 0 (the prompt computed again after a recompute preemption) starts the sum over.

``num_rows`` counts the positions asked for, ``add`` those whose sums came back. Once every
position is in, the group puts the pooled vector (the mean, or the last hidden state;
not normalized: the frontend truncates and normalizes it) on the request's output (``attach``).
"""

from __future__ import annotations

import numpy as np

from shared.messages import RequestOutput, StepResult

POOLING_MODES = ("last", "mean")


class Pooling:
    def __init__(self, num_prompt_tokens: int, mode: str) -> None:
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
        self.mode = mode
        self.num_prompt_tokens = num_prompt_tokens
        self.num_pooled = 0  # positions whose hidden states are in ``total``
        self.num_requested = 0  # positions asked for by the steps sent (their results may be in flight)
        self.total: np.ndarray | None = None
        self.sent = False

    @property
    def complete(self) -> bool:
        return self.num_pooled == (1 if self.mode == "last" else self.num_prompt_tokens)

    @property
    def needs_every_position(self) -> bool:
        """Mean pooling not yet complete: every position must be computed (no prefix-cache hit), and
        its chunks' results applied in order before the next is planned (no planning ahead, as for
        a prompt being scored). Last-token pooling needs only its last chunk's result, whenever it
        comes: a step that computed it holds a valid hidden state even if the sequence was
        preempted while it ran."""
        return self.mode == "mean" and not self.complete

    def num_rows(self, start: int, end: int) -> int:
        """How many of the chunk ``[start, end)``'s last rows a step computing it must pool. Chunks
        are asked for in order; the chunk from position 0 (again after a recompute preemption)
        starts the sum over."""
        end = min(end, self.num_prompt_tokens)
        if start == 0 or self.mode == "last" and end == self.num_prompt_tokens:
            self.num_pooled, self.num_requested, self.total = 0, 0, None  # (again after a recompute preemption)
        if self.mode == "last":
            self.num_requested = int(end == self.num_prompt_tokens > start)
            return self.num_requested
        if self.num_requested == self.num_prompt_tokens or start >= end:
            return 0
        if start != self.num_requested:
            raise ValueError(f"a chunk from position {start} would be pooled, but the prompt is pooled up to "
                             f"{self.num_requested} of {self.num_prompt_tokens} positions")
        self.num_requested = end
        return end - start

    def add(self, result: StepResult, row: int, num_rows: int) -> None:
        """Add ``result``'s pooled row ``row`` (the sum of ``num_rows`` hidden states)."""
        pooled = result.pooled[row].astype(np.float64)
        self.total = pooled if self.total is None else self.total + pooled
        self.num_pooled += num_rows

    def vector(self) -> np.ndarray:
        """The pooled (not normalized) hidden state, float32."""
        return (self.total / self.num_pooled).astype(np.float32)

    def attach(self, out: RequestOutput) -> None:
        """Put the pooled vector on ``out``; once complete, and only once."""
        if self.sent or not self.complete:
            return
        self.sent = True
        out.embedding = self.vector().astype("<f4").tobytes()
