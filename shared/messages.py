"""Every message that crosses a socket, with its msgpack encoding.

Wire format: one msgpack array ``[tag, fields]`` where ``tag`` is the small integer registered for
the message class and ``fields`` a list in dataclass field order. Integer and float arrays travel as
``[dtype, shape, raw little-endian bytes]``. Nested message dataclasses (``SamplingParams``,
``NewSequence``) are encoded as field lists too. Nothing is ever pickled: decoding only builds the
dataclasses registered here, and anything else raises ``DecodeError``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import msgpack
import numpy as np


class DecodeError(ValueError):
    """A frame that is not a well-formed message of a known type."""


# ---------------------------------------------------------------- request-level (frontend <-> scheduler)


@dataclass
class SamplingParams:
    """How one request samples and stops. ``None`` means "off" (no top-k, no seed)."""

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
    # The request's EOS ids again (AddRequest has them for the scheduler), so that the executor
    # can ban them until min_tokens; empty is fine when min_tokens is 0.
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
    sampling: SamplingParams
    eos_token_ids: list[int]
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


@dataclass
class FrontendHello:
    """frontend -> scheduler: "send my outputs and the engine's stats here", and "I am alive".

    Sent when a frontend connects and then every second (a restarted scheduler learns of it that
    way, and a scheduler that hears nothing from a frontend for its heartbeat timeout aborts that
    frontend's requests). Every message a frontend sends names it as its sender too.
    """

    TAG: ClassVar[int] = 4
    pid: int  # for the scheduler's logs


# ---------------------------------------------------------------- step-level (scheduler <-> executors)

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


@dataclass
class StepResult:
    """executor rank 0 -> scheduler: one sampled token per sequence whose ``sample_mask`` was set."""

    TAG: ClassVar[int] = 11
    step_id: int
    seq_ids: np.ndarray  # [num_sampled] int64
    token_ids: np.ndarray  # [num_sampled] int64
    error: str | None = None
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


@dataclass
class ExecutorReady:
    """executor -> scheduler: this rank's KV pool, sent once loaded and in answer to every ``Hello``
    of a scheduler it has not answered yet (then with that scheduler's ``epoch``; 0 when unasked).

    ``incarnation`` is random per executor process: a new one for a rank tells the scheduler that
    the rank was restarted. The pool's shape (model, block size, blocks, max_model_len, swap
    blocks) must stay the same across restarts."""

    TAG: ClassVar[int] = 20
    rank: int
    world_size: int
    num_blocks: int
    block_size: int
    max_model_len: int
    num_cpu_blocks: int = 0  # swap space
    model: str = ""  # the model's name, for the shape check
    incarnation: int = 0
    pid: int = 0  # for logs, /health and the supervisor
    epoch: int = 0  # the scheduler epoch this answers (0: sent unasked, after loading)
    # Tensor parallelism: the group's all-reduce ("single", "shm", "cuda_ipc" or "torch") and the
    # bytes of this rank's device KV pool (only its KV heads).
    all_reduce: str = "single"
    kv_cache_bytes: int = 0


@dataclass
class Hello:
    """scheduler -> executors: "answer with ExecutorReady". Repeated (a SUB socket joins late)
    while some rank has not answered this ``epoch``, which is random per scheduler process: an
    executor that sees a new epoch drops every sequence it knew (a new scheduler knows none).

    ``retired_incarnations``: the processes of the executor group this scheduler lost last. Such a
    process, if it still runs, exits (``EXIT_RETIRED``) so that whoever supervises it (``serve`` on
    its host, a container's restart policy) starts a new one: a lost group rejoins only whole."""

    TAG: ClassVar[int] = 21
    epoch: int
    retired_incarnations: list[int] = field(default_factory=list)


@dataclass
class Heartbeat:
    """executor rank -> scheduler, every second from a thread of its own (so it keeps beating
    through a long step, and stops when the process dies or is stopped)."""

    TAG: ClassVar[int] = 25
    rank: int
    incarnation: int
    pid: int


@dataclass
class Shutdown:
    """Any process -> a peer: stop cleanly."""

    TAG: ClassVar[int] = 23
    reason: str = ""


@dataclass
class ProcessLost:
    """scheduler -> supervisor (``pagedserve serve``'s launcher): a process stopped answering. The
    supervisor kills it if it still runs (a hung process) and starts a new one."""

    TAG: ClassVar[int] = 24
    process: str  # "executor"
    rank: int
    pid: int
    cause: str


@dataclass
class ExecutorHealth:
    """One executor rank as the scheduler sees it (in ``EngineStats``)."""

    rank: int
    pid: int
    status: str  # "ok", "starting" (not answered yet) or "lost" (being replaced)
    seconds_since_heartbeat: float  # -1 before the first
    num_restarts: int  # times this rank was lost and replaced under this scheduler


@dataclass
class EngineStats:
    """scheduler -> frontend, after steps: what /metrics and /health read."""

    TAG: ClassVar[int] = 30
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_slots_used: int
    num_slots_allocated: int
    ready: bool
    # Sums over every step so far, for mean utilization (slots holding tokens / slots allocated).
    num_steps: int = 0
    sum_slots_used: int = 0
    sum_slots_allocated: int = 0
    num_preemptions: int = 0
    num_swapped: int = 0
    max_num_running: int = 0
    # Prefix cache: prompt tokens looked up, and how many of them were found (0 until it exists).
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_cached_blocks: int = 0  # unused blocks kept for their content (evictable)
    num_swap_outs: int = 0  # preemptions by swap
    num_recomputes: int = 0  # preemptions by recompute
    # Liveness: the scheduler's epoch (random per scheduler process; a new one means it restarted)
    # and pid, each executor rank, and how many frontends went away without a word.
    epoch: int = 0
    pid: int = 0
    executors: list[ExecutorHealth] = field(default_factory=list)
    num_frontends_lost: int = 0
    # The executor group (from the ranks' ExecutorReady): tensor-parallel size, all-reduce kind,
    # and per rank (indexed by rank) its device KV blocks and their bytes.
    world_size: int = 1
    all_reduce: str = "single"
    num_kv_blocks_per_rank: list[int] = field(default_factory=list)
    kv_cache_bytes_per_rank: list[int] = field(default_factory=list)
    num_kv_snapshots: int = 0  # KvSnapshot built for watching frontends (0 while nobody watches)



# ---------------------------------------------------------------- block-pool snapshots (the playground's map)


@dataclass
class KvWatch:
    """frontend -> scheduler: send ``KvSnapshot`` to this frontend (``on``) or stop.

    A frontend repeats ``on`` about once a second while any of its clients watches; the scheduler
    lets a watch lapse when it has not been renewed for a few seconds, so a frontend that dies or
    whose ``off`` is lost costs nothing for long."""

    TAG: ClassVar[int] = 40
    on: bool


class KvEventKind(IntEnum):
    """What happened to a block, in ``KvSnapshot.events`` rows ``(kind, src, dst)``."""

    COPY = 0  # copy-on-write: device block src copied into device block dst
    EVICT = 1  # cached device block src lost its prefix-cache entry to new content (dst -1)
    SWAP_OUT = 2  # device block src copied to CPU block dst
    SWAP_IN = 3  # CPU block src copied to device block dst


@dataclass
class KvSnapshot:
    """scheduler -> the frontends that watch: the block pool at one moment (``/v1/kv/events``).

    Sparse, so that its size follows the blocks in use, not the pool's: a block not listed in
    ``used_block_ids`` has count 0. A block's owners are the sequences whose tables hold it:
    sequence ``i``'s table is ``table_block_ids[table_starts[i]:table_starts[i + 1]]``, in the CPU
    pool when ``on_cpu[i]`` (swapped out), else on the device. ``events`` are the block moves since
    the previous snapshot (oldest first; ``num_events_dropped`` more did not fit the scheduler's log).
    """

    TAG: ClassVar[int] = 41
    snapshot_id: int
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    used_block_ids: np.ndarray  # [U] int32: device blocks held by some table, ascending
    used_ref_counts: np.ndarray  # [U] int32: their reference counts
    cached_block_ids: np.ndarray  # [C] int32: device blocks with a prefix-cache entry (count 0: cached, free)
    cpu_used_block_ids: np.ndarray  # [V] int32: CPU blocks held by some table, ascending
    cpu_used_ref_counts: np.ndarray  # [V] int32
    seq_ids: np.ndarray  # [S] int64
    request_ids: list[str]  # [S]
    choice_idxs: np.ndarray  # [S] int32
    on_cpu: np.ndarray  # [S] bool
    num_computed_tokens: np.ndarray  # [S] int32: tokens in the sequence's blocks
    table_starts: np.ndarray  # [S + 1] int32
    table_block_ids: np.ndarray  # [sum of table lengths] int32
    events: np.ndarray  # [E, 3] int32: (KvEventKind, src, dst)
    num_events_dropped: int
    stats: EngineStats

MESSAGE_TYPES: dict[int, type] = {
    cls.TAG: cls
    for cls in (
        AddRequest, AbortRequest, RequestOutput, FrontendHello, Step, StepResult, ExecutorReady, Hello,
        Heartbeat, Shutdown, ProcessLost, EngineStats, KvWatch, KvSnapshot,
    )
}
_NESTED = {"SamplingParams": SamplingParams, "NewSequence": NewSequence, "ExecutorHealth": ExecutorHealth}


# ---------------------------------------------------------------- codec


def _encode_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return [arr.dtype.newbyteorder("<").str, list(arr.shape), arr.astype(arr.dtype.newbyteorder("<")).tobytes()]
    if dataclasses.is_dataclass(value):
        return [_encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    return value


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls, globalns=globals() | _NESTED)
        _HINTS[cls] = hints
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _decode_value(hint: Any, raw: Any) -> Any:
    if hint is np.ndarray:
        if not (isinstance(raw, list) and len(raw) == 3):
            raise DecodeError(f"expected [dtype, shape, bytes] for an array, got {type(raw).__name__}")
        dtype, shape, data = raw
        try:
            dt = np.dtype(dtype)
            if dt.kind not in "biuf":
                raise DecodeError(f"array dtype {dtype!r} is not allowed")
            return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"bad array: {exc}") from exc
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, raw)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(raw, list):
            raise DecodeError(f"expected a list, got {type(raw).__name__}")
        return [_decode_value(item, v) for v in raw]
    return raw


def _decode_dataclass(cls: type, raw: Any) -> Any:
    fields = dataclasses.fields(cls)
    if not isinstance(raw, list) or len(raw) != len(fields):
        raise DecodeError(f"{cls.__name__}: expected {len(fields)} fields")
    hints = _hints(cls)
    return cls(**{f.name: _decode_value(hints[f.name], v) for f, v in zip(fields, raw)})


def encode(msg: Any) -> bytes:
    """Serialize a registered message dataclass to bytes."""
    tag = getattr(type(msg), "TAG", None)
    if MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message type")
    return msgpack.packb([tag, _encode_value(msg)], use_bin_type=True)


def decode(frame: bytes) -> Any:
    """Parse bytes into a registered message; raises ``DecodeError`` on anything else."""
    try:
        tag, fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DecodeError(f"not a message frame: {exc}") from exc
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, int) else None
    if cls is None:
        raise DecodeError(f"unknown message tag {tag!r}")
    try:
        return _decode_dataclass(cls, fields)
    except TypeError as exc:
        raise DecodeError(f"{cls.__name__}: {exc}") from exc
