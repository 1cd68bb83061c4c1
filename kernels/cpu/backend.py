"""The Numba CPU backend of ``services/executor/attention.py``, and numba's thread count."""

from __future__ import annotations

import threading

import numba
import torch

from kernels import reference
from kernels.cpu.cache_ops import copy_blocks, swap_blocks, write_kv_cache
from kernels.cpu.decode import paged_decode_attention
from kernels.cpu.prefill import paged_prefill_attention


_thread_state = threading.local()


def sync_threads() -> int:
    """Give numba's parallel loops the same thread count as torch, and return it.

    numba's setting belongs to the calling thread, so this runs on every call (cheaply: numba is
    only told again when torch's count changed since this thread's last call).
    """
    wanted = torch.get_num_threads()
    state = _thread_state.__dict__
    if state.get("torch") != wanted:
        n = max(1, min(wanted, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(n)
        state["torch"], state["numba"] = wanted, n
    return state["numba"]


def _np(t):
    return t.detach().numpy() if t.requires_grad else t.numpy()  # zero-copy either way


class NumbaCPUBackend:
    """Numba CPU kernels behind the dispatch's backend interface (torch CPU tensors, in place).

    float32 KV caches take the Numba kernels; other dtypes (float16, bfloat16: numpy has no
    bfloat16) and non-contiguous caches fall back to the PyTorch reference.
    """

    name = "numba"

    @staticmethod
    def _fast(*tensors) -> bool:
        return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        if not (self._fast(key_cache, value_cache, key, value)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        sync_threads()
        write_kv_cache(_np(key_cache), _np(value_cache), _np(key), _np(value), _np(slot_mapping))

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale) -> None:
        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_decode_attention(
                out, query, key_cache, value_cache, block_tables, context_lens, scale)
        threads = sync_threads()
        paged_decode_attention(_np(out), _np(query), _np(key_cache), _np(value_cache),
                               _np(block_tables), _np(context_lens), scale, num_threads=threads)

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                context_lens, scale) -> None:
        if not (self._fast(out, query, key_cache, value_cache)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_prefill_attention(
                out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale)
        sync_threads()
        paged_prefill_attention(_np(out), _np(query), _np(key_cache), _np(value_cache),
                                _np(block_tables), _np(query_start_loc), _np(context_lens), scale)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        caches = (*key_caches, *value_caches)
        if not (self._fast(*caches) and all(c.is_contiguous() for c in caches)):
            return reference.copy_blocks(key_caches, value_caches, block_mapping)
        sync_threads()
        copy_blocks([_np(k) for k in key_caches], [_np(v) for v in value_caches], _np(block_mapping))

    def swap_blocks(self, dst, src, block_mapping) -> None:
        if not (self._fast(dst, src) and dst.is_contiguous() and src.is_contiguous()):
            return reference.swap_blocks(dst, src, block_mapping)
        sync_threads()
        swap_blocks(_np(dst), _np(src), _np(block_mapping))
