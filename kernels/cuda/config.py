"""Launch geometry and constants of the Numba CUDA kernels, fixed when this module is imported.

Reductions: on a GPU, warp shuffles (``shfl_xor``, below) and a shared array of
one value per warp; the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, read by numba when it is first
imported) has no warp shuffles, so there the same kernels reduce through shared memory
(``USE_SHUFFLE``), and the simulator runs 64-thread blocks, two warps, instead of 128.

The kernels read these names as globals when they are compiled, from their own module's
namespace (``from kernels.cuda.config import ...``): to compile a variant, patch the kernel's
module, not this one.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
USE_SHUFFLE = not SIMULATOR
WARP = 32
THREADS = 64 if SIMULATOR else 128  # threads per block (the simulator runs each as a Python thread)
NUM_WARPS = THREADS // WARP
MAX_HEAD_DIM = 256
MAX_PARTITION = 512  # tokens per partition: the logits of one partition live in shared memory
# per-token partial dot products of the shared-memory (simulator) reduction; 1 when unused
PARTIALS = 1 if USE_SHUFFLE else THREADS * WARP
FULL_MASK = np.int32(-1)  # all 32 lanes
SHFL_XOR = 3  # shfl_sync_intrinsic mode: lane ^ offset
NEG_INF = np.float32(-np.inf)
# registers per thread the attention kernels are held to (numba passes it to the CUDA linker as
# CU_JIT_MAX_REGISTERS; ``ptxas --maxrregcount`` in the resource check): 64 registers x THREADS
# (128) leave 8 blocks, 32 of 64 warps, resident per SM on sm_80/sm_90, i.e. 50% occupancy. The
# kernels need ~55 (``python -m loadtest.kernels.attention --ptxas``), so the cap costs no spills.
ATTENTION_MAX_REGISTERS = 64


def jit_options(max_registers: int | None = None) -> dict:
    """``cuda.jit`` keyword arguments; the simulator's ``cuda.jit`` takes no ``max_registers``."""
    return {} if SIMULATOR or max_registers is None else {"max_registers": max_registers}


def _shfl_xor_from_numba_intrinsic():
    """``shfl_xor(mask, value, lane_mask)`` -> the value of lane ``lane ^ lane_mask``, for numba's own
    CUDA target, whose ``cuda.shfl_xor_sync`` is a device function (``cuda.compile_ptx`` cannot
    compile one without a current device): an intrinsic over its ``shfl_sync_intrinsic``."""
    from numba import types
    from numba.core.typing import signature
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shfl_xor(typingctx, mask, value, lane_mask):
        if value not in (types.int32, types.int64, types.float32, types.float64):
            return None  # a typing error: numba's shuffle takes 32- and 64-bit ints and floats
        inner = signature(types.Tuple((value, types.boolean)), types.int32, types.int32, value, types.int32,
                          types.int32)

        def codegen(context, builder, sig, args):
            i32 = types.int32
            shuffle = context.get_function(cuda.shfl_sync_intrinsic, inner)
            mask, value, lane_mask = args
            pair = shuffle(builder, (context.cast(builder, mask, sig.args[0], i32), context.get_constant(i32, SHFL_XOR),
                                     value, context.cast(builder, lane_mask, sig.args[2], i32),
                                     context.get_constant(i32, 0x1F)))
            return builder.extract_value(pair, 0)

        return signature(value, mask, value, lane_mask), codegen

    return shfl_xor


# The warp shuffle the reductions use (``shfl_xor(FULL_MASK, value, lane_mask)``). numba-cuda (the
# CUDA target that numba >= 0.61 defers to when it is installed) has an intrinsic
# ``cuda.shfl_xor_sync`` and no ``shfl_sync_intrinsic``; numba's own target the other way round;
# the simulator never shuffles (``USE_SHUFFLE``).
if SIMULATOR:
    shfl_xor = None
elif hasattr(cuda, "shfl_sync_intrinsic"):
    shfl_xor = _shfl_xor_from_numba_intrinsic()
else:
    shfl_xor = cuda.shfl_xor_sync


def _widen_compiled():
    """``widen(x)``: a cache or query element as float32, for float32, float16 and bfloat16 bits
    (``int16``: torch hands a bfloat16 tensor to numba as ``<V2``, which it cannot read, so the
    backend passes an int16 view; the bits are the high half of a float32)."""
    from llvmlite import ir
    from numba import types
    from numba.core.typing import signature
    from numba.cuda.extending import intrinsic

    @intrinsic
    def widen(typingctx, x):
        if x not in (types.float32, types.float16, types.int16):
            return None

        def codegen(context, builder, sig, args):
            (value,) = args
            if sig.args[0] == types.int16:  # bfloat16 bits: shifted into a float32's high half, exact
                bits = builder.shl(builder.zext(value, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
                return builder.bitcast(bits, ir.FloatType())
            return context.cast(builder, value, sig.args[0], types.float32)

        return signature(types.float32, x), codegen

    return widen


def _widen_simulated(x):
    """The simulator's ``widen`` (its kernels run as Python on numpy scalars)."""
    if isinstance(x, np.int16):  # scalars of fixed width throughout (numpy 1.x would promote a Python int)
        return (np.uint32(x.view(np.uint16)) << np.uint32(16)).view(np.float32)
    return np.float32(x)


# 16-bit caches: the attention kernels read every query, key and value element through ``widen``
# and accumulate in float32, as the CPU kernels do (``kernels/cpu/common.py``).
widen = _widen_simulated if SIMULATOR else _widen_compiled()
