"""Signatures for ahead-of-time PTX compilation (``tests/kernels/test_ptx.py``); C-contiguous
arrays. The attention kernels and the cache write also in their 16-bit forms: bfloat16 caches and
queries as int16 bits (``_bf16``), float16 (``_f16``)."""

from __future__ import annotations

from numba import float32

from kernels.cuda.cache_ops import copy_blocks_kernel, write_kv_kernel
from kernels.cuda.decode import decode_kernel
from kernels.cuda.merge import merge_kernel
from kernels.cuda.prefill import prefill_kernel


def ptx_signatures():
    """``{name: (python function, signature)}`` for ``cuda.compile_ptx``."""
    from numba import int16, int32, int64
    from numba.core.types import float16

    f4 = float32[:, :, :, ::1]
    f3 = float32[:, :, ::1]
    i32_2 = int32[:, ::1]
    i32_1 = int32[::1]
    b4, b3 = int16[:, :, :, ::1], int16[:, :, ::1]  # bfloat16 bits
    h4, h3 = float16[:, :, :, ::1], float16[:, :, ::1]
    return {
        "write_kv_kernel": (write_kv_kernel, (f4, f4, f3, f3, int64[::1])),
        "decode_kernel": (decode_kernel, (f4, f3, f3, f3, f4, f4, i32_2, i32_1, float32, int32, int32, float32)),
        "prefill_kernel": (prefill_kernel, (f4, f3, f3, i32_1, f3, f4, f4, i32_2, i32_1, i32_1,
                                            float32, int32, int32, float32)),
        "merge_kernel": (merge_kernel, (f3, f4, f3, f3, i32_1, int32, int32)),
        "copy_blocks_kernel": (copy_blocks_kernel, (float32[:, ::1], float32[:, ::1], int64[:, ::1])),
        "decode_kernel_bf16": (decode_kernel, (f4, f3, f3, b3, b4, b4, i32_2, i32_1, float32, int32, int32, float32)),
        "prefill_kernel_bf16": (prefill_kernel, (f4, f3, f3, i32_1, b3, b4, b4, i32_2, i32_1, i32_1,
                                                 float32, int32, int32, float32)),
        "write_kv_kernel_bf16": (write_kv_kernel, (b4, b4, b3, b3, int64[::1])),
        "decode_kernel_f16": (decode_kernel, (f4, f3, f3, h3, h4, h4, i32_2, i32_1, float32, int32, int32, float32)),
        "prefill_kernel_f16": (prefill_kernel, (f4, f3, f3, i32_1, h3, h4, h4, i32_2, i32_1, i32_1,
                                                float32, int32, int32, float32)),
        "write_kv_kernel_f16": (write_kv_kernel, (h4, h4, h3, h3, int64[::1])),
    }
