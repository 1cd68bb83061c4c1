"""Row vectors held in registers for the Numba attention kernels: what the loop vectorizer cannot
be asked for.

A ``Rows[G x D]`` value is ``G`` float32 vectors of ``D`` lanes (LLVM ``[G x <D x float>]``: a
value, not memory, so the optimizer keeps it in registers across a loop: the group's queries and
its output accumulators live there for a whole context). ``G`` and ``D`` are compile-time
constants: the kernels pass them through ``numba.literally``. Array arguments are C-contiguous and
addressed by a flat element index; 16-bit formats (``kernels/cpu/common.py``) are widened to
float32 lanes as they are loaded.

The score of one key for one query is a dot product over ``D`` lanes, which ends in a horizontal
sum, the costly part of a short dot product. ``store_partial_dots`` stops before it: it sums the
``D / W`` chunks of ``W`` lanes (``partial_lanes``) and stores that ``W``-lane vector per query row;
``tile_scores`` then finishes ``TILE`` keys at once with a transposing tree (pairs of vectors
shuffled and added: 15 shuffle pairs and adds for 16 keys instead of 4 per key), giving a
``TILE``-lane vector of scores.

Where the target has AVX-512 BF16 (``vdpbf16ps``) and both the query and the cache are bfloat16,
the query operand stays in bfloat16 and the dot products run on the 16-bit values (products of
two bfloat16 are exact in float32, sums in float32); elsewhere (AVX2, float32 or float16 data) the
keys are widened and multiplied in float32. The choice is made at compile time from the features
numba compiles for (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` or the host), so the same source
compiles on every x86 machine.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel import models
from kernels.cpu.common import _EXP_MIN, emit_prefetch
from numba.extending import (
    NativeValue, intrinsic, overload_attribute, register_model, typeof_impl, unbox,
)

TILE = 16  # keys per score tile (one float32 vector of AVX-512)

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no such type; the IR is text, so its name is enough)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


class Rows(types.Type):
    """``rows`` vectors of ``width`` lanes: float32, or bfloat16 bits (``bits``) as loaded."""

    def __init__(self, rows: int, width: int, bits: bool = False):
        self.rows, self.width, self.bits = rows, width, bits
        super().__init__(name=f"Rows[{rows}x{width}{'xbf16' if bits else ''}]")


@register_model(Rows)
class _RowsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        lane = _I16 if fe_type.bits else _F32
        super().__init__(dmm, fe_type, ir.ArrayType(ir.VectorType(lane, fe_type.width), fe_type.rows))


class GroupShape:
    """What a kernel specializes for: query rows per KV head (``rows``) and lanes per row
    (``width``, the head dimension). Passed to a kernel as an argument, it reaches numba as a type
    (``GroupShapeType``) that carries both numbers, so they are compile-time constants in there."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = int(rows), int(width)


class GroupShapeType(types.Type):
    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        super().__init__(name=f"GroupShape[{rows}x{width}]")


@typeof_impl.register(GroupShape)
def _typeof_group_shape(value, context):
    return GroupShapeType(value.rows, value.width)


@register_model(GroupShapeType)
class _GroupShapeModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, [])


@unbox(GroupShapeType)
def _unbox_group_shape(typ, obj, c):
    return NativeValue(c.context.get_constant_null(typ))


@overload_attribute(GroupShapeType, "rows")
def _group_shape_rows(shape):
    rows = shape.rows
    return lambda shape: rows


@overload_attribute(GroupShapeType, "width")
def _group_shape_width(shape):
    width = shape.width
    return lambda shape: width


def _target_features() -> set[str]:
    from numba.core import codegen, config

    flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


DOT_BF16 = "avx512bf16" in _target_features()  # vdpbf16ps for bfloat16 x bfloat16 dot products


def partial_lanes(width: int) -> int:
    """Lanes of the partial dot products of rows of ``width`` lanes: the largest power of two up to
    ``TILE`` dividing ``width``."""
    lanes = TILE
    while width % lanes:
        lanes //= 2
    return lanes


def _c_array(ty):
    return isinstance(ty, types.Array) and ty.layout == "C"


def _ptr(context, builder, aty, array, index, index_ty):
    data = context.make_array(aty)(context, builder, array).data
    return builder.gep(data, [context.cast(builder, index, index_ty, types.intp)])


