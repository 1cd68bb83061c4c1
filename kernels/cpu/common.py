"""What the Numba CPU kernels share: the 16-bit storage formats, the prefetch intrinsic, the
``exp`` of the softmax, the fastmath flags, and their threads (``sync_threads``: numba follows
torch's count; ``by_rows``: a row kernel runs serially or in parallel by its number of rows).

Storage formats. Caches, queries, outputs and new keys/values may be float32, bfloat16 or
float16; the kernels load 16-bit values, widen them to float32 in registers and accumulate in
float32. numpy has no bfloat16 and numba has no float16 on CPU, so the 16-bit formats travel as
their raw bits in integer arrays whose dtype names the format (``BITS_DTYPES``):

- ``uint16``: bfloat16 bits. Widening is ``bits << 16`` reinterpreted as float32 (exact);
  narrowing rounds to nearest even exactly like torch's ``Tensor.to(torch.bfloat16)`` (a NaN
  becomes ``0xFFFF``, as torch 2.13's CPU conversion makes it).
- ``int16``: float16 bits. Widening and narrowing are LLVM's ``fpext`` / ``fptrunc`` (F16C's
  ``vcvtph2ps`` / ``vcvtps2ph`` on x86, round to nearest even, as torch).
- ``float32``: itself.

``widen(x)`` gives a float32; ``narrow_like(array, x)`` gives ``x`` in ``array``'s format (a plain
copy when the formats are equal, so moving 16-bit values never changes a bit). The attention
kernels widen K/V rows in registers as they load them (``kernels/cpu/vectors.py``; a separate
pass widening each block into float32 scratch first had measured 1.3x to 1.8x slower on bf16
caches), or multiply bfloat16 pairs directly where the CPU has AVX-512 BF16.

Flags and cache:

- ``fastmath`` is limited to ``reassoc``/``contract`` (plus ``nsz``/``arcp``) so that the loops
  over ``head_dim`` vectorize; no ``nnan``/``ninf`` (a running max starts at ``-inf``) and no
  ``afn``. The softmax's ``exp`` is ``exp_nonpositive`` (plain arithmetic, within 3 ulp of
  libm's), which ``kernels/cpu/tiles.py`` computes on vectors with the same polynomial.
- numba's on-disk cache (``cache=True``) is checked against the kernel's own source file only, not
  against the modules it imports: after editing this module (or ``vectors.py`` / ``tiles.py``,
  whose IR the attention kernels inline), delete ``kernels/cpu/__pycache__`` (or the
  ``NUMBA_CACHE_DIR``) so the kernels are compiled again. Constants that only one kernel reads
  live in that kernel's module for the same reason.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba import njit
from numba.extending import intrinsic, overload

# torch dtype -> the numpy dtype the kernels see it as (16-bit formats as raw bits)
BITS_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.int16}
_VIEW_AS = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}
_FORMATS = (types.float32, types.uint16, types.int16)
_NP_FORMATS = (np.dtype(np.float32), np.dtype(np.uint16), np.dtype(np.int16))
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


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


def by_rows(num_rows: int, parallel_from_rows: int, serial, parallel, *args) -> None:
    """Run a kernel whose rows are independent: ``serial(*args)`` below ``parallel_from_rows``
    rows (waking the other threads would cost more than the work), ``parallel(*args)`` from there,
    on numba threads matched to torch's (``sync_threads``); nothing for no rows."""
    if num_rows >= parallel_from_rows:
        sync_threads()
        parallel(*args)
    elif num_rows:
        serial(*args)


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU tensor in the kernels' format (16-bit types as bits)."""
    view_as = _VIEW_AS.get(tensor.dtype)
    t = tensor if view_as is None else tensor.view(view_as)
    return t.detach().numpy() if t.requires_grad else t.numpy()  # detach only where needed: 0.2 us


def as_bits(array: np.ndarray) -> np.ndarray:
    """A numpy array in a format the kernels take: numpy float16 viewed as its bits (``int16``);
    float32 and bits arrays unchanged. Anything else raises TypeError."""
    if array.dtype == np.float16:
        return array.view(np.int16)
    if array.dtype not in _NP_FORMATS:
        raise TypeError("the kernels take float32, float16, or bfloat16/float16 bits "
                        f"(uint16/int16) arrays; got {array.dtype}")
    return array


def as_input(array: np.ndarray, cache: np.ndarray) -> np.ndarray:
    """A C-contiguous query/key/value in the cache's format or float32 (float64 is converted to
    float32, numpy float16 viewed as bits; the kernels compile once per format pair)."""
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    array = as_bits(array)
    if array.dtype != cache.dtype and array.dtype != np.float32:
        raise TypeError(f"inputs must be float32 or the cache's format {cache.dtype}, "
                        f"got {array.dtype}")
    return np.ascontiguousarray(array)


def output_target(out: np.ndarray, cache: np.ndarray) -> np.ndarray:
    """The array a kernel writes for ``out``: ``out`` itself when it is C-contiguous in float32 or
    the cache's format, else a temporary that the caller copies back with ``out[...] = target``
    (bit for bit in the cache's format, by value from float32 into other float types)."""
    if out.flags.c_contiguous and out.dtype in (np.float32, cache.dtype):
        return out
    if out.dtype == cache.dtype:
        return np.empty(out.shape, out.dtype)
    if out.dtype.kind != "f":
        raise TypeError(f"out must be float32 or the cache's format {cache.dtype}, got {out.dtype}")
    return np.empty(out.shape, np.float32)


