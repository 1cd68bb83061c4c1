"""Row vectors held in registers for the Numba attention kernels (``kernels/cpu/decode.py``), and
the operations on them, written as LLVM IR because numba's loop vectorizer cannot be asked to
keep a whole group of rows in registers across a loop.

- ``Rows[G x D]``: ``G`` vectors of ``D`` lanes (LLVM ``[G x <D x float>]``). It is a value, not
  memory, so the optimizer keeps it in registers: a KV head's group of queries and its output
  accumulators stay there for a whole context (for SmolLM2, 3 x 64 lanes: 12 AVX-512 registers
  each). ``G`` and ``D`` are compile-time constants: a kernel receives them as a ``GroupShape``
  argument, which numba types as ``GroupShapeType(G, D)``.
- Arrays are C-contiguous and addressed by flat element index; 16-bit formats
  (``kernels/cpu/common.py``) are widened to float32 lanes as they are loaded.
- Keys: ``store_partial_dots`` multiplies one key row with each query of the group and sums the
  ``D / W`` chunks of ``W`` lanes (``partial_lanes``), stopping before the horizontal sum, the
  costly end of a short dot product; ``kernels/cpu/tiles.py`` finishes a tile of keys at once.
  Where the target has AVX-512 BF16 and both the query and the cache are bfloat16, the query
  stays in bfloat16 (``query_operand``) and ``vdpbf16ps`` multiplies the 16-bit pairs directly
  (products of two bfloat16 are exact in float32; sums are float32); elsewhere (AVX2, float32 or
  float16 data, a float32 query) keys are widened and multiplied with FMAs. The choice
  (``DOT_BF16``) follows the features numba compiles for (``NUMBA_CPU_NAME`` /
  ``NUMBA_CPU_FEATURES``, else the host), so the same source compiles on any x86 machine, and
  numba's cache keeps code per CPU.
- Values: ``add_weighted_row`` widens a value row once and adds it, weighted, to every
  accumulator of the group; ``scale_rows`` applies the softmax's rescale factors.
- Each K/V row read prefetches (``common.emit_prefetch``) the row the caller names: the cache's
  blocks are scattered, out of the hardware prefetchers' reach.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils, codegen, config
from numba.core.datamodel import models
from numba.extending import (
    NativeValue, intrinsic, overload_attribute, register_model, typeof_impl, unbox,
)
from numba.core.imputils import lower_constant

from kernels.cpu.common import emit_prefetch

TILE = 16  # keys per score tile: one float32 vector of AVX-512

I32, F32, I64 = ir.IntType(32), ir.FloatType(), ir.IntType(64)


class Rows(types.Type):
    """``rows`` vectors of ``width`` lanes: float32, or the bfloat16 bits as loaded (``bits``)."""

    def __init__(self, rows: int, width: int, bits: bool = False):
        self.rows, self.width, self.bits = rows, width, bits
        super().__init__(name=f"Rows[{rows}x{width}{' bf16' if bits else ''}]")


@register_model(Rows)
class _RowsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        lane = ir.IntType(16) if fe_type.bits else F32
        row = ir.VectorType(lane, fe_type.width)
        super().__init__(dmm, fe_type, ir.ArrayType(row, fe_type.rows))


class GroupShapeType(types.Type):
    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        super().__init__(name=f"GroupShape[{rows}x{width}]")


class GroupShape:
    """What a kernel specializes for: query heads per KV head (``rows``) and the head dimension
    (``width``). Passed to a kernel as an argument, it reaches numba as a type that carries both
    numbers (``GroupShapeType``), so that they are compile-time constants in there."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = int(rows), int(width)
        self.numba_type = GroupShapeType(self.rows, self.width)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(rows: int, width: int) -> "GroupShape":
        """The one instance for (rows, width): made once instead of at every call (1.4 us)."""
        return GroupShape(rows, width)


