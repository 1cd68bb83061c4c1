"""Beam search decisions, step by step, with Hugging Face ``generate(num_beams=k)``'s semantics.

Plain Python. The scheduler feeds ``BeamSearch.step`` the live beams of one group after each of
their steps, each with its top ``2k`` next tokens and their log-probabilities; it answers which
``(beam, token)`` continuations survive (the scheduler forks and frees sequences over shared
blocks to match) and which hypotheses are finished. The rules follow transformers' vectorized
beam search: the best ``2k`` candidates by accumulated log-probability; candidates ending in EOS or
at the length limit are finished when they rank in the top ``k``, scored ``sum_logprobs /
generated_len ** length_penalty``; the best ``k`` unfinished ones run on; ``early_stopping``
``True`` stops once ``k`` hypotheses are finished, ``False`` and ``"never"`` stop when the best
running beam can no longer beat the worst finished one (by transformers' heuristic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DEAD = -1.0e9  # transformers' score for a beam that cannot continue


@dataclass
class Beam:
    """A live beam as the scheduler sees it: its tokens so far and its accumulated log-prob."""

    key: int  # the scheduler's id for it (a seq_id)
    output_token_ids: list[int]
    cum_logprob: float
    top_token_ids: list[int] = field(default_factory=list)  # candidates for the next token
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Continuation:
    parent_key: int
    token_id: int
    cum_logprob: float


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float  # length-penalized
    ended_with_eos: bool


class BeamSearch:
    def __init__(self, width: int, max_tokens: int, eos_token_ids: frozenset[int], ignore_eos: bool = False,
                 length_penalty: float = 1.0, early_stopping: bool | str = False) -> None:
        if width < 1:
            raise ValueError(f"beam width must be at least 1, got {width}")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")
        self.width = width
        self.max_tokens = max_tokens
        self.eos = frozenset() if ignore_eos else eos_token_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.finished: list[Hypothesis] = []  # best first, at most ``width``
        self.improvable = True
        self.done = False

    @property
    def num_candidates(self) -> int:
        return 2 * self.width

    def step(self, beams: list[Beam]) -> list[Continuation]:
        """Decide the next live beams (best first) from ``beams`` and their candidates."""
        k = self.width
        gen_len = len(beams[0].output_token_ids) + 1
        candidates = sorted(
            ((b.cum_logprob + lp, i, t) for i, b in enumerate(beams)
             for t, lp in zip(b.top_token_ids[: 2 * k], b.top_logprobs[: 2 * k])),
            key=lambda c: -c[0],
        )[: 2 * k]
        stops = [t in self.eos or gen_len >= self.max_tokens for _, _, t in candidates]

        # Finished: stopping candidates among the top k, unless no improvement is possible.
        full = len(self.finished) == k
        if self.improvable and not (full and self.early_stopping is True):
            fresh = [
                Hypothesis(tuple(beams[i].output_token_ids) + (t,), score, score / gen_len**self.length_penalty,
                           t in self.eos)
                for rank, ((score, i, t), stop) in enumerate(zip(candidates, stops)) if stop and rank < k
            ]
            self.finished = sorted(self.finished + fresh, key=lambda h: -h.score)[:k]

        running = [Continuation(beams[i].key, t, score)
                   for (score, i, t), stop in zip(candidates, stops) if not stop][:k]

        best_running = running[0].cum_logprob if running else _DEAD
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            hypothetical_len = self.max_tokens
        else:
            hypothetical_len = gen_len
        if len(self.finished) == k:
            worst = min(h.score for h in self.finished)
            self.improvable = self.improvable and best_running / hypothetical_len**self.length_penalty > worst
        open_beam = not (len(self.finished) == k and self.early_stopping is True)
        self.done = not (self.improvable and open_beam and not all(stops)) or not running
        return [] if self.done else running

    def results(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return self.finished[:n]
