"""Control messages: executors joining a scheduler (``Hello``, ``ExecutorReady``), liveness
(``Heartbeat``, ``ProcessLost``), ``Shutdown``, and the engine's stats for /metrics and /health
(``EngineStats`` with one ``ExecutorHealth`` per rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


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
    # The window in tokens within which *every* layer of the model attends (Mistral, Phi-3 with
    # sliding_window): the scheduler frees blocks older than that. 0: none (some layer sees all).
    sliding_window: int = 0
    # KV offload tiers (--kv-offload-memory, --kv-offload-dir): the host pool's blocks, how many
    # block files the directory may hold, and the keys (prefix hashes) of those found at start,
    # oldest first (``services/executor/kv_offload.py``).
    num_host_offload_blocks: int = 0
    num_disk_offload_blocks: int = 0
    offloaded_keys: list[bytes] = field(default_factory=list)
    # How the pool stores K/V (--kv-cache-dtype): the model's dtype's name, or int8 / fp8_e4m3.
    kv_cache_dtype: str = ""


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
    kv_cache_dtype: str = ""  # how the pools store K/V (--kv-cache-dtype; "" before the group is ready)
    kv_block_size: int = 0  # tokens per block, so that blocks * this is the tokens a pool holds
    num_kv_snapshots: int = 0  # KvSnapshot built for watching frontends (0 while nobody watches)
    # Speculative decoding, per draft position: tokens proposed and accepted (empty without it)
    spec_proposed: list[int] = field(default_factory=list)
    spec_accepted: list[int] = field(default_factory=list)
