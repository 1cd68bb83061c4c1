"""Build a ``ModelRunner``: our model from a config and weights (the whole model, or one rank's
shard), the KV pools sized from the flags, the attention backend. The executor process and the
offline engine (``services.offline``) both start here, so that one model loads the same way in both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import select_backend
from .model import ModelConfig
from .parallel.base import Communicator
from .parallel.sharding import ShardPlan
from .runner import ModelRunner, allocate_kv_cache, kv_block_bytes
from .weights import build_model, resolve_dtype

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

    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str = "1GiB"
    num_cpu_blocks: int | None = None
    swap_space: float = 1.0
    max_model_len: int | None = None
    attention_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two up to 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"--num-kv-blocks must be positive, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be greater than 1, got {self.max_model_len}")
        parse_bytes(self.kv_cache_memory)
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")


def build_runner(hf_config, state_dict: dict[str, torch.Tensor], options: RunnerOptions,
                 comm: Communicator | None = None) -> ModelRunner:
    """Our model for ``hf_config`` (a transformers config) with ``state_dict``'s weights, over fresh
    KV pools.

    With ``comm`` (a connected communicator of a group of more than one rank), the model is rank
    ``comm.rank``'s shard and both KV pools hold only its KV heads: a block takes fewer bytes, so
    ``kv_cache_memory`` and ``swap_space`` (per rank) hold more of them."""
    device = torch.device(options.device)
    dtype = options.dtype if isinstance(options.dtype, torch.dtype) else resolve_dtype(options.dtype, device)
    model_len = hf_config.max_position_embeddings
    max_model_len = min(options.max_model_len or model_len, model_len)
    cfg = ModelConfig.from_hf(hf_config)
    plan = ShardPlan.for_model(cfg, comm.rank, comm.world_size) if comm is not None else None
    model = build_model(hf_config, state_dict, dtype, device, max_model_len, plan, comm)
    kv_cfg = model.kv_cache_config  # only this rank's KV heads
    block_bytes = kv_block_bytes(kv_cfg, options.block_size, dtype)
    num_blocks = options.num_kv_blocks or parse_bytes(options.kv_cache_memory) // block_bytes
    if num_blocks <= 0:
        raise ValueError(f"--kv-cache-memory {options.kv_cache_memory} holds no block of {block_bytes} bytes")
    num_cpu_blocks = options.num_cpu_blocks
    if num_cpu_blocks is None:
        num_cpu_blocks = int(options.swap_space * 2**30) // block_bytes
    kv = allocate_kv_cache(kv_cfg, num_blocks, options.block_size, dtype, device)
    cpu_kv = allocate_kv_cache(kv_cfg, num_cpu_blocks, options.block_size, dtype, torch.device("cpu"))
    return ModelRunner(model, kv, select_backend(options.attention_backend, device), device, seed=options.seed,
                       cpu_kv_caches=cpu_kv)
