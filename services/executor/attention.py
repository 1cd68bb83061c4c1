"""The one dispatch point between the model and the paged-attention kernels.

A backend is a small object with ``write_kv``, ``decode``, ``prefill``, ``copy_blocks`` and
``swap_blocks`` methods taking torch tensors in the layouts documented in ``kernels/reference.py``,
in the model's dtype (float32, bfloat16 or float16; attention accumulates in float32 whatever it
is). The numba backend runs all three in its kernels; the cuda backend float32, and hands 16-bit
tensors to the PyTorch reference. A backend may also offer ``decode_qkv``: a decode-only step's
rotary embedding, cache write and attention in one call, from the layer's fused q/k/v projection
(``decode_from_qkv``; the numba backend has it). ``select_backend`` picks one by name
(``--attention-backend``): ``torch`` (the reference), ``numba`` (Numba CPU kernels) or ``cuda``
(Numba CUDA kernels); ``auto`` means numba on CPU and cuda on CUDA devices, when available.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import reference


@dataclass
class AttentionMetadata:
    """Per-step tensors every layer's attention reads (decodes first, then prefills)."""

    num_decodes: int  # the first num_decodes sequences (and tokens) are single-token decodes
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    # the prefill part, re-based so that its first sequence starts at query row 0
    prefill_query_start_loc: torch.Tensor  # [S - num_decodes + 1] int32
    # the decodes' and the prefills' rows of block_tables and context_lens, sliced once per step:
    # every layer passes the same tensors, so the kernels' views of them are made once too
    # (``kernels/cpu/live_arrays.py``)
    decode_block_tables: torch.Tensor = field(init=False)
    decode_context_lens: torch.Tensor = field(init=False)
    prefill_block_tables: torch.Tensor = field(init=False)
    prefill_context_lens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        nd = self.num_decodes
        self.decode_block_tables, self.prefill_block_tables = self.block_tables[:nd], self.block_tables[nd:]
        self.decode_context_lens, self.prefill_context_lens = self.context_lens[:nd], self.context_lens[nd:]


class TorchBackend:
    name = "torch"

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale,
               window=0, softcap=0.0) -> None:
        reference.paged_decode_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                                         window, softcap)

    def prefill(
        self, out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
        new_key=None, new_value=None, window=0, softcap=0.0,
    ) -> None:
        reference.paged_prefill_attention(
            out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
            window, softcap,
        )

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        reference.copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, dst, src, block_mapping) -> None:
        reference.swap_blocks(dst, src, block_mapping)


def _numba_backend():
    from kernels.cpu import NumbaCPUBackend  # imported lazily: compiling takes a few seconds
    from shared.cpu_features import read_cpu_features
    from shared.cpu_threads import idle_threads_spin

    # What the kernels may not import themselves (``kernels/`` imports only numba, numpy, torch):
    # the CPU's native bf16 path (AMX turns on the fused-attention prefill) and whether idle
    # OpenMP threads spin (small row kernels in parallel), read here and passed in.
    return NumbaCPUBackend(native_bf16=read_cpu_features().native_bf16(), idle_threads_spin=idle_threads_spin)


def _cuda_backend():
    from kernels.cuda import NumbaCUDABackend

    return NumbaCUDABackend()


_FACTORIES = {"torch": TorchBackend, "numba": _numba_backend, "cuda": _cuda_backend}
BACKEND_NAMES = ("auto", *_FACTORIES)


def select_backend(name: str, device: torch.device):
    """Return the backend called ``name``; ``auto`` picks the fastest one available for ``device``."""
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "numba"
        try:
            return _FACTORIES[name]()
        except ImportError:
            return TorchBackend()
    if name not in _FACTORIES:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    home = {"numba": "cpu", "cuda": "cuda"}.get(name)
    if home is not None and device.type != home:  # it would fall back to the reference on every call
        raise ValueError(f"--attention-backend {name} runs on {'the CPU' if home == 'cpu' else 'a GPU'}, not on "
                         f"--device {device}; use {'cuda' if home == 'cpu' else 'numba'} or torch there")
    try:
        return _FACTORIES[name]()
    except ImportError as exc:  # asked for by name: a configuration error (exit 2), not a crash to restart
        raise ValueError(f"--attention-backend {name}: {exc}") from exc


def paged_attention(
    backend,
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,  # [T, num_kv_heads, head_dim]: the step's new keys (written)
    value: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of a mixed batch: decodes in one kernel call, prefill chunks in another. ``key``
    and ``value``, the step's new keys and values (already in the pools), go to the prefill as
    ``new_key`` and ``new_value``: a backend may read a prompt without a cached prefix from them
    instead of from the pools (the numba backend's torch path does). ``window`` (sliding window,
    0: none) and ``softcap`` (logit soft-cap, 0: none) go to both (``kernels/reference.py``)."""
    out = torch.empty_like(query)
    nd, ndt = meta.num_decodes, meta.num_decode_tokens
    if nd:
        backend.decode(
            out[:ndt], query[:ndt], key_cache, value_cache, meta.decode_block_tables,
            meta.decode_context_lens, scale, window=window, softcap=softcap,
        )
    if ndt < query.shape[0]:
        backend.prefill(
            out[ndt:], query[ndt:], key_cache, value_cache, meta.prefill_block_tables,
            meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
            new_key=None if key is None else key[ndt:], new_value=None if value is None else value[ndt:],
            window=window, softcap=softcap,
        )
    return out


def decode_from_qkv(
    backend,
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) * head_dim]: the fused projection's output
    rope: tuple[torch.Tensor, torch.Tensor],  # cos and sin [T, 1, head_dim] (``RotaryEmbedding.at``)
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_heads: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor | None:
    """A decode-only step's attention ``[T, num_heads, head_dim]`` straight from the layer's fused
    q/k/v projection, where the backend does the rotary embedding, the cache write and the
    attention in one call (``decode_qkv``: the numba backend, ``kernels/cpu/decode_qkv.py``), with
    the bits of ``RotaryEmbedding``, ``write_kv`` and ``paged_attention`` one after the other. None
    where it does not (no such kernel, a step with prefills, tensors the kernel does not take): the
    caller then runs those three. ``window``, ``softcap``: as in ``paged_attention``."""
    fused = getattr(backend, "decode_qkv", None)
    num_tokens = qkv.shape[0]
    if fused is None or meta.num_decodes != num_tokens or meta.num_decode_tokens != num_tokens:
        return None
    return fused(qkv, *rope, key_cache, value_cache, meta.slot_mapping, meta.decode_block_tables,
                 meta.decode_context_lens, scale, num_heads, window, softcap)