def _load(context, builder, aty, array, index, index_ty, lanes):
    """``lanes`` elements of ``array`` from flat ``index``, as loaded (no conversion)."""
    elem = context.get_data_type(aty.dtype)
    vec = ir.VectorType(elem, lanes)
    ptr = builder.bitcast(_ptr(context, builder, aty, array, index, index_ty), vec.as_pointer())
    return builder.load(ptr, align=aty.dtype.bitwidth // 8)


def _widen(builder, dtype, vec):
    """A vector of ``dtype`` values (float32, bf16 bits, fp16 bits) as float32 lanes."""
    lanes = vec.type.count
    if dtype == types.uint16:
        wide = builder.zext(vec, ir.VectorType(_I32, lanes))
        wide = builder.shl(wide, ir.Constant(ir.VectorType(_I32, lanes), [16] * lanes))
        return builder.bitcast(wide, ir.VectorType(_F32, lanes))
    if dtype == types.int16:
        return builder.fpext(builder.bitcast(vec, ir.VectorType(ir.HalfType(), lanes)),
                             ir.VectorType(_F32, lanes))
    return vec


def _slice(builder, vec, start, lanes):
    if start == 0 and lanes == vec.type.count:
        return vec
    mask = ir.Constant(ir.VectorType(_I32, lanes), list(range(start, start + lanes)))
    return builder.shuffle_vector(vec, vec, mask)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fmuladd.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _dot_bf16(builder, acc, a, b):
    """``acc`` (16 float32) + the pairwise products of ``a`` and ``b`` (32 bfloat16 bits each)."""
    bf = ir.VectorType(_BFloat(), 32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(acc.type, [acc.type, bf, bf]),
        "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, builder.bitcast(a, bf), builder.bitcast(b, bf)])


def _splat(builder, scalar, lanes):
    vec = ir.VectorType(scalar.type, lanes)
    one = builder.insert_element(ir.Constant(vec, None), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))


def _dot_operand(query, cache, width):
    return (DOT_BF16 and query.dtype == types.uint16 and cache.dtype == types.uint16
            and width % 32 == 0)


def _prefetch_row(context, builder, aty, array, index, index_ty, lanes):
    """Prefetch (into L2, as ``common._prefetch``) the cache lines of ``lanes`` elements of
    ``array`` from flat ``index``."""
    base = builder.bitcast(_ptr(context, builder, aty, array, index, index_ty), ir.IntType(8).as_pointer())
    for offset in range(0, lanes * aty.dtype.bitwidth // 8, 64):
        emit_prefetch(builder, builder.gep(base, [ir.Constant(ir.IntType(64), offset)]))


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


def _reduce(builder, vec, combine):
    """``combine`` folded over the lanes of ``vec`` (a power of two of them), as a tree of halves."""
    while vec.type.count > 1:
        half = vec.type.count // 2
        vec = combine(_slice(builder, vec, 0, half), _slice(builder, vec, half, half))
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _exp_nonpositive(builder, x):
    """``common.exp_nonpositive`` on a float32 vector: the same Cephes polynomial, lane by lane."""
    vec = x.type
    lanes = vec.count

    def const(value):
        return ir.Constant(vec, [float(np.float32(value))] * lanes)

    def fma(a, b, c):
        return _call(builder, f"llvm.fmuladd.v{lanes}f32", vec, [a, b, c])

    inside = builder.fcmp_ordered(">=", x, const(_EXP_MIN))
    x = builder.select(inside, x, const(0.0))
    n = _call(builder, f"llvm.floor.v{lanes}f32", vec, [fma(x, const(1.4426950408889634), const(0.5))])
    neg_n = builder.fneg(n)
    r = fma(neg_n, const(-2.12194440e-4), fma(neg_n, const(0.693359375), x))
    p = const(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma(p, r, const(c))
    y = builder.fadd(fma(builder.fmul(p, r), r, r), const(1.0))
    ivec = ir.VectorType(_I32, lanes)
    scale = builder.shl(builder.add(builder.fptosi(n, ivec), ir.Constant(ivec, [127] * lanes)),
                        ir.Constant(ivec, [23] * lanes))
    y = builder.fmul(y, builder.bitcast(scale, vec))
    return builder.select(inside, y, const(0.0))


@intrinsic
def query_operand(typingctx, query, start, shape, cache):
    """The group's queries (``shape.rows * shape.width`` elements of ``query`` from flat index
    ``start``) as ``Rows`` in the form the dot products with ``cache``'s keys take: bfloat16 bits
    for ``vdpbf16ps`` where it applies, else widened to float32."""
    if not (_c_array(query) and _c_array(cache) and isinstance(start, types.Integer)
            and isinstance(shape, GroupShapeType)):
        return None
    g, d = shape.rows, shape.width
    bits = _dot_operand(query, cache, d)
    result = Rows(g, d, bits)

    def codegen(context, builder, sig, args):
        flat = _load(context, builder, query, args[0], args[1], start, g * d)
        if not bits:
            flat = _widen(builder, query.dtype, flat)
        value = ir.Constant(context.get_value_type(result), None)
        for r in range(g):
            value = builder.insert_value(value, _slice(builder, flat, r * d, d), r)
        return value

    return result(query, start, shape, cache), codegen


@intrinsic
def load_rows(typingctx, array, start, shape):
    """``Rows[shape.rows x shape.width]`` from consecutive elements of a float32 ``array`` from flat
    index ``start`` (what ``store_rows`` stored)."""
    if not (_c_array(array) and array.dtype == types.float32 and isinstance(start, types.Integer)
            and isinstance(shape, GroupShapeType)):
        return None
    result = Rows(shape.rows, shape.width)

    def codegen(context, builder, sig, args):
        flat = _load(context, builder, array, args[0], args[1], start, shape.rows * shape.width)
        value = ir.Constant(context.get_value_type(result), None)
        for r in range(shape.rows):
            value = builder.insert_value(value, _slice(builder, flat, r * shape.width, shape.width), r)
        return value

    return result(array, start, shape), codegen


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
    """Store ``value``'s rows, one after the other, into a float32 ``array`` from flat ``start``."""
    if not (_c_array(array) and array.dtype == types.float32 and isinstance(value, Rows)
            and not value.bits and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        base = _ptr(context, builder, array, args[0], args[1], start)
        vec = ir.VectorType(_F32, value.width)
        for r in range(value.rows):
            ptr = builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), r * value.width)]),
                                  vec.as_pointer())
            builder.store(builder.extract_value(args[2], r), ptr, align=4)
        return context.get_dummy_value()

    return types.void(array, start, value), codegen


