"""Request-level messages, frontend <-> scheduler: a request in (``AddRequest`` with its
``SamplingParams``), an abort, its outputs back (``RequestOutput``), and the frontend's hello."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np


@dataclass
class SamplingParams:
    """How one request samples and stops. ``None`` means "off" (no top-k, no seed). Its ranges and
    cross-field rules are ``shared.messages.sampling_rules``' (``verify``), which the frontend and
    the offline ``LLM`` both run."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # Logits processing, applied in this order (vLLM's and OpenAI's meanings): logit_bias is added
    # to the raw logits; tokens in stop_token_ids (and eos_token_ids unless ignore_eos) are banned
    # until min_tokens outputs exist; repetition_penalty (Hugging Face's: divide a positive logit,
    # multiply a negative one) counts prompt and output tokens; presence_penalty and
    # frequency_penalty (subtracted once per distinct token / once per occurrence) count output
    # tokens only; then temperature, min_p (relative to the most likely token), top-k, top-p.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)  # same length as the ids
    # None: no logprobs. k >= 0: the sampled token's logprob and the k most likely tokens'.
    logprobs: int | None = None
    # The request's EOS ids: the scheduler ends a sequence on one (unless ignore_eos), the executor
    # bans them until min_tokens and lets a guide end on them. The frontend and LLM set them.
    eos_token_ids: list[int] = field(default_factory=list)
    # Sequence groups. best_of: sample this many, return the n with the highest cumulative
    # logprob. Beam search: width n, transformers' length_penalty and early_stopping (true, false
    # or "never").
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # vLLM's prompt_logprobs: None, or k >= 0 for the logprob of every prompt token after the
    # first (given the tokens before it) and the k most likely tokens' at its position, from the
    # model's raw distribution like ``logprobs``. A request that asks takes no prefix-cache hit
    # until its prompt is scored; max_tokens 0 then scores the prompt and generates nothing.
    prompt_logprobs: int | None = None
    # Structured output: a guide's spec as JSON text (``shared.structured.compile_guide`` reads it:
    # {"json_object": true}, {"json_schema": {...}}, {"choice": [...]}, {"regex": r} or {"grammar": g});
    # the executor masks every token that would leave it. None: free text.
    guided: str | None = None
    # An embedding request (prefill-only: max_tokens 0, n 1): "last" or "mean" pooling of the
    # prompt's final hidden states, which come back on its output (``RequestOutput.embedding``).
    pooling: str | None = None

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow float32 (vLLM draws the line at the same place).
        return self.temperature < 1e-5


@dataclass
class AddRequest:
    """frontend -> scheduler: a new request. The prompt crosses the socket once."""

    TAG: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int32
    sampling: SamplingParams  # its eos_token_ids are the request's
    arrival_time: float
    # A request resumed after a scheduler restart: the outputs it had already produced (and the
    # frontend streamed) before, [num_resumed] int32. The scheduler continues after them as if it
    # had generated them itself (max_tokens, min_tokens and penalties count them) and never sends
    # them again. Only with n = 1 and neither best_of nor beam search.
    resumed_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass
class AbortRequest:
    """frontend -> scheduler: stop a request (client gone, stop string found)."""

    TAG: ClassVar[int] = 2
    request_id: str


@dataclass
class RequestOutput:
    """scheduler -> frontend: a delta for one choice of one request.

    ``new_token_ids`` are the tokens generated since the previous delta. ``finish_reason`` is
    ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (then
    ``error`` says why and ``error_kind`` whose fault it is). ``request_finished`` is set on the
    request's last output, after every choice has sent its own last one (best_of's held samples,
    all of beam search's hypotheses, however few): nothing more comes for this request.
    """

    TAG: ClassVar[int] = 3
    request_id: str
    choice_idx: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    num_preemptions: int = 0  # times this choice was preempted (recompute or swap)
    # Only when the request asked for logprobs (else empty): for each of new_token_ids, its
    # logprob and the most likely tokens with theirs (SamplingParams.logprobs of them).
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    request_finished: bool = False
    # With finish_reason "error": whose fault it is. "request": it can never run as asked (the
    # frontend answers 400); "engine": the engine failed while running it (500).
    error_kind: str | None = None
    # Once per request, on its first output, when SamplingParams.prompt_logprobs is set (else
    # empty): for each prompt token after the first, its logprob given the tokens before it, its
    # rank in that distribution (1: the most likely), and the prompt_logprobs most likely tokens
    # at its position with theirs. Empty also when the prompt has one token.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_token_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    # On the last output of a request with SamplingParams.pooling (else empty): the pooled final
    # hidden state (the mean over the prompt, or its last position) as raw little-endian float32
    # bytes, not normalized.
    embedding: bytes = b""


@dataclass
class RequestOutputs:
    """scheduler -> frontend: one pass's outputs for the requests that frontend sent, in order,
    in one frame (``RequestOutput`` one frame each cost the scheduler about half of its time at 64
    streams, and the frontend a wake-up each)."""

    TAG: ClassVar[int] = 5
    outputs: list[RequestOutput]


@dataclass
class FrontendHello:
    """frontend -> scheduler: "send my outputs and the engine's stats here", and "I am alive".

    Sent when a frontend connects and then every second (a restarted scheduler learns of it that
    way, and a scheduler that hears nothing from a frontend for its heartbeat timeout aborts that
    frontend's requests). Every message a frontend sends names it as its sender too.
    """

    TAG: ClassVar[int] = 4
    pid: int  # for the scheduler's logs
