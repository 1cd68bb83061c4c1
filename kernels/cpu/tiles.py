"""What one tile of ``TILE`` keys takes across its lanes in the Numba attention kernels
(``kernels/cpu/decode.py``), as LLVM IR on 16-lane vectors: the scores from the partial dot
products (``tile_scores``), and the online softmax's step (``tile_softmax``).

- ``tile_scores``: the 16 partial-dot vectors of a query (one per key,
  ``vectors.store_partial_dots``) become one vector of 16 scores by a transposing tree:
  neighbours are shuffled into halves and added, halving the lanes per key and doubling the keys
  per vector at each step; 15 shuffle pairs and adds for 16 keys, where summing each vector on its
  own takes 4 shuffles and adds per key.
- ``tile_softmax``: scale and mask the scores, the tile's max by a tree of halves, ``exp`` by
  ``common.exp_nonpositive``'s polynomial on the vector; the rescale factors of all the group's
  queries in one vector ``exp``; the running sums kept per lane (added up once, by the caller, at
  the end). Measured by leaving it out (bf16, caches in L3, one thread): written as numba loops
  over the tile (the vectorizer left the max and the sum serial) the softmax took 40% of the
  kernel's time, in vectors 27%; the factors in one call and the per-lane sums then took 12% off
  the kernel's time.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels.cpu.common import _EXP_MIN
from kernels.cpu.vectors import (
    F32, I32, I64, TILE, Rows, c_array, call, element_ptr, fma, lanes_of, partial_lanes, splat,
    vector_at,
)


def _pair_keys(builder, a, b, width):
    """Two vectors holding ``k`` keys of ``width`` lanes each -> one of ``2k`` keys of
    ``width / 2`` lanes: [first halves of a's keys, then b's] + [second halves]."""
    lanes = a.type.count
    half = width // 2
    first = [k * width + i for k in range(lanes // width) for i in range(half)]
    second = [i + half for i in first]
    mask = ir.VectorType(I32, lanes)
    lo = builder.shuffle_vector(a, b, ir.Constant(mask, first + [lanes + i for i in first]))
    hi = builder.shuffle_vector(a, b, ir.Constant(mask, second + [lanes + i for i in second]))
    return builder.fadd(lo, hi)


def _tree_sums(builder, vectors):
    """``TILE`` vectors of ``W`` lanes (a power of two) -> one vector whose lane ``i`` is the sum
    of vector ``i``'s lanes."""
    width = vectors[0].type.count
    while width > 1:
        vectors = [_pair_keys(builder, a, b, width) for a, b in zip(vectors[0::2], vectors[1::2])]
        width //= 2
    while len(vectors) > 1:  # W < TILE: single-lane keys in several vectors, concatenated
        lanes = vectors[0].type.count
        mask = ir.Constant(ir.VectorType(I32, 2 * lanes), list(range(2 * lanes)))
        vectors = [builder.shuffle_vector(a, b, mask) for a, b in zip(vectors[0::2], vectors[1::2])]
    return vectors[0]


@intrinsic
def tile_scores(typingctx, scores, partial, query):
    """``scores[g * TILE + t]`` = the sum of the lanes of ``partial[g, t]`` for every query row
    ``g`` of ``query`` (its type gives the rows and ``W``) and key ``t`` of the tile.
    ``scores``: float32 ``[G * TILE]``; ``partial``: float32 ``[G, TILE, W]``."""
    if not (c_array(scores, types.float32) and c_array(partial, types.float32)
            and isinstance(query, Rows)):
        return None
    lanes = partial_lanes(query.width)

    def codegen(context, builder, sig, args):
        src = element_ptr(context, builder, partial, args[1], ir.Constant(I64, 0))
        dst = element_ptr(context, builder, scores, args[0], ir.Constant(I64, 0))
        vec = ir.VectorType(F32, lanes)
        for g in range(query.rows):
            rows = [builder.load(vector_at(builder, src, (g * TILE + t) * lanes, vec), align=4)
                    for t in range(TILE)]
            builder.store(_tree_sums(builder, rows),
                          vector_at(builder, dst, g * TILE, ir.VectorType(F32, TILE)), align=4)
        return context.get_dummy_value()

    return types.void(scores, partial, query), codegen


def _fold(builder, vec, combine):
    """``combine`` folded over the lanes of ``vec`` (a power of two of them), by halves."""
    while vec.type.count > 1:
        half = vec.type.count // 2
        vec = combine(lanes_of(builder, vec, 0, half), lanes_of(builder, vec, half, half))
    return builder.extract_element(vec, ir.Constant(I32, 0))


