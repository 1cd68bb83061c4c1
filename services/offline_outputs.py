"""What ``LLM.generate`` returns, in vLLM's shapes: a ``PromptOutput`` per prompt, its
``ChoiceOutput``s, and per prompt token the ``Logprob``s of the token and the most likely ones,
folded from the engine's ``RequestOutput`` deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.messages import RequestOutput


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability in the model's raw distribution and its rank there (1: the most
    likely), as vLLM's ``Logprob``."""

    logprob: float
    rank: int


@dataclass
class ChoiceOutput:
    """One choice of a prompt: its generated tokens, their text (with a tokenizer), why it ended."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)  # per token, when SamplingParams.logprobs is set


@dataclass
class PromptOutput:
    """What ``LLM.generate`` returns for one prompt, its choices in index order."""

    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[ChoiceOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    num_preemptions: int = 0
    # With SamplingParams.prompt_logprobs = k, vLLM's shape: per prompt token, None for the first,
    # then {token id: Logprob} for the prompt token and the k most likely tokens at its position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With SamplingParams.pooling: the pooled final hidden state, float32, not normalized.
    embedding: np.ndarray | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold one ``RequestOutput`` delta into the choices."""
        if delta.prompt_logprobs:
            self.prompt_logprobs = [None, *map(_ranked, self.prompt_token_ids[1:], delta.prompt_logprobs,
                                               delta.prompt_ranks, delta.prompt_top_token_ids,
                                               delta.prompt_top_logprobs)]
        if delta.embedding:
            self.embedding = np.frombuffer(delta.embedding, "<f4").copy()
        while len(self.choices) <= delta.choice_idx:
            self.choices.append(ChoiceOutput(len(self.choices)))
        choice = self.choices[delta.choice_idx]
        choice.token_ids += delta.new_token_ids
        choice.logprobs += delta.logprobs
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.num_preemptions = max(self.num_preemptions, delta.num_preemptions)


def _ranked(token_id: int, logprob: float, rank: int, top_token_ids: list[int],
            top_logprobs: list[float]) -> dict[int, Logprob]:
    """One scored prompt position: its token first, then the most likely tokens (rank 1, 2, ...)."""
    ranked = {token_id: Logprob(logprob, rank)}
    for top_rank, (top_id, top_logprob) in enumerate(zip(top_token_ids, top_logprobs), start=1):
        ranked.setdefault(top_id, Logprob(top_logprob, top_rank))
    return ranked
