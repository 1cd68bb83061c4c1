"""Step-level messages, scheduler <-> executors: one iteration's batch (``Step``, announcing new
sequences with ``NewSequence``), its sampled tokens (``StepResult``), and the placeholder id that
async scheduling feeds for a token not sampled yet."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from shared.messages.requests import SamplingParams


# An input token whose id is the one its sequence samples in the step before (``Step``).
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class NewSequence:
    """First appearance of a sequence in a step: what the executor keeps until it is freed.

    ``token_ids`` are every token of the sequence known when it is announced: its prompt, plus the
    outputs so far for a sequence forked from another (a beam); the first ``num_prompt_tokens`` are
    the prompt. The executor extends this history with each later step's input tokens at positions
    past its end, so a prompt crosses the socket once per sequence.
    """

    seq_id: int
    request_id: str
    sampling: SamplingParams
    token_ids: np.ndarray  # [num_known_tokens] int32
    num_prompt_tokens: int


@dataclass
class Step:
    """scheduler -> every executor rank: one iteration's batch.

    Sequences are ordered decodes first (one new token each), then prefill chunks. For scheduled
    sequence ``i``: its new tokens are ``input_token_ids[query_start_loc[i]:query_start_loc[i+1]]``
    at ``positions`` of the same range, written to ``slot_mapping`` of the same range;
    ``context_lens[i]`` counts its tokens in the cache after this step (cached prefix plus new);
    ``block_tables[i, :ceil(context_lens[i] / block_size)]`` are its blocks (the rest is padding).
    ``sample_mask[i]`` is true when the sequence's last new token needs a sample (a decode, or the
    final chunk of a prefill).

    With async scheduling a step is planned while the step before it still runs, so an input token
    may be ``PLACEHOLDER_TOKEN_ID``: the token that sequence samples in the step before, at this
    position, whose id the scheduler does not know yet. Every rank puts in the id rank 0 sampled.
    """

    TAG: ClassVar[int] = 10
    step_id: int
    num_decodes: int
    seq_ids: np.ndarray  # [S] int64
    input_token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int32
    context_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, max_blocks] int32
    sample_mask: np.ndarray  # [S] bool
    new_seqs: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # [num_pairs, 2] int64 (src, dst) device block copies, applied before the forward pass.
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # [num_pairs, 2] int64 (device block, cpu block): copy out, applied first.
    swap_out: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # [num_pairs, 2] int64 (cpu block, device block): copy in, applied after swap_out.
    swap_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # The epoch of the scheduler that sent it; an executor runs only its own scheduler's steps (a
    # dead scheduler's last step may still wait in its socket when a new one says hello).
    epoch: int = 0
    # Prompt scoring: the first ``num_scored_tokens[i]`` new tokens of sequence ``i`` need the
    # logprob of the token that follows each (the next prompt token) and the
    # ``num_prompt_top_logprobs`` most likely tokens at their positions. [S] int32, or empty when
    # no sequence of the step is scored.
    num_scored_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_prompt_top_logprobs: int = 0
    # Pooling (embedding requests): the last ``num_pooled_tokens[i]`` new tokens of sequence ``i``
    # have their final hidden states summed. [S] int32, or empty when no sequence is pooled.
    num_pooled_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Speculative decoding: the last ``num_draft_tokens[i]`` new tokens of sequence ``i`` are
    # proposed, not known: the executor verifies them (every one of its new rows is sampled) and
    # reports in ``StepResult.num_accepted`` how many it keeps. [S] int32, or empty when none has any.
    num_draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # KV offload tiers (``services/scheduler/kv_tiers.py``): [K, 3] int64 (kind, a, b) moves between
    # the device pool, the host pool and files, applied in order before every other block move; a
    # file's key is ``tier_keys[a or b]`` (a block's 16-byte prefix hash).
    tier_ops: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    tier_keys: list[bytes] = field(default_factory=list)
    # Live migration between replicas (``services/scheduler/migration_desk.py``): [M, 3] int64 (kind,
    # device block, key index) applied before every other block move: 1 writes the block's bytes
    # (this rank's shard) to ``migrate_dir``'s file ``migrate_keys[i]``, 2 reads that file into the block.
    migrate_ops: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    migrate_keys: list[bytes] = field(default_factory=list)
    migrate_dir: str = ""


@dataclass
class StepResult:
    """executor rank 0 -> scheduler: one sampled token per sequence whose ``sample_mask`` was set."""

    TAG: ClassVar[int] = 11
    step_id: int
    seq_ids: np.ndarray  # [num_sampled] int64
    token_ids: np.ndarray  # [num_sampled] int64
    error: str | None = None
    # Sequences whose samples the executor could not make as asked (a guided request on an executor
    # without a tokenizer): the scheduler fails their requests with ``failure``; the rest go on.
    failed_seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    failure: str | None = None
    # Only when some sampled sequence asked for logprobs (else all empty). Log-probabilities of the
    # model's raw distribution (before logit_bias, penalties and temperature), as vLLM reports them.
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # [num_sampled]
    # [num_sampled, K]: the K most likely tokens, K the most any of these sequences asked for.
    top_token_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    # Prompt scoring, one row per scored token in step order (``Step.num_scored_tokens``; all
    # empty when none): the next prompt token's logprob and rank (1: the most likely), and the
    # ``Step.num_prompt_top_logprobs`` most likely tokens. Raw distribution, as ``logprobs``.
    prompt_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # [R]
    prompt_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [R]
    prompt_top_token_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # [R, K]
    prompt_top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [R, K]
    # Pooling: one row per sequence with ``Step.num_pooled_tokens`` set, in step order: the sum of
    # those rows' final hidden states (after the final norm), float32. [P, hidden], or empty.
    pooled: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    # Speculative decoding (empty unless the step had drafts): per sampled sequence, how many of its
    # drafts were accepted; its tokens are those drafts, then ``token_ids[row]``. [num_sampled] int32
    num_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # KV offload tiers: keys whose file every rank read and checked into its host pool (or not:
    # missing, corrupt, truncated, foreign), and keys whose file this rank wrote (or failed to).
    tier_loaded: list[bytes] = field(default_factory=list)
    tier_load_failed: list[bytes] = field(default_factory=list)
    tier_stored: list[bytes] = field(default_factory=list)
    tier_store_failed: list[bytes] = field(default_factory=list)
    # Live migration: keys of ``Step.migrate_ops`` whose write or read failed on some rank.
    migrate_failed: list[bytes] = field(default_factory=list)
