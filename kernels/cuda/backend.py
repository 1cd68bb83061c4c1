"""The Numba CUDA backend of ``services/executor/attention.py``."""

from __future__ import annotations

import numpy as np
from numba import cuda

from kernels.cuda.config import SIMULATOR
from kernels.cuda.launch import paged_decode_attention, paged_prefill_attention, write_kv_cache


def _check_numba_cuda_loads() -> None:
    """Load numba's CUDA lowering now (the first kernel compile would), so that a numba-cuda this
    numpy breaks is an ImportError here: numba-cuda 0.30.4, the last before its maintenance mode,
    registers ``np.row_stack``, which numpy 2.5 removed (NVIDIA/numba-cuda#907), and then fails
    every compile with an AttributeError."""
    try:
        import numba.cuda.cudaimpl  # noqa: F401  (its import registers the array functions)
    except (AttributeError, ImportError) as exc:
        from importlib import metadata

        try:
            version = f"numba-cuda {metadata.version('numba-cuda')}"
        except metadata.PackageNotFoundError:
            version = "numba's CUDA target"
        hint = "; install numpy<2.5 beside it" if "row_stack" in str(exc) else ""
        raise ImportError(f"{version} cannot compile kernels with numpy {np.__version__} ({exc}){hint}") from exc


class NumbaCUDABackend:
    """Numba CUDA kernels behind the dispatch's backend interface (torch CUDA tensors, in place).

    Launches go on torch's current stream, workspaces come from torch's caching allocator. Caches
    in float32, float16 or bfloat16 (handed to numba as an int16 view: torch exports bfloat16 as
    ``<V2``, which numba cannot read), with queries and new keys/values in the cache's dtype; the
    kernels accumulate in float32 and write a float32 result, cast into ``out``'s dtype by torch.
    Anything else falls back to the reference.
    """

    name = "cuda"

    def __init__(self) -> None:
        if SIMULATOR or not cuda.is_available():
            raise ImportError("Numba CUDA backend: no CUDA device available to numba"
                              + (" (the CUDA simulator is enabled)" if SIMULATOR else ""))
        _check_numba_cuda_loads()
        import torch

        self._torch = torch
        self._dtypes = (torch.float32, torch.float16, torch.bfloat16)  # the caches the kernels read

    def runs_for(self, dtype) -> str:
        """What runs the attention of a model in ``dtype`` (for the executor's log)."""
        return self.name if dtype in self._dtypes else "torch"

    def _fast(self, cache, *tensors) -> bool:
        """Tensors the kernels take: on the GPU, the cache in a dtype they read, the others in the
        cache's dtype."""
        return (cache.is_cuda and cache.dtype in self._dtypes
                and all(t.is_cuda and t.dtype == cache.dtype for t in tensors))

    def _dev(self, t):
        t = t.detach()
        if t.dtype == self._torch.bfloat16:
            t = t.view(self._torch.int16)  # its bits: the kernels widen them (config.widen)
        return cuda.as_cuda_array(t, sync=False)  # ordering: same stream as torch

    def _stream(self, t):
        handle = self._torch.cuda.current_stream(t.device).cuda_stream
        # torch's default stream is the legacy default stream (handle 0)
        return cuda.default_stream() if handle == 0 else cuda.external_stream(handle)

    def _empty(self, device):
        torch = self._torch
        dtypes = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}
        keep = self._keep = []  # workspaces live until the next call (stream-ordered reuse)

        def empty(shape, dtype):
            t = torch.empty(shape, dtype=dtypes[np.dtype(dtype)], device=device)
            keep.append(t)
            return cuda.as_cuda_array(t, sync=False)

        return empty

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        from kernels import reference

        if not (self._fast(key_cache, value_cache, key, value)
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        with cuda.gpus[key_cache.device.index or 0]:
            write_kv_cache(self._dev(key_cache), self._dev(value_cache),
                           self._dev(key.contiguous()), self._dev(value.contiguous()),
                           self._dev(slot_mapping.to(self._torch.int64).contiguous()),
                           stream=self._stream(key_cache))

    def _attention(self, kind, out, query, key_cache, value_cache, block_tables, query_start_loc,
                   context_lens, scale, window=0, softcap=0.0):
        torch = self._torch
        device = query.device
        exact = out.is_contiguous() and out.dtype == torch.float32
        target = out if exact else torch.empty(out.shape, dtype=torch.float32, device=device)
        args = [self._dev(query.contiguous()), self._dev(key_cache), self._dev(value_cache),
                self._dev(block_tables.to(torch.int32).contiguous())]
        if kind == "prefill":
            args.append(self._dev(query_start_loc.to(torch.int32).contiguous()))
        lens = context_lens.to(torch.int32).contiguous()
        if lens.is_cuda:  # no device-to-host sync: the block table's width bounds every context
            max_len = block_tables.shape[1] * key_cache.shape[2]
        else:
            max_len = int(lens.max())
            lens = lens.to(device)
        with cuda.gpus[device.index or 0]:
            fn = paged_decode_attention if kind == "decode" else paged_prefill_attention
            fn(self._dev(target), *args, self._dev(lens), scale, max_len=max_len,
               empty=self._empty(device), stream=self._stream(query), window=window, softcap=softcap)
        if target is not out:
            out.copy_(target)

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale,
               window=0, softcap=0.0) -> None:
        """``window`` (sliding window) and ``softcap`` (logit soft-cap): in the kernels
        (``kernels/cuda/decode.py``), as in the reference."""
        from kernels import reference

        if not (self._fast(key_cache, query, value_cache) and out.is_cuda
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_decode_attention(
                out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap)
        if query.shape[0]:
            self._attention("decode", out, query, key_cache, value_cache, block_tables, None,
                            context_lens, scale, window, softcap)

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                context_lens, scale, new_key=None, new_value=None, window=0, softcap=0.0) -> None:
        """``window``, ``softcap``: as in ``decode``, in the kernels."""
        from kernels import reference

        if not (self._fast(key_cache, query, value_cache) and out.is_cuda
                and key_cache.is_contiguous() and value_cache.is_contiguous()):
            return reference.paged_prefill_attention(
                out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale, window, softcap)
        if query.shape[0]:
            self._attention("prefill", out, query, key_cache, value_cache, block_tables,
                            query_start_loc, context_lens, scale, window, softcap)

    # Block copies and swaps go through PyTorch's indexing on the device for now: the CUDA copy
    # kernel (kernels/cuda/cache_ops.py) is checked under the simulator and as PTX, but the swap
    # path between a CUDA pool and a CPU pool has not yet run on a GPU here.
    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        from kernels import reference

        reference.copy_blocks(key_caches, value_caches, block_mapping)

    def swap_blocks(self, dst, src, block_mapping) -> None:
        from kernels import reference

        reference.swap_blocks(dst, src, block_mapping)
