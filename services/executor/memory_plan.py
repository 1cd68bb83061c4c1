"""What the executor will allocate for a model (weights, KV pool, swap pool, rope tables), settled
and checked against the machine's memory before anything is allocated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shared.hf_config import GIB, ModelCheckError, check_memory, kv_block_bytes, model_shape, weight_bytes


@dataclass(frozen=True)
class MemoryPlan:
    max_model_len: int
    block_bytes: int
    num_blocks: int  # device KV blocks
    num_cpu_blocks: int  # swap blocks


def plan_memory(
    hf_config: Any,
    where: str,
    *,
    dtype_bytes: int,
    block_size: int,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int,
    kv_cache_memory: str,
    swap_space_gib: float,
    max_model_len: int | None,
    num_local_kv_heads: int | None = None,
    world_size: int = 1,
    device_free_bytes: int | None = None,
    device_name: str = "cpu",
    kv_element_bytes: int | None = None,
    kv_scale_bytes: int = 0,
) -> MemoryPlan:
    """Settle the pool sizes and ``max_model_len`` (the flag, capped at the model's), and refuse
    (``ModelCheckError``) a pool of no block or a total the machine cannot hold.

    For one rank of a tensor-parallel group of ``world_size``: its pools hold ``num_local_kv_heads``
    KV heads, and it holds about ``1 / world_size`` of the weights.

    The KV blocks hold ``kv_element_bytes`` per element (default ``dtype_bytes``: the model's dtype)
    and ``kv_scale_bytes`` per (token, KV head) row (``--kv-cache-dtype int8|fp8_e4m3``: 1 and 4).

    With ``device_free_bytes`` (a GPU's free memory): the weights, KV pool and rope tables are checked
    against it, and the weights (read on the host first) and swap space against the host's."""
    shape = model_shape(hf_config.to_dict(), where)
    max_len = min(max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
    if num_local_kv_heads is not None:
        shape = dataclasses.replace(shape, num_kv_heads=num_local_kv_heads)
    block_bytes = kv_block_bytes(shape, block_size, kv_element_bytes or dtype_bytes, kv_scale_bytes)
    num_blocks = num_kv_blocks or kv_cache_memory_bytes // block_bytes
    if num_blocks <= 0:
        raise ModelCheckError(f"--kv-cache-memory {kv_cache_memory} holds no block of {block_bytes} bytes")
    num_cpu_blocks = int(swap_space_gib * GIB) // block_bytes
    weights = -(-weight_bytes(shape, dtype_bytes) // world_size)
    on_device = {
        "weights": weights,
        "KV pool": num_blocks * block_bytes,
        # cos and sin, float32 (none for OPT, whose learned positions are weights)
        "rope tables": 0 if shape.position_rows else 2 * 4 * max_len * shape.head_dim,
    }
    swap = {"swap space": num_cpu_blocks * block_bytes}
    if device_free_bytes is None:
        check_memory({**on_device, **swap}, where)
    else:
        check_memory(on_device, where, device_free_bytes, holder=f"{device_name} has")
        check_memory({"weights": weights, **swap}, where)
    return MemoryPlan(max_len, block_bytes, num_blocks, num_cpu_blocks)
