"""Build a ``ModelRunner``: our model from a config and weights (the whole model, or one rank's
shard), the KV pools sized from the flags, the attention backend. The executor process and the
offline engine (``services.offline``) both start here, so that one model loads the same way in both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.engine_flags import RunnerFlags

from .attention import select_backend
from .device import check_device_name, resolve_device
from .gguf_weights import choose_quantization
from .kv_cache import QuantizedKVBackend, allocate_quantized, check_kv_cache_dtype, kv_storage
from .linear import check_linear_kernel, choose_linear_kernel, pack_linears
from .architectures import model_config
from .memory_plan import MemoryPlan, plan_memory
from .parallel.base import Communicator
from .parallel.sharding import ShardPlan
from .kv_files import weights_fingerprint
from .offload_setup import build_offload, check_offload_options
from .runner import ModelRunner, allocate_kv_cache
from .weights import build_model, resolve_dtype

# The share of a GPU's free memory the weights, KV pool and rope tables may take at start: the rest
# is for activations, logits, the allocator's and cuBLAS's workspaces (vLLM's
# --gpu-memory-utilization plays this part, as a share of the whole GPU).
GPU_MEMORY_SHARE = 0.9
_RUNNER = RunnerFlags()  # the flags' defaults, declared there once (shared.engine_flags)

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"512m"``, ``"1.5g"`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"--kv-cache-memory: cannot read {text!r} (use e.g. 1GiB, 512MiB)")
    return int(float(num) * _UNITS[unit])


@dataclass(frozen=True)
class RunnerOptions:
    """How to run a model: the executor's flags of the same names (``--dtype`` and so on).

    The device pool holds ``num_kv_blocks`` blocks, or as many as ``kv_cache_memory`` holds; the
    CPU swap pool ``num_cpu_blocks``, or as many as ``swap_space`` GiB hold. ``max_model_len``
    None: the model's own length (never more)."""

    dtype: str | torch.dtype = _RUNNER.dtype
    device: str = "cpu"  # auto, cpu, cuda or cuda:N (device.py); the executor and LLM default to auto
    block_size: int = _RUNNER.block_size
    num_kv_blocks: int | None = None
    kv_cache_memory: str = _RUNNER.kv_cache_memory
    num_cpu_blocks: int | None = None
    swap_space: float = _RUNNER.swap_space
    kv_offload_memory: float = _RUNNER.kv_offload_memory  # GiB; or num_host_offload_blocks blocks
    num_host_offload_blocks: int | None = None
    kv_offload_dir: str | None = _RUNNER.kv_offload_dir
    kv_offload_disk_size: float = _RUNNER.kv_offload_disk_size
    max_model_len: int | None = None
    attention_backend: str = _RUNNER.attention_backend
    linear_kernel: str = _RUNNER.linear_kernel
    quantization: str = _RUNNER.quantization  # auto, gguf, int8 or none (gguf_weights.py)
    kv_cache_dtype: str = _RUNNER.kv_cache_dtype  # auto (the model's dtype), int8 or fp8_e4m3 (kv_quant.py)
    seed: int = _RUNNER.seed

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"--num-kv-blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be greater than 1, got {self.max_model_len}")
        parse_bytes(self.kv_cache_memory)
        check_linear_kernel(self.linear_kernel)
        if self.quantization not in ("auto", "gguf", "int8", "none"):
            raise ValueError(f"--quantization must be auto, gguf, int8 or none, got {self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        check_offload_options(self)


def plan_runner(hf_config, options: RunnerOptions, where: str = "the model",
                shard: ShardPlan | None = None) -> MemoryPlan:
    """Settle the pool sizes and ``max_model_len`` for ``options``, and refuse (``ModelCheckError``,
    one line) a pool of no block or a total this machine cannot hold: before anything is loaded.
    With ``shard`` (one rank of a tensor-parallel group), for that rank's KV heads and weights."""
    device = resolve_device(options.device)
    dtype = _dtype(options, device)
    storage = kv_storage(options.kv_cache_dtype, dtype)
    plan = plan_memory(
        hf_config, f"{where} in {dtype}", dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        block_size=options.block_size, num_kv_blocks=options.num_kv_blocks,
        kv_cache_memory_bytes=parse_bytes(options.kv_cache_memory), kv_cache_memory=options.kv_cache_memory,
        swap_space_gib=options.swap_space if options.num_cpu_blocks is None else 0.0,
        max_model_len=options.max_model_len,
        num_local_kv_heads=shard.num_local_kv_heads if shard is not None else None,
        world_size=shard.world_size if shard is not None else 1,
        device_free_bytes=int(torch.cuda.mem_get_info(device)[0] * GPU_MEMORY_SHARE) if device.type == "cuda" else None,
        device_name=f"{device} ({GPU_MEMORY_SHARE:.0%} of its free memory)",
        kv_element_bytes=storage.element_bytes, kv_scale_bytes=storage.scale_bytes,
    )
    if options.num_cpu_blocks is not None:
        plan = dataclasses.replace(plan, num_cpu_blocks=options.num_cpu_blocks)
    return plan


def shard_plan(hf_config, comm: Communicator | None) -> ShardPlan | None:
    """Rank ``comm.rank``'s share of the model, or None without a group of more than one rank."""
    if comm is None:
        return None
    return ShardPlan.for_model(model_config(hf_config), comm.rank, comm.world_size)


def build_runner(hf_config, state_dict: dict[str, torch.Tensor], options: RunnerOptions,
                 plan: MemoryPlan | None = None, comm: Communicator | None = None) -> ModelRunner:
    """Our model for ``hf_config`` (a transformers config) with ``state_dict``'s weights, over fresh
    KV pools sized by ``plan`` (``plan_runner``'s, computed here when not given).

    With ``comm`` (a connected communicator of a group of more than one rank), the model is rank
    ``comm.rank``'s shard and both KV pools hold only its KV heads: a block takes fewer bytes, so
    ``kv_cache_memory`` and ``swap_space`` (per rank) hold more of them."""
    shard = shard_plan(hf_config, comm)
    plan = plan or plan_runner(hf_config, options, shard=shard)
    device = resolve_device(options.device)
    dtype = _dtype(options, device)
    # --quantization int8's weights are quantized while the model is built (int8_weights.py)
    int8 = choose_quantization(options.quantization, False, hf_config.model_type, device.type).mode == "int8"
    # before the build uses them; int8 weights make other KV bytes, so they are a fingerprint of their own
    fingerprint = (weights_fingerprint(state_dict) + (":int8" if int8 else "")) if options.kv_offload_dir else ""
    model = build_model(hf_config, state_dict, dtype, device, plan.max_model_len, shard, comm, int8=int8)
    kind = choose_linear_kernel(options.linear_kernel, device, dtype)
    if kind != "torch":
        pack_linears(model, kind)  # oneDNN's blocked weights or the Numba kernel's pairs (linear.py)
    kv_cfg = model.kv_cache_config  # only this rank's KV heads
    backend = select_backend(options.attention_backend, device)
    fmt = options.kv_cache_dtype
    if fmt == "auto":
        kv = allocate_kv_cache(kv_cfg, plan.num_blocks, options.block_size, dtype, device)
        cpu_kv = allocate_kv_cache(kv_cfg, plan.num_cpu_blocks, options.block_size, dtype, torch.device("cpu"),
                                   zero=False)
    else:  # 8-bit blocks and their scales, the swap pool the same (kv_cache.py)
        kv = allocate_quantized(kv_cfg, plan.num_blocks, options.block_size, fmt, device)
        cpu_kv = allocate_quantized(kv_cfg, plan.num_cpu_blocks, options.block_size, fmt, torch.device("cpu"))
        backend = QuantizedKVBackend(backend)
    runner = ModelRunner(model, kv, backend, device, seed=options.seed, cpu_kv_caches=cpu_kv,
                         kv_cache_dtype=kv_storage(fmt, dtype).name)
    runner.offload = build_offload(options, kv_cfg, dtype, fingerprint, comm, device)
    return runner


def _dtype(options: RunnerOptions, device: torch.device) -> torch.dtype:
    if isinstance(options.dtype, torch.dtype):
        return options.dtype
    return resolve_dtype(options.dtype, device).dtype