def _to_f32(builder, ty, value):
    if ty == types.uint16:  # bfloat16: the high half of a float32
        return builder.bitcast(builder.shl(builder.zext(value, _I32), ir.Constant(_I32, 16)), _F32)
    if ty == types.int16:
        return builder.fpext(builder.bitcast(value, ir.HalfType()), _F32)
    return value


def _from_f32(builder, ty, value):
    if ty == types.uint16:  # round to nearest even, NaN -> 0xFFFF: torch's CPU conversion
        bits = builder.bitcast(value, _I32)
        lsb = builder.and_(builder.lshr(bits, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        biased = builder.add(bits, builder.add(lsb, ir.Constant(_I32, 0x7FFF)))
        rounded = builder.lshr(biased, ir.Constant(_I32, 16))
        is_nan = builder.fcmp_unordered("uno", value, value)
        return builder.trunc(builder.select(is_nan, ir.Constant(_I32, 0xFFFF), rounded), _I16)
    if ty == types.int16:
        return builder.bitcast(builder.fptrunc(value, ir.HalfType()), _I16)
    return value


@intrinsic
def widen(typingctx, x):
    """``x`` (float32, or bfloat16/float16 bits) as a float32."""
    if x not in _FORMATS:
        return None

    def codegen(context, builder, signature, args):
        return _to_f32(builder, signature.args[0], args[0])

    return types.float32(x), codegen


@intrinsic
def narrow_like(typingctx, array, x):
    """``x`` (any storage format) converted to the storage format of ``array``'s elements."""
    if not isinstance(array, types.Array) or array.dtype not in _FORMATS or x not in _FORMATS:
        return None
    target = array.dtype

    def codegen(context, builder, signature, args):
        source = signature.args[1]
        if source == target:
            return args[1]
        return _from_f32(builder, target, _to_f32(builder, source, args[1]))

    return target(array, x), codegen


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)

    return types.float32(bits), codegen


_EXP_MIN = np.float32(-87.33654)  # ln(2**-126): below it the result would be subnormal


@njit(fastmath=_FASTMATH, cache=True, nogil=True, inline="always")
def exp_nonpositive(x):
    """``exp(x)`` in float32 for ``x <= 0`` (a softmax's scores minus their max), within 3 ulp of
    libm's; 0 below ``_EXP_MIN`` and for ``-inf``. Plain arithmetic (Cephes ``expf``: 2**n times a
    degree-6 polynomial), so that a loop of it vectorizes, which a libm call does not: it took
    15% off a decode step's attention."""
    inside = x >= _EXP_MIN
    x = x if inside else np.float32(0.0)
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _f32_from_bits(np.int32((np.int32(n) + 127) << 23))
    return y if inside else np.float32(0.0)


@njit(fastmath=_FASTMATH, cache=True, nogil=True, inline="always")
def tanh_f32(x):
    """``tanh(x)`` in float32 by Eigen's rational approximation (odd degree-13 numerator over an
    even degree-6 denominator, ``x`` clamped to +-7.905, where float32's tanh is +-1; within a few
    ulp of libm's): plain arithmetic with one division, so that a loop of it vectorizes, which
    libm's ``tanh`` did not (it made Gemma 2's soft-capped decode attention 2.2x the uncapped)."""
    x = min(max(x, np.float32(-7.90531110763549805)), np.float32(7.90531110763549805))
    x2 = x * x
    p = np.float32(-2.76076847742355e-16)
    p = p * x2 + np.float32(2.00018790482477e-13)
    p = p * x2 + np.float32(-8.60467152213735e-11)
    p = p * x2 + np.float32(5.12229709037114e-08)
    p = p * x2 + np.float32(1.48572235717979e-05)
    p = p * x2 + np.float32(6.37261928875436e-04)
    p = p * x2 + np.float32(4.89352455891786e-03)
    q = np.float32(1.19825839466702e-06)
    q = q * x2 + np.float32(1.18534705686654e-04)
    q = q * x2 + np.float32(2.26843463243900e-03)
    q = q * x2 + np.float32(4.89352518554385e-03)
    return x * p / q


def line_elems(array):
    """Elements of ``array`` per 64-byte cache line, a compile-time constant (numba only)."""
    raise NotImplementedError("line_elems runs inside numba kernels only")


@overload(line_elems)
def _line_elems(array):
    elems = 64 * 8 // array.dtype.bitwidth
    return lambda array: elems


def emit_prefetch(builder, pointer):
    """LLVM IR: hint the CPU to fetch the cache line holding ``pointer`` (an ``i8*``)."""
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]),
        "llvm.prefetch.p0")
    # read, locality 1 (x86 prefetcht2: into L2, not L1), data cache. Measured on Zen 4 against
    # locality 3 (prefetcht0): 25-30% less time on the memory-bound shapes; 2 blocks ahead
    # beat 1 and tied with 3-4.
    builder.call(fn, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 1), ir.Constant(i32, 1)])


@intrinsic
def _prefetch(typingctx, array, index):
    """Hint the CPU to fetch the cache line holding ``array.flat[index]`` (C-contiguous array)."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        emit_prefetch(builder, builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer()))
        return context.get_dummy_value()

    return types.void(array, index), codegen