@intrinsic
def store_partial_dots(typingctx, partial, t, query, cache, row_start, prefetch_start):
    """For each query row ``g``: ``partial[(g * TILE + t) * W : ... + W]`` = the ``W``-lane partial
    sums (``partial_lanes``) of the products of ``query[g]`` and the cache's row at flat
    ``row_start`` (``D`` elements). ``partial``: float32 ``[G, TILE, W]``. Also prefetches the
    cache's row at ``prefetch_start``."""
    if not (_c_array(partial) and partial.dtype == types.float32 and isinstance(query, Rows)
            and _c_array(cache) and isinstance(t, types.Integer)
            and isinstance(row_start, types.Integer) and isinstance(prefetch_start, types.Integer)):
        return None
    g_rows, d = query.rows, query.width
    lanes = 16 if query.bits else partial_lanes(d)

    def codegen(context, builder, sig, args):
        _, t_val, q_val, _, row_val, ahead_val = args
        _prefetch_row(context, builder, cache, args[3], ahead_val, prefetch_start, d)
        key = _load(context, builder, cache, args[3], row_val, row_start, d)
        if not query.bits:
            key = _widen(builder, cache.dtype, key)
        t64 = context.cast(builder, t_val, t, types.intp)
        base = _ptr(context, builder, partial, args[0], ir.Constant(ir.IntType(64), 0), types.intp)
        vec = ir.VectorType(_F32, lanes)
        for g in range(g_rows):
            q = builder.extract_value(q_val, g)
            if query.bits:
                acc = ir.Constant(vec, None)
                for c in range(0, d, 32):
                    acc = _dot_bf16(builder, acc, _slice(builder, q, c, 32),
                                    _slice(builder, key, c, 32))
            else:
                acc = builder.fmul(_slice(builder, q, 0, lanes), _slice(builder, key, 0, lanes))
                for c in range(lanes, d, lanes):
                    acc = _fma(builder, _slice(builder, q, c, lanes), _slice(builder, key, c, lanes),
                               acc)
            index = builder.mul(builder.add(ir.Constant(ir.IntType(64), g * TILE), t64),
                                ir.Constant(ir.IntType(64), lanes))
            ptr = builder.bitcast(builder.gep(base, [index]), vec.as_pointer())
            builder.store(acc, ptr, align=4)
        return context.get_dummy_value()

    return types.void(partial, t, query, cache, row_start, prefetch_start), codegen


