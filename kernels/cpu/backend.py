"""The Numba CPU backend of ``services/executor/attention.py``."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from kernels import reference
from kernels.cpu.activation import silu_mul_
from kernels.cpu.cache_ops import copy_blocks, swap_blocks, write_kv_cache
from kernels.cpu.common import BITS_DTYPES, kernel_array, sync_threads
from kernels.cpu.decode import paged_decode_attention, run_plan
from kernels.cpu.rows_plan import MIN_PARTITION_SIZE, RowsPlan, plan_rows
from kernels.cpu.live_arrays import live_array
from kernels.cpu import activation, matmul_prefill, norm, rotary
from kernels.cpu import decode_qkv as qkv_kernels
from kernels.cpu.norm import add_rms_norm_
from kernels.cpu.pass_view import ForwardPass
from kernels.cpu.prefill import paged_prefill_attention
from kernels.cpu.rotary import rope_split_


# (norm, rotary, activation): rows from which these kernels run in parallel after
# ``parallel_small_rows(True)``. Measured serial / parallel, each call right after a torch matmul
# (so the idle threads spin), median of 1,500, bf16: 2-core AMD EPYC Zen 5, 64 rows: norm 11.6 /
# 7.3 us, rotary 24.2 / 14.8, activation 45.7 / 23.8; 16 rows: 3.2 / 3.2, 6.4 / 5.4, 12.3 / 7.3.
SMALL_ROWS_PARALLEL_FROM = (64, 16, 16)


def _pools_ok(*caches) -> bool:
    """Pools the kernels take: contiguous CPU tensors of one format (float32, bfloat16, float16)."""
    dtype = caches[0].dtype
    return dtype in BITS_DTYPES and all(
        c.is_cpu and c.dtype == dtype and c.is_contiguous() for c in caches)


# (id(key pool), id(value pool)) -> weak references to both, for pairs that passed _pools_ok
_checked_pairs: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}


def _pool_pair_ok(key_cache, value_cache) -> bool:
    """``_pools_ok`` for a layer's (key, value) pools, remembered per pair of pool objects: each
    layer's pools are checked once, not at each of the two or three calls per layer and step. (An
    entry outlives its pools only as two dead weak references, which never match a new pool.)"""
    refs = _checked_pairs.get((id(key_cache), id(value_cache)))
    if refs is not None and refs[0]() is key_cache and refs[1]() is value_cache:
        return True
    if not _pools_ok(key_cache, value_cache):
        return False
    _checked_pairs[(id(key_cache), id(value_cache))] = (weakref.ref(key_cache), weakref.ref(value_cache))
    return True


def _io_ok(cache, *tensors) -> bool:
    """Queries, outputs, new keys/values: CPU tensors in float32 or the cache's format. (A loop, not
    ``all`` over a generator: this runs two or three times per layer and step.)"""
    for t in tensors:
        if not t.is_cpu or (t.dtype is not torch.float32 and t.dtype is not cache.dtype):
            return False
    return True


class NumbaCPUBackend:
    """Numba CPU kernels behind the dispatch's backend interface (torch CPU tensors, in place).

    Caches in float32, bfloat16 or float16 take the Numba kernels (16-bit ones as their raw bits,
    widened to float32 inside; ``kernels/cpu/common.py``), with queries, outputs and new K/V in
    float32 or the cache's dtype. Anything else (other dtypes, non-contiguous pools, pools of two
    dtypes) falls back to the PyTorch reference.
    """

    name = "numba"

    def __init__(self, matmul_prefill_path: bool | None = None, *, native_bf16: str | None = None,
                 idle_threads_spin: Callable[[], bool] | None = None) -> None:
        # What the caller read of the machine (the executor, ``services/executor/attention.py``,
        # from ``shared``: kernels import only numba, numpy and torch): ``native_bf16``, the CPU's
        # native bfloat16 path (``CpuFeatures.native_bf16()``: "amx", "avx512_bf16" or None), and
        # ``idle_threads_spin``, asked by ``parallel_small_rows`` whether idle OpenMP threads spin
        # (``shared.cpu_threads.idle_threads_spin``; None: taken to sleep).
        self._idle_threads_spin = idle_threads_spin
        # Whether bfloat16 prompts of ``matmul_prefill.MIN_ROWS`` rows or more take torch's fused
        # attention (``kernels/cpu/matmul_prefill.py``) instead of the Numba prefill. None: where
        # the CPU has AMX, where it was measured faster (2.1-2.9x from 128 rows on an AMX Xeon).
        if matmul_prefill_path is None:
            matmul_prefill_path = native_bf16 == "amx"
        self.matmul_prefill_path = matmul_prefill_path
        # (block tables, (threads, ...), the context lengths' bytes, plan) of the last decode
        # call: the step's plan, reused by its other layers (``decode_plan``)
        self._last_plan = None
        # rows from which the norm, rotary and activation kernels run in parallel (their modules'
        # thresholds until ``parallel_small_rows(True)`` lowers them)
        self.parallel_small_rows(False)

    def parallel_small_rows(self, on: bool) -> bool:
        """Let the norm, rotary and activation kernels run in parallel from a few rows (a decode
        batch; ``SMALL_ROWS_PARALLEL_FROM``) where ``on`` and the idle OpenMP threads spin
        (the ``idle_threads_spin`` the caller passed), else from their modules' thresholds; returns
        whether they now do. The executor turns it on where its thread tuner chooses each step's
        threads by timing (``services/executor/thread_tuner.py``): a step whose extra parallel
        regions are held up by a busy neighbour is then timed slower, and the tuner moves that
        step size to one thread, where these kernels run serially. Outputs are the same bits either
        way (rows are independent)."""
        spin = self._idle_threads_spin
        small = on and spin is not None and spin()
        defaults = (norm.PARALLEL_FROM_ROWS, rotary.PARALLEL_FROM_ROWS, activation.PARALLEL_FROM_ROWS)
        self._norm_from, self._rotary_from, self._activation_from = (
            SMALL_ROWS_PARALLEL_FROM if small else defaults)
        return small

    def row_thresholds(self) -> tuple[int, int, int]:
        """Rows from which the norm, rotary and activation kernels run in parallel (``parallel_small_rows``)."""
        return self._norm_from, self._rotary_from, self._activation_from

    def for_pass(self, meta, rope, num_tokens: int, dtype: torch.dtype):
        """This backend for one forward pass of ``num_tokens`` rows in ``dtype`` with the pass's
        metadata and rotary tables (cos, sin): what every layer's calls share is checked and made
        once (``kernels/cpu/pass_view.py``), with the same results. The backend itself where the
        pass's dtype is not the fused kernels' (float32, bfloat16)."""
        if dtype is not torch.float32 and dtype is not torch.bfloat16:
            return self
        return ForwardPass(self, meta, rope, num_tokens, dtype)

    @staticmethod
    def pools_ok(key_cache, value_cache) -> bool:
        """Whether a layer's pools are the kernels' (checked once per pair: ``_pool_pair_ok``)."""
        return _pool_pair_ok(key_cache, value_cache)

    def prefill_kind(self) -> str:
        """What the start-up log says of the prefill attention."""
        if self.matmul_prefill_path:
            return f"bfloat16 prompts of {matmul_prefill.MIN_ROWS}+ rows: torch fused attention (AMX); else numba"
        return "numba"

    # the thread count the attention kernels size their partitions for (``decode.attend_rows``);
    # None: the current count. An executor that changes its count per step fixes it here.
    partition_threads: int | None = None

    def write_kv(self, key_cache, value_cache, key, value, slot_mapping) -> None:
        if not (_pool_pair_ok(key_cache, value_cache) and _io_ok(key_cache, key, value)):
            return reference.write_kv_cache(key_cache, value_cache, key, value, slot_mapping)
        sync_threads()
        write_kv_cache(live_array(key_cache), live_array(value_cache), kernel_array(key),
                       kernel_array(value), live_array(slot_mapping))

    def decode(self, out, query, key_cache, value_cache, block_tables, context_lens, scale,
               window=0, softcap=0.0) -> None:
        """``window`` (sliding window) and ``softcap`` (logit soft-cap): in the kernels themselves
        (``decode.attend_rows``), every plan, partitioned ones included."""
        if not (_pool_pair_ok(key_cache, value_cache) and _io_ok(key_cache, out, query)):
            return reference.paged_decode_attention(
                out, query, key_cache, value_cache, block_tables, context_lens, scale, window, softcap)
        plan = self.decode_plan(block_tables, context_lens, key_cache, sync_threads())
        run_plan(kernel_array(out), kernel_array(query), live_array(key_cache), live_array(value_cache),
                 plan, scale, window, softcap)

    def decode_qkv(self, qkv, cos, sin, key_cache, value_cache, slot_mapping, block_tables,
                   context_lens, scale, num_heads: int, window=0, softcap=0.0):
        """A decode batch's attention ``[T, H, D]`` straight from its fused q/k/v projection
        ``qkv`` (one row per sequence): the rotary embedding, the write of the new keys and values
        and the attention in one kernel call (``kernels/cpu/decode_qkv.py``); the same bits as
        ``rope_split``, ``write_kv`` and ``decode`` one after the other. None (nothing done) where
        it does not apply: other formats, a partitioned plan. ``window``, ``softcap``: as in
        ``decode``, in the kernel."""
        dtype = qkv.dtype
        if not (_pool_pair_ok(key_cache, value_cache) and key_cache.dtype is dtype
                and _fusable(qkv, cos, sin) and qkv.is_contiguous()):
            return None
        plan = self.decode_plan(block_tables, context_lens, key_cache, sync_threads())
        if not qkv_kernels.plan_ok(plan):
            return None
        num_tokens, head_dim = qkv.shape[0], key_cache.shape[3]
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype)
        qkv_kernels.decode_qkv(
            kernel_array(out), kernel_array(qkv), live_array(cos).reshape(num_tokens, head_dim),
            live_array(sin).reshape(num_tokens, head_dim), live_array(slot_mapping),
            live_array(key_cache), live_array(value_cache), plan, scale, window, softcap)
        return out

    def decode_plan(self, block_tables, context_lens, key_cache, threads: int):
        """``rows_plan.plan_rows`` for a decode batch (one row per sequence), made once per step: every
        layer passes the same metadata tensors (``AttentionMetadata``), and the plan depends on
        nothing else but the lengths' values (compared: a caller may change a tensor in place), the
        thread count and the pools' shape."""
        key = (threads, self.partition_threads, key_cache.shape[1], key_cache.shape[2])
        lens = live_array(context_lens)
        values = lens.tobytes()  # (compared as bytes: 0.1 us, np.array_equal 2.5)
        last = self._last_plan
        if last is not None and last[0] is block_tables and last[1] == key and last[2] == values:
            return last[3]
        plan = plan_rows(live_array(block_tables), np.arange(len(lens)), lens, key_cache.shape[1],
                         key_cache.shape[2], num_threads=threads, partition_threads=self.partition_threads)
        self._last_plan = (block_tables, key, values, plan)
        return plan

    def prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                context_lens, scale, new_key=None, new_value=None, window=0, softcap=0.0) -> None:
        """``window`` and ``softcap``: as in ``decode``, in the Numba kernels; a call with either
        takes them even where the torch fused-attention path (``matmul_prefill``) would run, which
        has neither."""
        if not (_pool_pair_ok(key_cache, value_cache) and _io_ok(key_cache, out, query)):
            return reference.paged_prefill_attention(
                out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                scale, window, softcap)
        if (self.matmul_prefill_path and key_cache.dtype is torch.bfloat16
                and query.dtype is torch.bfloat16 and not (window > 0 or softcap > 0)):
            if new_key is not None and not (new_key.dtype is new_value.dtype is query.dtype):
                new_key = new_value = None
            return self._prefill_by_length(out, query, key_cache, value_cache, block_tables,
                                           query_start_loc, context_lens, scale, new_key, new_value)
        self._numba_prefill(out, query, key_cache, value_cache, block_tables, query_start_loc,
                            context_lens, scale, window=window, softcap=softcap)

    def _numba_prefill(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                       context_lens, scale, sequences=None, window=0, softcap=0.0) -> None:
        threads = sync_threads()
        paged_prefill_attention(
            kernel_array(out), kernel_array(query), live_array(key_cache),
            live_array(value_cache), live_array(block_tables), live_array(query_start_loc),
            live_array(context_lens), scale, num_threads=threads,
            partition_threads=self.partition_threads, sequences=sequences, window=window,
            softcap=softcap)

    def _prefill_by_length(self, out, query, key_cache, value_cache, block_tables, query_start_loc,
                           context_lens, scale, new_key, new_value) -> None:
        """Sequences of ``matmul_prefill.MIN_ROWS`` rows or more one by one through torch's fused
        attention (a fresh prompt's on its new keys and values where they are given, no gather
        from the pools); all the shorter ones in one Numba call (``paged_prefill_attention``
        computes the rows of the sequences it is given). One call, not one per run of short ones
        between long ones: each call costs tens of microseconds, 30 layers a step."""
        starts, lens = query_start_loc.tolist(), context_lens.tolist()
        short = []
        for s in range(len(lens)):
            n = starts[s + 1] - starts[s]
            if n < matmul_prefill.MIN_ROWS:
                if n:
                    short.append(s)
                continue
            rows = slice(starts[s], starts[s + 1])
            matmul_prefill.prefill_sequence(
                out[rows], query[rows], key_cache, value_cache, block_tables[s], lens[s], scale,
                None if new_key is None else new_key[rows], None if new_value is None else new_value[rows])
        if short:
            self._numba_prefill(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                context_lens, scale, short)

    def copy_blocks(self, key_caches, value_caches, block_mapping) -> None:
        if not _pools_ok(*key_caches, *value_caches):
            return reference.copy_blocks(key_caches, value_caches, block_mapping)
        sync_threads()
        copy_blocks([kernel_array(k) for k in key_caches], [kernel_array(v) for v in value_caches],
                    kernel_array(block_mapping))

    def swap_blocks(self, dst, src, block_mapping) -> None:
        if not _pools_ok(dst, src):
            return reference.swap_blocks(dst, src, block_mapping)
        sync_threads()
        swap_blocks(kernel_array(dst), kernel_array(src), kernel_array(block_mapping))

    def warm_up(self, key_cache, value_cache, num_heads: int, max_model_len: int) -> None:
        """Load (or, on a cold Numba cache, compile) the kernels a step reaches only in rare shapes,
        in this pool's format: the block copy of copy-on-write and swaps, and where a context can
        outgrow ``rows_plan.MIN_PARTITION_SIZE`` tokens (``max_model_len``), the partitioned decode
        (such a context at a small batch: 3.3 s to compile in bf16 on a 2-core AMD EPYC). Reads
        blocks 0 and 1 and copies block 1 onto block 0: for a warm-up, before any block holds a
        sequence's data."""
        if key_cache.shape[0] < 2 or not _pool_pair_ok(key_cache, value_cache):
            return
        self.copy_blocks([key_cache], [value_cache], torch.tensor([[1, 0]]))
        if _fusable(key_cache):
            self._warm_decode_qkv(key_cache, value_cache, num_heads)
        if max_model_len <= MIN_PARTITION_SIZE:
            return
        block_size, head_dim = key_cache.shape[2], key_cache.shape[3]
        query = torch.zeros(1, num_heads, head_dim, dtype=key_cache.dtype)
        out = torch.empty_like(query)
        threads = sync_threads()
        paged_decode_attention(
            kernel_array(out), kernel_array(query), live_array(key_cache), live_array(value_cache),
            np.array([[0, 1]], np.int32), np.array([2 * block_size], np.int32), 1.0,
            partition_size=block_size, num_threads=threads, partition_threads=self.partition_threads)

    def _warm_decode_qkv(self, key_cache, value_cache, num_heads: int) -> None:
        """The fused decode's parallel kernel (a warm-up decode of two short sequences runs its
        serial one): one row over block 0's first position, its slot -1 (nothing written)."""
        num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
        first = np.zeros(1, np.int32)  # row 0, its block-table row 0
        plan = RowsPlan(rows=first, seqs=first, lens=np.ones(1, np.int32),
                        block_tables=np.zeros((1, 1), np.int32), serial=False, partition_size=0, row_ids=None)
        qkv = torch.zeros(1, (num_heads + 2 * num_kv_heads) * head_dim, dtype=key_cache.dtype)
        rope = torch.zeros(1, head_dim, dtype=key_cache.dtype)
        out = torch.empty(1, num_heads, head_dim, dtype=key_cache.dtype)
        sync_threads()
        qkv_kernels.decode_qkv(kernel_array(out), kernel_array(qkv), kernel_array(rope), kernel_array(rope),
                               np.full(1, -1, np.int64), live_array(key_cache), live_array(value_cache),
                               plan, 1.0, 0, 0.0)

    # The model's elementwise chains (``services/executor/layers.py``), fused; None where these
    # tensors are not the kernels' (the model then runs the torch form).

    def add_rms_norm(self, residual, delta, weight, eps):
        """``residual += delta`` in place, returns ``RMSNorm(residual)`` (``kernels/cpu/norm.py``)."""
        if not (_fusable(residual, delta, weight) and residual.is_contiguous() and delta.is_contiguous()):
            return None
        return add_rms_norm_(residual, delta, weight, eps, self._norm_from)

    def rope_split(self, qkv, cos, sin, num_heads, num_kv_heads):
        """Rotated q and k and v from a fused projection's output (``kernels/cpu/rotary.py``)."""
        if not (_fusable(qkv, cos, sin) and qkv.is_contiguous()):
            return None
        return rope_split_(qkv, cos, sin, num_heads, num_kv_heads, self._rotary_from)

    def silu_mul(self, gate_up):
        """``silu(gate) * up`` from a fused gate/up projection's output ``[T, 2 I]``
        (``kernels/cpu/activation.py``; float32, bfloat16 or float16)."""
        if not (gate_up.is_cpu and gate_up.dtype in BITS_DTYPES and gate_up.is_contiguous()):
            return None
        return silu_mul_(gate_up, self._activation_from)

    def gelu_tanh_mul(self, gate_up):
        """``gelu_tanh(gate) * up`` (Gemma's MLP), as ``silu_mul`` (float32, bfloat16 or float16)."""
        if not (gate_up.is_cpu and gate_up.dtype in BITS_DTYPES and gate_up.is_contiguous()):
            return None
        return activation.gelu_tanh_mul_(gate_up, self._activation_from)

    def head_rms_norm(self, qkv, q_weight, k_weight, eps, num_heads, num_kv_heads) -> bool:
        """Qwen3's and Gemma 3's query and key head norms in place on the fused projection's output
        (``kernels/cpu/norm.py``); False where these tensors are not the kernel's."""
        if not (_fusable(qkv, q_weight, k_weight) and qkv.is_contiguous()):
            return False
        norm.head_rms_norm_(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads)
        return True


def _fusable(*tensors) -> bool:
    """CPU tensors of one dtype the fused elementwise kernels take (float32, bfloat16). (A loop, as
    ``_io_ok``: three times per layer and step.)"""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype is not dtype:
            return False
    return True
