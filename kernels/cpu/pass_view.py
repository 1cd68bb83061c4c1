"""The Numba CPU backend as one forward pass sees it (``NumbaCPUBackend.for_pass``): what is the
same for every layer of the pass (the checks of the residual stream, the rotary tables and the
step's metadata, the decode plan, their numpy views, which kernel runs, serial or parallel) is
made once per pass, and each of the layers' ~100 kernel calls is then little more than the kernel.

Why: a layer's kernel calls come between matmuls that stream megabytes of weights (and an
attention that streams the layer's KV cache), so the Python around each call runs with cold
caches: at a decode batch of 64 (SmolLM2, float32, oneDNN matmuls, a 2-core AMD EPYC Zen 4) the
norm's wrapper took 55-100 us around a 25-45 us kernel, against 10 us around 9 us alone in a loop.
The pass's Python outside matmuls and kernels was 11-16 ms of a ~150 ms step.

``ForwardPass`` has the backend's methods for the model's elementwise chains and the fused decode
(``add_rms_norm``, ``silu_mul``, ``decode_qkv``) with the same results bit for bit; every other
attribute is the backend's own. A call whose tensors are not the ones checked for the pass (another
dtype, a non-contiguous tensor, other rotary tables or metadata) goes to the backend's method,
which checks everything."""

from __future__ import annotations

import numpy as np
import torch

from kernels.cpu import activation, norm
from kernels.cpu import decode_qkv as qkv_kernels
from kernels.cpu.common import kernel_array, sync_threads
from kernels.cpu.live_arrays import live_array
from kernels.cpu.vectors import GroupShape


class ForwardPass:
    """``backend`` for one forward pass of ``num_tokens`` rows in ``dtype``; ``meta`` and ``rope``
    (cos and sin ``[T, 1, D]``) are the pass's, whose arrays the fused decode takes."""

    def __init__(self, backend, meta, rope: tuple[torch.Tensor, torch.Tensor], num_tokens: int,
                 dtype: torch.dtype) -> None:
        self._backend, self._meta, self._rope = backend, meta, rope
        self._dtype, self._num_tokens = dtype, num_tokens
        self._threads = sync_threads()  # numba's threads follow torch's, once for the pass
        norm_from, _, activation_from = backend.row_thresholds()
        self._norm = norm._add_rms_norm_parallel if num_tokens >= norm_from else norm._add_rms_norm_serial
        self._silu = (activation._silu_mul_parallel if num_tokens >= activation_from
                      else activation._silu_mul_serial)
        self._eps: dict[float, np.float32] = {}
        self._decode = None  # (kernel, its plan and metadata arrays): at the first decode_qkv
        self._shapes: dict[tuple[int, int, int], GroupShape] = {}

    def __getattr__(self, name):  # everything the pass does not specialize
        return getattr(self._backend, name)

    def _ours(self, t: torch.Tensor) -> bool:
        return t.dtype is self._dtype and t.is_cpu and t.is_contiguous()

    def add_rms_norm(self, residual, delta, weight, eps):
        """As ``NumbaCPUBackend.add_rms_norm``."""
        if not (residual.shape[0] == self._num_tokens and self._ours(residual) and self._ours(delta)
                and self._ours(weight) and self._num_tokens):
            return self._backend.add_rms_norm(residual, delta, weight, eps)
        eps32 = self._eps.get(eps)
        if eps32 is None:
            eps32 = self._eps[eps] = np.float32(eps)
        out = torch.empty_like(residual)
        self._norm(kernel_array(out), live_array(residual), kernel_array(delta), live_array(weight), eps32)
        return out

    def silu_mul(self, gate_up):
        """As ``NumbaCPUBackend.silu_mul``."""
        if not (gate_up.shape[0] == self._num_tokens and self._ours(gate_up) and self._num_tokens):
            return self._backend.silu_mul(gate_up)
        out = torch.empty(self._num_tokens, gate_up.shape[1] // 2, dtype=self._dtype)
        self._silu(kernel_array(out), kernel_array(gate_up))
        return out

    def decode_qkv(self, qkv, cos, sin, key_cache, value_cache, slot_mapping, block_tables,
                   context_lens, scale, num_heads: int, window: int = 0, softcap: float = 0.0):
        """As ``NumbaCPUBackend.decode_qkv``."""
        shape = self._decode_shape(qkv, cos, sin, key_cache, value_cache, slot_mapping, block_tables,
                                   context_lens, num_heads)
        if shape is None:
            return self._backend.decode_qkv(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                            block_tables, context_lens, scale, num_heads, window, softcap)
        kernel, cos_a, sin_a, slots, tables, rows, seqs, lens = self._decode
        out = torch.empty(self._num_tokens, num_heads, key_cache.shape[3], dtype=self._dtype)
        kernel(kernel_array(out), kernel_array(qkv), cos_a, sin_a, slots, live_array(key_cache),
               live_array(value_cache), tables, rows, seqs, lens, float(scale), shape, int(window),
               float(softcap))
        return out

    def _decode_shape(self, qkv, cos, sin, key_cache, value_cache, slot_mapping, block_tables,
                      context_lens, num_heads: int) -> GroupShape | None:
        """The group shape with which the pass runs this fused decode itself; None where the call
        is the backend's: tensors other than the ones checked for the pass, pools or a plan the
        kernel does not take, a projection of another width (where the backend declines or raises)."""
        meta = self._meta
        if not (cos is self._rope[0] and sin is self._rope[1] and slot_mapping is meta.slot_mapping
                and block_tables is meta.decode_block_tables and context_lens is meta.decode_context_lens
                and self._ours(qkv) and key_cache.dtype is self._dtype):
            return None
        if self._decode is None:
            self._decode = self._prepare_decode(key_cache, value_cache)
        num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
        if (self._decode is False or not self._backend.pools_ok(key_cache, value_cache)
                or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or num_heads % num_kv_heads):
            return None
        key = (num_heads, num_kv_heads, head_dim)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = GroupShape.of(num_heads // num_kv_heads, head_dim)
        return shape

    def _prepare_decode(self, key_cache, value_cache):
        """(kernel, arrays) of the pass's fused decode; False where the backend's checks would
        refuse it (then every call goes to the backend)."""
        meta, (cos, sin) = self._meta, self._rope
        num_tokens, head_dim = self._num_tokens, key_cache.shape[3]
        if not (self._backend.pools_ok(key_cache, value_cache) and self._ours(cos) and self._ours(sin)
                and cos.shape[0] == num_tokens and meta.num_decodes == num_tokens):
            return False
        plan = self._backend.decode_plan(meta.decode_block_tables, meta.decode_context_lens, key_cache,
                                         self._threads)
        if not qkv_kernels.plan_ok(plan):
            return False
        return (qkv_kernels.kernel_for(plan), live_array(cos).reshape(num_tokens, head_dim),
                live_array(sin).reshape(num_tokens, head_dim), live_array(meta.slot_mapping),
                plan.block_tables, plan.rows, plan.seqs, plan.lens)
