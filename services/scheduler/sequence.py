"""One generated sequence (a choice of a request, or a beam): its tokens, its progress through
the cache, and why it ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum

from shared.messages import PLACEHOLDER_TOKEN_ID, SamplingParams

from .pooling import Pooling
from .prompt_scores import PromptScores


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(StrEnum):
    """Why a sequence ended. The first four reach the frontend as ``RequestOutput.finish_reason``."""

    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens, the model's length, or the KV pool
    ABORT = "abort"  # the frontend asked
    ERROR = "error"  # the request failed (its output says why)
    PRUNED = "pruned"  # a beam that lost to its siblings; never sent


class ErrorKind(StrEnum):
    """Whose fault a failed request is (``RequestOutput.error_kind``)."""

    REQUEST = "request"  # it can never run as asked (too long for the pool, too many sequences)
    ENGINE = "engine"  # the engine failed while running it


@dataclass
class Sequence:
    """Token state of one sequence.

    ``num_computed_tokens`` tokens have their keys and values in the cache once the steps sent so
    far have run; the rest of the planned tokens (at least one once started) are fed in the next
    steps. The planned tokens are ``token_ids`` followed by ``num_placeholders`` placeholders: one
    for each step in flight that samples this sequence, whose token is not known until its result
    is applied (with async scheduling a step is planned while the one before it runs).
    """

    seq_id: int
    request_id: str
    choice_idx: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # how many output tokens the frontend has been sent
    num_output_sent: int = 0
    announced: bool = False  # executors have its sampling params and tokens (a NewSequence went out)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    block_hashes: list = field(default_factory=list)  # chained hashes of its full blocks so far
    pending_children: list = field(default_factory=list)  # siblings that fork once the prompt is in
    cum_logprob: float = 0.0  # sum of the sampled tokens' logprobs (best_of, beam search)
    beam_candidates: tuple | None = None  # (token ids, logprobs) awaiting the beam decision
    prompt_scores: PromptScores | None = None  # its group's, on the sequence that prefills the prompt
    num_placeholders: int = 0  # tokens sampled in steps in flight, after output_token_ids
    pooling: Pooling | None = None  # its group's, for an embedding request
    tier_rounds: int = 0  # times it waited for blocks to load from disk (``tiered``)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens once every step in flight has run: the known ones and the placeholders."""
        return self.num_tokens + self.num_placeholders

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the cache: 1 for a decode, more for a (re)prefill."""
        return self.num_planned_tokens - self.num_computed_tokens

    def token_id(self, position: int) -> int:
        """The token at ``position``, or ``PLACEHOLDER_TOKEN_ID`` past the known ones."""
        n = len(self.prompt_token_ids)
        if position < n:
            return self.prompt_token_ids[position]
        output_idx = position - n
        return self.output_token_ids[output_idx] if output_idx < len(self.output_token_ids) else PLACEHOLDER_TOKEN_ID

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def stop_reason(self, max_model_len: int) -> FinishReason | None:
        """STOP or LENGTH if the last appended token ends the sequence, else None."""
        num_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        params = self.sampling
        if num_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                return FinishReason.STOP
        if num_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def ends_by_length_ahead(self, max_model_len: int) -> bool:
        """The placeholders take it to ``max_tokens`` or ``max_model_len``: it ends once they are
        known (by length, if nothing stops it sooner), so no later step needs it."""
        num_planned_out = len(self.output_token_ids) + self.num_placeholders
        return self.num_placeholders > 0 and (num_planned_out >= self.sampling.max_tokens
                                              or self.num_planned_tokens >= max_model_len)
