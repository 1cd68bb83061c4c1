"""What the Numba CPU kernels share: the prefetch intrinsic and the fastmath flags.

- ``fastmath`` is limited to ``reassoc``/``contract`` (plus ``nsz``/``arcp``) so that the dot
  products over ``head_dim`` vectorize; no ``nnan``/``ninf`` (the running max starts at ``-inf``)
  and no ``afn`` (``exp`` stays the libm one).
- numba's on-disk cache (``cache=True``) is checked against the kernel's own source file only, not
  against the modules it imports: after editing this module, delete ``kernels/cpu/__pycache__``
  (or the ``NUMBA_CACHE_DIR``) so the kernels are compiled again. Constants that only one kernel
  reads live in that kernel's module for the same reason.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _prefetch(typingctx, array, index):
    """Hint the CPU to fetch the cache line holding ``array.flat[index]`` (C-contiguous array)."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        # read, locality 1 (x86 prefetcht2: into L2, not L1), data cache. Measured on Zen 4 against
        # locality 3 (prefetcht0): 25-30% less time on the memory-bound shapes; 2 blocks ahead
        # beat 1 and tied with 3-4.
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 1), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