def _max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _exp_nonpositive(builder, x):
    """``common.exp_nonpositive`` on a float32 vector: the same Cephes polynomial, lane by lane."""
    vec = x.type
    lanes = vec.count

    def const(value):
        return ir.Constant(vec, [float(np.float32(value))] * lanes)

    inside = builder.fcmp_ordered(">=", x, const(_EXP_MIN))
    x = builder.select(inside, x, const(0.0))
    n = call(builder, f"llvm.floor.v{lanes}f32", vec,
             [fma(builder, x, const(1.4426950408889634), const(0.5))])
    neg_n = builder.fneg(n)
    r = fma(builder, neg_n, const(-2.12194440e-4), fma(builder, neg_n, const(0.693359375), x))
    p = const(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma(builder, p, r, const(c))
    y = builder.fadd(fma(builder, builder.fmul(p, r), r, r), const(1.0))
    ivec = ir.VectorType(I32, lanes)
    two_n = builder.shl(builder.add(builder.fptosi(n, ivec), ir.Constant(ivec, [127] * lanes)),
                        ir.Constant(ivec, [23] * lanes))
    return builder.select(inside, builder.fmul(y, builder.bitcast(two_n, vec)), const(0.0))


@intrinsic
def tile_softmax(typingctx, scores, m, l, alpha, n, scale, query):
    """One tile's step of the online softmax, for every query row ``g`` of ``query`` (its type
    gives the rows): ``s = scale * scores[g * TILE : (g + 1) * TILE]`` (lanes from ``n`` on are
    masked out), ``m' = max(m[g], max(s))``; then ``alpha[g] = exp(m[g] - m')`` (the factor that
    rescales what was accumulated so far; 0 on the first tile, where ``m[g]`` is ``-inf``),
    ``scores[...] = p = exp(s - m')`` (0 where masked), ``m[g] = m'``, and the running sum per
    lane: ``l[g * TILE + i] = l[g * TILE + i] * alpha[g] + p[i]``. ``scores``, ``l``: float32
    ``[G * TILE]``; ``m``, ``alpha``: float32 ``[G]``."""
    if not (all(c_array(a, types.float32) for a in (scores, m, l, alpha))
            and isinstance(n, types.Integer) and isinstance(scale, types.Float)
            and isinstance(query, Rows)):
        return None

    def codegen(context, builder, sig, args):
        s_arr, m_arr, l_arr, a_arr, n_val, scale_val, _ = args
        zero = ir.Constant(I64, 0)
        s_base = element_ptr(context, builder, scores, s_arr, zero)
        m_base = element_ptr(context, builder, m, m_arr, zero)
        l_base = element_ptr(context, builder, l, l_arr, zero)
        a_base = element_ptr(context, builder, alpha, a_arr, zero)
        vec = ir.VectorType(F32, TILE)
        lane_ids = ir.Constant(ir.VectorType(I64, TILE), list(range(TILE)))
        n_vec = splat(builder, context.cast(builder, n_val, n, types.intp), TILE)
        valid = builder.icmp_signed("<", lane_ids, n_vec)
        scale_vec = splat(builder, context.cast(builder, scale_val, scale, types.float32), TILE)
        minus_inf = ir.Constant(vec, [float("-inf")] * TILE)
        shift = ir.Constant(ir.VectorType(F32, query.rows), None)  # m[g] - m' of every row
        probs = []
        for g in range(query.rows):
            ptr = vector_at(builder, s_base, g * TILE, vec)
            s = builder.fmul(builder.load(ptr, align=4), scale_vec)
            s = builder.select(valid, s, minus_inf)
            m_ptr = builder.gep(m_base, [ir.Constant(I64, g)])
            m_old = builder.load(m_ptr, align=4)
            m_new = _max(builder, m_old, _fold(builder, s, lambda a, b: _max(builder, a, b)))
            builder.store(m_new, m_ptr, align=4)
            shift = builder.insert_element(shift, builder.fsub(m_old, m_new), ir.Constant(I32, g))
            p = _exp_nonpositive(builder, builder.fsub(s, splat(builder, m_new, TILE)))
            builder.store(p, ptr, align=4)
            probs.append(p)
        factors = _exp_nonpositive(builder, shift)
        for g, p in enumerate(probs):
            a = builder.extract_element(factors, ir.Constant(I32, g))
            builder.store(a, builder.gep(a_base, [ir.Constant(I64, g)]), align=4)
            l_ptr = vector_at(builder, l_base, g * TILE, vec)
            builder.store(fma(builder, builder.load(l_ptr, align=4), splat(builder, a, TILE), p),
                          l_ptr, align=4)
        return context.get_dummy_value()

    return types.void(scores, m, l, alpha, n, scale, query), codegen