def _tree_sums(builder, vectors):
    """``TILE`` vectors of ``W`` lanes -> one vector whose lane ``i`` is the sum of vector ``i``'s
    lanes. Each step pairs neighbours (A, B), each holding ``k`` keys of ``w`` lanes, into one of
    ``2k`` keys of ``w / 2`` lanes: [first halves of A's keys, of B's] + [second halves]."""
    w = vectors[0].type.count
    while w > 1 and len(vectors) > 1:
        lanes = vectors[0].type.count
        keys = lanes // w
        half = w // 2
        paired = []
        for a, b in zip(vectors[0::2], vectors[1::2]):
            lo = [k * w + i for k in range(keys) for i in range(half)]
            hi = [k * w + half + i for k in range(keys) for i in range(half)]
            mask_lo = ir.Constant(ir.VectorType(_I32, lanes), lo + [lanes + j for j in lo])
            mask_hi = ir.Constant(ir.VectorType(_I32, lanes), hi + [lanes + j for j in hi])
            paired.append(builder.fadd(builder.shuffle_vector(a, b, mask_lo),
                                       builder.shuffle_vector(a, b, mask_hi)))
        vectors = paired
        w = half
    while w > 1:  # one vector of several keys left: halve each key's lanes
        lanes = vectors[0].type.count
        keys = lanes // w
        half = w // 2
        lo = [k * w + i for k in range(keys) for i in range(half)]
        hi = [k * w + half + i for k in range(keys) for i in range(half)]
        v = vectors[0]
        vectors = [builder.fadd(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(lo)), lo)),
                                builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(hi)), hi)))]
        w = half
    while len(vectors) > 1:  # single-lane keys in several vectors: concatenate
        lanes = vectors[0].type.count
        mask = ir.Constant(ir.VectorType(_I32, 2 * lanes), list(range(2 * lanes)))
        vectors = [builder.shuffle_vector(a, b, mask) for a, b in zip(vectors[0::2], vectors[1::2])]
    return vectors[0]


