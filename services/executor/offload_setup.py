"""Building the KV offload tiers of a runner from its options (``--kv-offload-memory``,
``--kv-offload-dir``, ``--kv-offload-disk-size``): the host pool, the block files and their digest."""

from __future__ import annotations

import torch

from .kv_files import BlockFiles
from .kv_offload import KvOffload
from .runner import allocate_kv_cache, kv_block_bytes

GIB = 2**30
FORMAT_VERSION = 1


def check_offload_options(options) -> None:
    if options.kv_offload_memory < 0 or options.kv_offload_disk_size < 0:
        raise ValueError("--kv-offload-memory and --kv-offload-disk-size must be >= 0 GiB, got "
                         f"{options.kv_offload_memory} and {options.kv_offload_disk_size}")
    if options.num_host_offload_blocks is not None and options.num_host_offload_blocks < 0:
        raise ValueError(f"num_host_offload_blocks must be >= 0, got {options.num_host_offload_blocks}")
    if options.kv_offload_dir and not (options.kv_offload_memory or options.num_host_offload_blocks):
        raise ValueError("--kv-offload-dir needs --kv-offload-memory (the host tier the files are written from)")
    quantized_kv = getattr(options, "kv_cache_dtype", "auto") != "auto"
    if quantized_kv and (options.kv_offload_memory or options.num_host_offload_blocks or options.kv_offload_dir):
        raise ValueError(f"--kv-offload-memory / --kv-offload-dir do not take --kv-cache-dtype {options.kv_cache_dtype} "
                         "yet (the tiers copy the model dtype's blocks, not 8-bit blocks and their scales)")


def build_offload(options, kv_cfg, dtype: torch.dtype, fingerprint: str, comm, device) -> KvOffload | None:
    """The tiers, or None when ``options`` ask for none. Raises ValueError (one line) for a
    directory that cannot be written. ``fingerprint``: the weights' (``kv_files.weights_fingerprint``)."""
    num_host = options.num_host_offload_blocks
    if num_host is None:
        num_host = int(options.kv_offload_memory * GIB) // kv_block_bytes(kv_cfg, options.block_size, dtype)
    if num_host <= 0:
        return None
    host = allocate_kv_cache(kv_cfg, num_host, options.block_size, dtype, torch.device("cpu"))
    rank, world_size = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    files = None
    if options.kv_offload_dir:
        files = BlockFiles(options.kv_offload_dir, {
            "format": FORMAT_VERSION, "weights": fingerprint, "dtype": str(dtype),
            "kv_dtype": str(host[0][0].dtype), "block_size": options.block_size,
            "num_layers": kv_cfg.num_layers, "num_kv_heads": kv_cfg.num_kv_heads, "head_dim": kv_cfg.head_dim,
            "tp_rank": rank, "tp_size": world_size,
        })
    return KvOffload(host, files, int(options.kv_offload_disk_size * GIB), world_size, comm, device)