@typeof_impl.register(GroupShape)
def _typeof_group_shape(value, context):
    return value.numba_type


@register_model(GroupShapeType)
class _GroupShapeModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, [])


@unbox(GroupShapeType)
def _unbox_group_shape(typ, obj, c):
    return NativeValue(c.context.get_constant_null(typ))


@lower_constant(GroupShapeType)
def _lower_group_shape(context, builder, typ, value):
    # a GroupShape read from a module's globals inside a kernel: a constant of its type, as unboxed
    return context.get_constant_null(typ)


@overload_attribute(GroupShapeType, "rows")
def _group_shape_rows(shape):
    rows = shape.rows
    return lambda shape: rows


@overload_attribute(GroupShapeType, "width")
def _group_shape_width(shape):
    width = shape.width
    return lambda shape: width


def target_features() -> set[str]:
    """The CPU features numba compiles for (its ``NUMBA_CPU_FEATURES``, else the host's)."""
    flat = config.CPU_FEATURES
    if flat is None:
        flat = codegen.get_host_cpu_features()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


DOT_BF16 = "avx512bf16" in target_features()  # vdpbf16ps for bfloat16 x bfloat16 dot products


def partial_lanes(width: int) -> int:
    """Lanes of the partial dot products of rows of ``width`` lanes: the largest power of two up to
    ``TILE`` that divides ``width``."""
    lanes = TILE
    while width % lanes:
        lanes //= 2
    return lanes


# LLVM IR helpers, shared with kernels/cpu/tiles.py

def c_array(ty, dtype=None) -> bool:
    return (isinstance(ty, types.Array) and ty.layout == "C"
            and (dtype is None or ty.dtype == dtype))


def element_ptr(context, builder, aty, array, index, index_ty=types.intp):
    """Pointer to ``array``'s element at flat ``index``."""
    data = context.make_array(aty)(context, builder, array).data
    return builder.gep(data, [context.cast(builder, index, index_ty, types.intp)])


def vector_at(builder, base, offset, vec):
    """``base`` (an element pointer) advanced by ``offset`` elements, as a pointer to ``vec``."""
    return builder.bitcast(builder.gep(base, [ir.Constant(I64, offset)]), vec.as_pointer())


def call(builder, name, ret, args):
    fn_type = ir.FunctionType(ret, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fn_type, name)
    return builder.call(fn, args)


def fma(builder, a, b, c):
    return call(builder, f"llvm.fmuladd.v{a.type.count}f32", a.type, [a, b, c])


def lanes_of(builder, vec, start, lanes):
    """Lanes ``[start, start + lanes)`` of ``vec``."""
    if start == 0 and lanes == vec.type.count:
        return vec
    mask = ir.Constant(ir.VectorType(I32, lanes), list(range(start, start + lanes)))
    return builder.shuffle_vector(vec, vec, mask)


