"""Signatures for ahead-of-time PTX compilation (``tests/test_kernels_ptx.py``); C-contiguous
arrays."""

from __future__ import annotations

from numba import float32

from kernels.cuda.cache_ops import copy_blocks_kernel, write_kv_kernel
from kernels.cuda.decode import decode_kernel
from kernels.cuda.merge import merge_kernel
from kernels.cuda.prefill import prefill_kernel


def ptx_signatures():
    """``{name: (python function, signature)}`` for ``cuda.compile_ptx``."""
    from numba import int32, int64

    f4 = float32[:, :, :, ::1]
    f3 = float32[:, :, ::1]
    i32_2 = int32[:, ::1]
    i32_1 = int32[::1]
    return {
        "write_kv_kernel": (write_kv_kernel, (f4, f4, f3, f3, int64[::1])),
        "decode_kernel": (decode_kernel, (f4, f3, f3, f3, f4, f4, i32_2, i32_1, float32, int32)),
        "prefill_kernel": (prefill_kernel, (f4, f3, f3, i32_1, f3, f4, f4, i32_2, i32_1, i32_1,
                                            float32, int32)),
        "merge_kernel": (merge_kernel, (f3, f4, f3, f3, i32_1, int32)),
        "copy_blocks_kernel": (copy_blocks_kernel, (float32[:, ::1], float32[:, ::1], int64[:, ::1])),
    }