@intrinsic
def tile_scores(typingctx, scores, partial, query):
    """``scores[g * TILE + t]`` = the sum of the partial dot products ``partial[g, t, :]`` for every
    query row ``g`` of ``query`` (its type gives the shape) and key ``t`` of the tile."""
    if not (_c_array(scores) and scores.dtype == types.float32 and _c_array(partial)
            and partial.dtype == types.float32 and isinstance(query, Rows)):
        return None
    lanes = 16 if query.bits else partial_lanes(query.width)

    def codegen(context, builder, sig, args):
        src = _ptr(context, builder, partial, args[1], ir.Constant(ir.IntType(64), 0), types.intp)
        dst = _ptr(context, builder, scores, args[0], ir.Constant(ir.IntType(64), 0), types.intp)
        vec = ir.VectorType(_F32, lanes)
        out = ir.VectorType(_F32, TILE)
        for g in range(query.rows):
            rows = []
            for t in range(TILE):
                ptr = builder.gep(src, [ir.Constant(ir.IntType(64), (g * TILE + t) * lanes)])
                rows.append(builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4))
            ptr = builder.gep(dst, [ir.Constant(ir.IntType(64), g * TILE)])
            builder.store(_tree_sums(builder, rows), builder.bitcast(ptr, out.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(scores, partial, query), codegen


@intrinsic
def add_weighted_row(typingctx, acc, weights, t, cache, row_start, prefetch_start):
    """``acc[g] + weights[g * TILE + t] * cache[row_start : row_start + D]`` for every row ``g``
    (the cache row widened once for the whole group). Also prefetches the cache's row at
    ``prefetch_start``."""
    if not (isinstance(acc, Rows) and not acc.bits and _c_array(weights)
            and weights.dtype == types.float32 and isinstance(t, types.Integer) and _c_array(cache)
            and isinstance(row_start, types.Integer) and isinstance(prefetch_start, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        acc_val, w_val, t_val, c_val, row_val, ahead_val = args
        _prefetch_row(context, builder, cache, c_val, ahead_val, prefetch_start, acc.width)
        value = _widen(builder, cache.dtype,
                       _load(context, builder, cache, c_val, row_val, row_start, acc.width))
        t64 = context.cast(builder, t_val, t, types.intp)
        base = _ptr(context, builder, weights, w_val, t64, types.intp)
        for g in range(acc.rows):
            w = builder.load(builder.gep(base, [ir.Constant(ir.IntType(64), g * TILE)]), align=4)
            row = _fma(builder, _splat(builder, w, acc.width), value,
                       builder.extract_value(acc_val, g))
            acc_val = builder.insert_value(acc_val, row, g)
        return acc_val

    return acc(acc, weights, t, cache, row_start, prefetch_start), codegen


@intrinsic
def scale_rows(typingctx, acc, factors):
    """``acc[g] * factors[g]`` for every row ``g`` (``factors``: float32 ``[G]``)."""
    if not (isinstance(acc, Rows) and not acc.bits and _c_array(factors)
            and factors.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        acc_val, f_val = args
        base = _ptr(context, builder, factors, f_val, ir.Constant(ir.IntType(64), 0), types.intp)
        for g in range(acc.rows):
            f = builder.load(builder.gep(base, [ir.Constant(ir.IntType(64), g)]), align=4)
            row = builder.fmul(builder.extract_value(acc_val, g), _splat(builder, f, acc.width))
            acc_val = builder.insert_value(acc_val, row, g)
        return acc_val

    return acc(acc, factors), codegen


@intrinsic
def tile_softmax(typingctx, scores, m, l, alpha, n, scale, query):
    """One tile's step of the online softmax, for every query row ``g`` of ``query`` (its type
    gives the rows): ``s = scale * scores[g * TILE : (g + 1) * TILE]`` (lanes from ``n`` on are
    masked out), ``m' = max(m[g], max(s))``; then ``alpha[g] = exp(m[g] - m')`` (the factor that
    rescales what was accumulated so far; 0 on the first tile, where ``m[g]`` is ``-inf``),
    ``scores[...] = p = exp(s - m')`` (0 where masked), ``m[g] = m'``, and the running sum, kept
    per lane so that no tile pays for a horizontal sum: ``l[g * TILE + i] = l[g * TILE + i] *
    alpha[g] + p[i]`` (``lane_sums`` adds the lanes up at the end). ``exp`` is
    ``common.exp_nonpositive``'s polynomial, one vector call for the tile's scores of a row and one
    for the rescale factors of all rows. ``scores``, ``m``, ``l``, ``alpha``: float32."""
    arrays = (scores, m, l, alpha)
    if not (all(_c_array(a) and a.dtype == types.float32 for a in arrays)
            and isinstance(n, types.Integer) and isinstance(scale, types.Float)
            and isinstance(query, Rows)):
        return None

    def codegen(context, builder, sig, args):
        s_arr, m_arr, l_arr, a_arr, n_val, scale_val, _ = args
        i64 = ir.IntType(64)
        zero = ir.Constant(i64, 0)
        s_base = _ptr(context, builder, scores, s_arr, zero, types.intp)
        m_base = _ptr(context, builder, m, m_arr, zero, types.intp)
        l_base = _ptr(context, builder, l, l_arr, zero, types.intp)
        a_base = _ptr(context, builder, alpha, a_arr, zero, types.intp)
        vec = ir.VectorType(_F32, TILE)
        ivec = ir.VectorType(i64, TILE)
        valid = builder.icmp_signed("<", ir.Constant(ivec, list(range(TILE))),
                                    _splat(builder, context.cast(builder, n_val, n, types.intp), TILE))
        scale_vec = _splat(builder, context.cast(builder, scale_val, scale, types.float32), TILE)
        minus_inf = ir.Constant(vec, [float("-inf")] * TILE)
        rows = query.rows
        gvec = ir.VectorType(_F32, rows)
        shift = ir.Constant(gvec, None)  # m[g] - m' of every row
        probs = []
        for g in range(rows):
            ptr = builder.bitcast(builder.gep(s_base, [ir.Constant(i64, g * TILE)]), vec.as_pointer())
            s = builder.select(valid, builder.fmul(builder.load(ptr, align=4), scale_vec), minus_inf)
            m_ptr = builder.gep(m_base, [ir.Constant(i64, g)])
            m_old = builder.load(m_ptr, align=4)
            m_new = _max(builder, m_old, _reduce(builder, s, lambda a, b: _max(builder, a, b)))
            builder.store(m_new, m_ptr, align=4)
            shift = builder.insert_element(shift, builder.fsub(m_old, m_new), ir.Constant(_I32, g))
            p = _exp_nonpositive(builder, builder.fsub(s, _splat(builder, m_new, TILE)))
            builder.store(p, ptr, align=4)
            probs.append(p)
        factors = _exp_nonpositive(builder, shift)
        for g, p in enumerate(probs):
            a = builder.extract_element(factors, ir.Constant(_I32, g))
            builder.store(a, builder.gep(a_base, [ir.Constant(i64, g)]), align=4)
            l_ptr = builder.bitcast(builder.gep(l_base, [ir.Constant(i64, g * TILE)]), vec.as_pointer())
            builder.store(_fma(builder, builder.load(l_ptr, align=4), _splat(builder, a, TILE), p),
                          l_ptr, align=4)
        return context.get_dummy_value()

    return types.void(scores, m, l, alpha, n, scale, query), codegen