def splat(builder, scalar, lanes):
    vec = ir.VectorType(scalar.type, lanes)
    one = builder.insert_element(ir.Constant(vec, None), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def _load(context, builder, aty, array, index, index_ty, lanes):
    """``lanes`` elements of ``array`` from flat ``index``, as stored."""
    vec = ir.VectorType(context.get_data_type(aty.dtype), lanes)
    ptr = element_ptr(context, builder, aty, array, index, index_ty)
    ptr = builder.bitcast(ptr, vec.as_pointer())
    return builder.load(ptr, align=aty.dtype.bitwidth // 8)


def _widen(builder, dtype, vec):
    """A vector of ``dtype`` values (float32, bfloat16 bits, float16 bits) as float32 lanes."""
    lanes = vec.type.count
    if dtype == types.uint16:  # bfloat16: the high half of a float32
        wide = builder.zext(vec, ir.VectorType(I32, lanes))
        wide = builder.shl(wide, ir.Constant(ir.VectorType(I32, lanes), [16] * lanes))
        return builder.bitcast(wide, ir.VectorType(F32, lanes))
    if dtype == types.int16:
        return builder.fpext(builder.bitcast(vec, ir.VectorType(ir.HalfType(), lanes)),
                             ir.VectorType(F32, lanes))
    return vec


def _prefetch_row(context, builder, aty, array, index, index_ty, lanes):
    """Prefetch the cache lines of ``lanes`` elements of ``array`` from flat ``index``."""
    base = builder.bitcast(element_ptr(context, builder, aty, array, index, index_ty),
                           ir.IntType(8).as_pointer())
    for offset in range(0, lanes * aty.dtype.bitwidth // 8, 64):
        emit_prefetch(builder, builder.gep(base, [ir.Constant(I64, offset)]))


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite lacks (the IR is text: the name is all it takes)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


def _dot_bf16(builder, acc, a, b):
    """``acc`` (16 float32 lanes) + the products of ``a`` and ``b`` (32 bfloat16 bits each), lane
    ``i`` adding those of elements ``2i`` and ``2i + 1`` (``vdpbf16ps``)."""
    bf = ir.VectorType(_BFloat(), 32)
    return call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", acc.type,
                [acc, builder.bitcast(a, bf), builder.bitcast(b, bf)])


def _rows_value(context, builder, result, flat):
    """A ``Rows`` value from one flat vector of ``rows * width`` lanes."""
    value = ir.Constant(context.get_value_type(result), None)
    for r in range(result.rows):
        row = lanes_of(builder, flat, r * result.width, result.width)
        value = builder.insert_value(value, row, r)
    return value


@intrinsic
def query_operand(typingctx, query, start, shape, cache):
    """The group's queries (``shape.rows * shape.width`` elements of ``query`` from flat index
    ``start``) as ``Rows`` in the form the dot products with ``cache``'s keys take: bfloat16 bits
    for ``vdpbf16ps`` where it applies (``DOT_BF16``, both bfloat16, width a multiple of 32), else
    widened to float32."""
    if not (c_array(query) and c_array(cache) and isinstance(start, types.Integer)
            and isinstance(shape, GroupShapeType)):
        return None
    bits = (DOT_BF16 and query.dtype == types.uint16 and cache.dtype == types.uint16
            and shape.width % 32 == 0)
    result = Rows(shape.rows, shape.width, bits)

    def codegen(context, builder, sig, args):
        flat = _load(context, builder, query, args[0], args[1], start, shape.rows * shape.width)
        if not bits:
            flat = _widen(builder, query.dtype, flat)
        return _rows_value(context, builder, result, flat)

    return result(query, start, shape, cache), codegen


@intrinsic
def zero_rows(typingctx, shape):
    """``Rows[shape.rows x shape.width]`` of zeros."""
    if not isinstance(shape, GroupShapeType):
        return None
    result = Rows(shape.rows, shape.width)

    def codegen(context, builder, sig, args):
        return ir.Constant(context.get_value_type(result), None)

    return result(shape), codegen


@intrinsic
def store_rows(typingctx, array, start, value):
    """Store ``value``'s rows one after the other into a float32 ``array`` from flat ``start``."""
    if not (c_array(array, types.float32) and isinstance(value, Rows) and not value.bits
            and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        base = element_ptr(context, builder, array, args[0], args[1], start)
        vec = ir.VectorType(F32, value.width)
        for r in range(value.rows):
            ptr = vector_at(builder, base, r * value.width, vec)
            builder.store(builder.extract_value(args[2], r), ptr, align=4)
        return context.get_dummy_value()

    return types.void(array, start, value), codegen


@intrinsic
def store_partial_dots(typingctx, partial, t, query, cache, row_start, prefetch_start):
    """For each query row ``g`` of ``query`` (``query_operand``): ``partial[(g * TILE + t) * W :
    ... + W]`` = the ``W``-lane partial sums (``partial_lanes``) of its products with the cache's
    row at flat ``row_start`` (``D`` elements); ``partial``: float32 ``[G, TILE, W]``. Also
    prefetches the cache's row at ``prefetch_start``."""
    if not (c_array(partial, types.float32) and isinstance(query, Rows) and c_array(cache)
            and all(isinstance(i, types.Integer) for i in (t, row_start, prefetch_start))):
        return None
    d, lanes = query.width, partial_lanes(query.width)

    def codegen(context, builder, sig, args):
        part_val, t_val, q_val, cache_val, row_val, ahead_val = args
        _prefetch_row(context, builder, cache, cache_val, ahead_val, prefetch_start, d)
        key = _load(context, builder, cache, cache_val, row_val, row_start, d)
        if not query.bits:
            key = _widen(builder, cache.dtype, key)
        base = element_ptr(context, builder, partial, part_val,
                           builder.mul(context.cast(builder, t_val, t, types.intp),
                                       ir.Constant(I64, lanes)))
        vec = ir.VectorType(F32, lanes)
        for g in range(query.rows):
            q = builder.extract_value(q_val, g)
            if query.bits:  # 16 lanes, each the sum of a pair of products, per 32 elements
                acc = ir.Constant(vec, None)
                for c in range(0, d, 32):
                    acc = _dot_bf16(builder, acc, lanes_of(builder, q, c, 32),
                                    lanes_of(builder, key, c, 32))
            else:
                acc = builder.fmul(lanes_of(builder, q, 0, lanes), lanes_of(builder, key, 0, lanes))
                for c in range(lanes, d, lanes):
                    acc = fma(builder, lanes_of(builder, q, c, lanes),
                              lanes_of(builder, key, c, lanes), acc)
            builder.store(acc, vector_at(builder, base, g * TILE * lanes, vec), align=4)
        return context.get_dummy_value()

    return types.void(partial, t, query, cache, row_start, prefetch_start), codegen


@intrinsic
def add_weighted_row(typingctx, acc, weights, t, cache, row_start, prefetch_start):
    """``acc[g] + weights[g * TILE + t] * cache[row_start : row_start + D]`` for every row ``g``
    (the cache row widened once for the whole group). Also prefetches the cache's row at
    ``prefetch_start``."""
    if not (isinstance(acc, Rows) and not acc.bits and c_array(weights, types.float32)
            and c_array(cache)
            and all(isinstance(i, types.Integer) for i in (t, row_start, prefetch_start))):
        return None

    def codegen(context, builder, sig, args):
        acc_val, w_val, t_val, cache_val, row_val, ahead_val = args
        _prefetch_row(context, builder, cache, cache_val, ahead_val, prefetch_start, acc.width)
        value = _widen(builder, cache.dtype,
                       _load(context, builder, cache, cache_val, row_val, row_start, acc.width))
        base = element_ptr(context, builder, weights, w_val, t_val, t)
        for g in range(acc.rows):
            w = builder.load(builder.gep(base, [ir.Constant(I64, g * TILE)]), align=4)
            row = fma(builder, splat(builder, w, acc.width), value,
                      builder.extract_value(acc_val, g))
            acc_val = builder.insert_value(acc_val, row, g)
        return acc_val

    return acc(acc, weights, t, cache, row_start, prefetch_start), codegen


@intrinsic
def scale_rows(typingctx, acc, factors):
    """``acc[g] * factors[g]`` for every row ``g`` (``factors``: float32 ``[G]``)."""
    if not (isinstance(acc, Rows) and not acc.bits and c_array(factors, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        acc_val, f_val = args
        base = element_ptr(context, builder, factors, f_val, ir.Constant(I64, 0))
        for g in range(acc.rows):
            f = builder.load(builder.gep(base, [ir.Constant(I64, g)]), align=4)
            row = builder.fmul(builder.extract_value(acc_val, g), splat(builder, f, acc.width))
            acc_val = builder.insert_value(acc_val, row, g)
        return acc_val

    return acc(acc, factors), codegen
