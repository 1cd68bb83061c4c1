"""What an executor rank is started with (``pagedserve executor`` or the launcher's argv): the
model and its runner's options, the rank and its group, each default taken from the flag that
declares it (``shared.engine_flags``), and the two views of it that the loader and the group take.
Importing it imports no torch: the process sets its thread counts first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.endpoints import Endpoints
from shared.engine_flags import ParallelFlags, RankFlags, RunnerFlags

if TYPE_CHECKING:  # the loader imports torch, which must wait for the thread settings
    from .loader import RunnerOptions
    from .parallel.group import GroupConfig

# The flags' defaults (shared.engine_flags, where each is declared once).
_RUNNER, _RANK, _PARALLEL = RunnerFlags(), RankFlags(), ParallelFlags()


@dataclass(frozen=True)
class ExecutorConfig:
    endpoints: Endpoints
    model: str | None = None
    tokenizer: str | None = None  # the frontend's --tokenizer: guided requests are masked over its tokens
    dtype: str = _RUNNER.dtype
    device: str = _RUNNER.device  # auto, cpu, cuda or cuda:N (device.py)
    device_index: int | None = None  # which GPU cuda/auto takes (index % count; device.py); None: the rank
    block_size: int = _RUNNER.block_size
    num_kv_blocks: int | None = None
    kv_cache_memory: str = _RUNNER.kv_cache_memory
    swap_space: float = _RUNNER.swap_space  # GiB of CPU memory for swapped-out blocks
    kv_offload_memory: float = _RUNNER.kv_offload_memory  # the KV offload tiers (kv_offload.py)
    kv_offload_dir: str | None = _RUNNER.kv_offload_dir
    kv_offload_disk_size: float = _RUNNER.kv_offload_disk_size
    max_model_len: int | None = None
    attention_backend: str = _RUNNER.attention_backend
    linear_kernel: str = _RUNNER.linear_kernel
    quantization: str = _RUNNER.quantization
    kv_cache_dtype: str = _RUNNER.kv_cache_dtype
    rank: int = _RANK.rank
    world_size: int = _RANK.world_size
    num_threads: int | None = None
    adaptive_threads: bool = _RUNNER.adaptive_threads  # one or all threads per step by timing (thread_tuner.py)
    seed: int = _RUNNER.seed
    # The group (flags of the same names; parallel/group.py): how the ranks exchange tensors.
    all_reduce: str = _PARALLEL.all_reduce
    num_nodes: int = _PARALLEL.num_nodes
    dist_init_addr: str | None = None
    group_id: str | None = None  # shared memory: names the group's segments
    group_store: str | None = None  # shared memory: the file the ranks swap their handles through
    group_timeout_s: float = _PARALLEL.group_timeout_s
    zmq_curve: str | None = None  # --zmq-curve: the CURVE key directory; None: plain ZeroMQ

    def __post_init__(self) -> None:
        if self.device_index is not None and self.device_index < 0:
            raise ValueError(f"--device-index must be >= 0, got {self.device_index}")
        self.runner_options()  # validates the flags it shares with the offline engine
        self.group_config()

    def group_config(self) -> "GroupConfig":
        from .parallel.group import GroupConfig

        return GroupConfig(rank=self.rank, world_size=self.world_size, all_reduce=self.all_reduce,
                           num_nodes=self.num_nodes, group_id=self.group_id, store_path=self.group_store,
                           dist_init_addr=self.dist_init_addr, timeout_s=self.group_timeout_s)

    def runner_options(self) -> "RunnerOptions":
        from .loader import RunnerOptions

        return RunnerOptions(
            dtype=self.dtype, device=self.device, block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory, swap_space=self.swap_space, max_model_len=self.max_model_len,
            attention_backend=self.attention_backend, linear_kernel=self.linear_kernel, seed=self.seed,
            quantization=self.quantization, kv_offload_memory=self.kv_offload_memory,
            kv_offload_dir=self.kv_offload_dir, kv_offload_disk_size=self.kv_offload_disk_size,
            kv_cache_dtype=self.kv_cache_dtype,
        )
