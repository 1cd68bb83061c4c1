"""One request's prompt logprobs (``SamplingParams.prompt_logprobs``), gathered over its prefill.

The sequence that prefills the prompt (the first of its group; the others fork from it) is the
one scored: each step that computes prompt positions not yet scored asks the executor for them
(``Step.num_scored_tokens``: a leading run of the chunk), and ``add`` keeps the rows that come back.
Positions are scored in order. A chunk never starts past the scores so far, because a sequence
whose prompt is not yet scored takes no prefix-cache hit (a cached block is never computed, so it
could not be scored); one that starts before their end (the prompt computed again after a
recompute preemption) scores those positions again. Once every position is scored, nothing more
is asked, and the group puts the scores on the request's first output (``attach``), once.
"""

from __future__ import annotations

from shared.messages import RequestOutput, StepResult


class PromptScores:
    """Scores of positions ``0 .. num_positions - 1``: position ``p`` holds the logprob of prompt
    token ``p + 1``, its rank, and the ``num_top`` most likely tokens there with theirs."""

    def __init__(self, num_prompt_tokens: int, num_top: int) -> None:
        self.num_positions = max(num_prompt_tokens - 1, 0)
        self.num_top = num_top
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_token_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.sent = False

    @property
    def num_scored(self) -> int:
        return len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.num_scored == self.num_positions

    def num_rows(self, start: int, end: int) -> int:
        """How many of the positions ``[start, end)``, from ``start``, a step computing them must
        score; the scores from ``start`` on are dropped, to come again.

        Raises ``ValueError`` if the chunk starts past the scores so far (it would leave a gap)."""
        if self.complete:
            return 0
        if start > self.num_scored:
            raise ValueError(f"a chunk from position {start} would be scored, but the prompt is scored up to "
                             f"{self.num_scored} of {self.num_positions} positions")
        for scores in (self.logprobs, self.ranks, self.top_token_ids, self.top_logprobs):
            del scores[start:]
        return max(0, min(end, self.num_positions) - start)

    def add(self, result: StepResult, rows: slice) -> None:
        """Keep ``rows`` of ``result``'s prompt scores (the next positions of the prompt)."""
        self.logprobs += result.prompt_logprobs[rows].tolist()
        self.ranks += result.prompt_ranks[rows].tolist()
        self.top_token_ids += result.prompt_top_token_ids[rows, : self.num_top].tolist()
        self.top_logprobs += result.prompt_top_logprobs[rows, : self.num_top].tolist()

    def attach(self, out: RequestOutput) -> None:
        """Put the whole score on ``out``; once complete, and only once."""
        if self.sent or not self.complete:
            return
        self.sent = True
        out.prompt_logprobs = self.logprobs
        out.prompt_ranks = self.ranks
        out.prompt_top_token_ids = self.top_token_ids
        out.prompt_top_logprobs = self.top_logprobs
