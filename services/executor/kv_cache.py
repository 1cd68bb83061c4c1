"""The KV pool's storage (``--kv-cache-dtype``): the model's dtype (``auto``), or 8-bit blocks with a
float32 scale per (token, KV head) (``int8``, ``fp8_e4m3``: ``kernels/kv_quant.py``), and the
attention backend that reads them (``QuantizedKVBackend``: the torch reference, the Numba CPU or
the Numba CUDA kernels over quantized caches, after the backend ``--attention-backend`` chose)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import kv_quant
from kernels.kv_quant import KV_CACHE_DTYPES, QuantCache

CHOICES = ("auto", *KV_CACHE_DTYPES)


def check_kv_cache_dtype(name: str) -> None:
    if name not in CHOICES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(CHOICES)}, got {name!r}")


@dataclass(frozen=True)
class KVStorage:
    """What one (token, KV head) row of keys or values takes: ``head_dim`` elements of
    ``element_bytes`` each plus ``scale_bytes``."""

    name: str  # "auto"'s resolved dtype name ("bfloat16", ...), or "int8" / "fp8_e4m3"
    quantized: bool
    element_bytes: int
    scale_bytes: int
    reason: str


def kv_storage(kv_cache_dtype: str, dtype: torch.dtype) -> KVStorage:
    """The storage ``--kv-cache-dtype kv_cache_dtype`` gives a model in ``dtype``, and why (logged)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return KVStorage(str(dtype).removeprefix("torch."), False, torch.empty((), dtype=dtype).element_size(), 0,
                         "--kv-cache-dtype auto: the model's dtype")
    return KVStorage(kv_cache_dtype, True, 1, kv_quant.SCALE_BYTES,
                     f"--kv-cache-dtype {kv_cache_dtype}: one byte per element and a float32 scale per token "
                     "and KV head, dequantized by the attention kernels as they read")


def allocate_quantized(cfg, num_blocks: int, block_size: int, fmt: str, device):
    """Per layer (key_cache, value_cache) ``QuantCache``s (``runner.allocate_kv_cache``'s layout)."""
    shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    return [(QuantCache.zeros(shape, fmt, device), QuantCache.zeros(shape, fmt, device))
            for _ in range(cfg.num_layers)]


def _kernels(name: str):
    """(write, decode, prefill) over quantized caches for the backend called ``name``."""
    if name == "numba":
        from kernels.cpu import kv_quant as cpu

        return cpu.write_kv_cache, cpu.paged_decode_attention, cpu.paged_prefill_attention
    if name == "cuda":
        from kernels.cuda import kv_quant as gpu

        return gpu.torch_write_kv_cache, gpu.torch_paged_decode_attention, gpu.torch_paged_prefill_attention
    return kv_quant.write_kv_cache, kv_quant.paged_decode_attention, kv_quant.paged_prefill_attention


class QuantizedKVBackend:
    """The attention backend over ``QuantCache`` pools: the kernels of the same family as ``inner``
    (``--attention-backend``'s choice) that read quantized caches; block copies and swaps move
    bytes and scales together (torch indexing, as the cuda backend's own)."""

    decode_qkv = None  # the fused decode writes and reads the model's dtype: not over these pools
    warm_up = None

    def __init__(self, inner, kernels=None) -> None:
        self.inner = inner
        self.name = inner.name
        self._kernels = kernels or _kernels(inner.name)
        self._write, self._decode, self._prefill = self._kernels

    def __getattr__(self, name):  # the layers' other fused ops (norms, rotary, activations): inner's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def for_pass(self, meta, rope, num_tokens, dtype):
        """The inner backend's view for one forward pass (``decoder.py``), with these attention ops."""
        for_pass = getattr(self.inner, "for_pass", None)
        return self if for_pass is None else QuantizedKVBackend(for_pass(meta, rope, num_tokens, dtype), self._kernels)

    def runs_for(self, dtype) -> str:
        return f"{self.name} (quantized KV)"

    def prefill_kind(self) -> str:
        return self.name

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        self._write(key_cache, value_cache, key, value, slot_mapping)

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale,
               window=0, softcap=0.0) -> None:
        self._decode(out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap)

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale, new_key=None, new_value=None, window=0, softcap=0.0) -> None:
        self._prefill(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                      scale, window, softcap)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        kv_quant.copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, dst, src, block_mapping) -> None:
        kv_quant.swap_blocks(dst, src, block_mapping)
