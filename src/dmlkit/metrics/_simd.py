"""Eight-lane compaction for the numba kernels, written as LLVM vector IR (numba ``@intrinsic``).

numba compiles a branch-free append (``vals[n] = x; n += x >= low``) to scalar code, about
0.75 ns an entry on a 2-core EPYC (Zen 3), whatever fraction is kept. :func:`compress8` keeps
the entries of eight consecutive floats at or above a threshold with one vector comparison:

* on CPUs with AVX2: the comparison's 8-bit mask selects a permutation from a 256 x 8 table
  (:data:`COMPRESS_TABLE`), ``vpermps`` / ``vpermd`` move the kept values and their column
  indices to the front, both are stored whole (8 lanes; the lanes past the kept ones are
  overwritten by the next store) and ``n`` grows by the mask's population count: 0.25 ns an
  entry on the same CPU, 3x faster;
* elsewhere: eight branch-free appends (what numba compiles the scalar loop to), same
  results.

:func:`compress8_peel` compacts a list in place the same way, dropping the entries inside up to
four open intervals and counting them by interval (the map counting drops with it the values
certainly between two of a row's lowest positives).

The path is chosen when a kernel is compiled, from the CPU features numba compiles for
(``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` or the host's); numba's cache is keyed by those
features, so a cached kernel never runs on a CPU it was not compiled for.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.errors import TypingError
from numba.extending import intrinsic

__all__ = [
    "COMPRESS_TABLE", "compress8", "compress8_peel", "compress8_peel_portable", "compress8_portable",
    "has_avx2", "prefetch", "transpose8",
]

#: The open intervals :func:`compress8_peel` drops (and counts) in one pass.
_PEEL_INTERVALS = 4

_F8 = ir.VectorType(ir.FloatType(), 8)
_I8 = ir.VectorType(ir.IntType(32), 8)
_B8 = ir.VectorType(ir.IntType(1), 8)


def _compress_table() -> np.ndarray:
    """Row ``m``: the lanes whose bit is set in ``m``, in order, then zeros (int32, 256 x 8)."""
    table = np.zeros((256, 8), np.int32)
    for mask in range(256):
        lanes = [lane for lane in range(8) if mask >> lane & 1]
        table[mask, : len(lanes)] = lanes
    return table


#: The permutation of each 8-bit mask (pass it to :func:`compress8`).
COMPRESS_TABLE = _compress_table()


def has_avx2() -> bool:
    """Whether numba compiles for a CPU with AVX2 (the features it targets, not only the host's)."""
    if config.CPU_NAME and config.CPU_NAME != "host":
        features = config.CPU_FEATURES or ""
    else:
        features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+avx2" in features.split(",")


def _splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    zero = ir.Constant(ir.IntType(32), 0)
    first = builder.insert_element(ir.Constant(vector, ir.Undefined), value, zero)
    return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined), ir.Constant(_I8, [0] * 8))


def _append8(context, builder, x, idx, keep, n, vals_a, refs_a, table_a, use_permute: bool):
    """Emit the append of the lanes of ``x`` (values) and ``idx`` (int32 columns) selected by
    the 8 x i1 ``keep`` to ``vals[n:]`` / ``refs[n:]``; return ``n`` plus their number. Both
    vectors are in registers before the first store, so the output may overlap the input."""
    module = builder.module
    if use_permute:
        out_vals = builder.gep(vals_a.data, [n])
        out_refs = builder.gep(refs_a.data, [n])
        bits = builder.zext(builder.bitcast(keep, ir.IntType(8)), ir.IntType(64))
        at = builder.gep(table_a.data, [builder.mul(bits, ir.Constant(ir.IntType(64), 8))])
        perm = builder.load(builder.bitcast(at, _I8.as_pointer()), align=4)
        permps = cgutils.get_or_insert_function(module, ir.FunctionType(_F8, [_F8, _I8]),
                                                "llvm.x86.avx2.permps")
        permd = cgutils.get_or_insert_function(module, ir.FunctionType(_I8, [_I8, _I8]),
                                               "llvm.x86.avx2.permd")
        builder.store(builder.call(permps, [x, perm]), builder.bitcast(out_vals, _F8.as_pointer()),
                      align=4)
        builder.store(builder.call(permd, [idx, perm]), builder.bitcast(out_refs, _I8.as_pointer()),
                      align=4)
        ctpop = cgutils.get_or_insert_function(module, ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                                               "llvm.ctpop.i64")
        return builder.add(n, builder.call(ctpop, [bits]))
    # branch-free, lane by lane (what numba compiles the scalar append to)
    at = n
    for lane in range(8):
        lane_no = ir.Constant(ir.IntType(32), lane)
        builder.store(builder.extract_element(x, lane_no), builder.gep(vals_a.data, [at]))
        builder.store(builder.extract_element(idx, lane_no), builder.gep(refs_a.data, [at]))
        at = builder.add(at, builder.zext(builder.extract_element(keep, lane_no), ir.IntType(64)))
    return at


def _compress8_codegen(use_permute: bool):
    def codegen(context, builder, signature, args):
        vals, refs, n, row, col, low, table, first_ref = args
        arrays = [context.make_array(signature.args[k])(context, builder, v)
                  for k, v in ((0, vals), (1, refs), (3, row), (6, table))]
        vals_a, refs_a, row_a, table_a = arrays
        x = builder.load(builder.bitcast(builder.gep(row_a.data, [col]), _F8.as_pointer()), align=4)
        keep = builder.fcmp_ordered(">=", x, _splat(builder, low, _F8))
        idx = builder.add(_splat(builder, builder.trunc(first_ref, ir.IntType(32)), _I8),
                          ir.Constant(_I8, list(range(8))))
        return _append8(context, builder, x, idx, keep, n, vals_a, refs_a, table_a, use_permute)

    return codegen


def _peel8_codegen(use_permute: bool):
    def codegen(context, builder, signature, args):
        vals, refs, n, col, intervals, table = args
        arrays = [context.make_array(signature.args[k])(context, builder, v)
                  for k, v in ((0, vals), (1, refs), (5, table))]
        vals_a, refs_a, table_a = arrays
        x = builder.load(builder.bitcast(builder.gep(vals_a.data, [col]), _F8.as_pointer()), align=4)
        idx = builder.load(builder.bitcast(builder.gep(refs_a.data, [col]), _I8.as_pointer()), align=4)
        ends = cgutils.unpack_tuple(builder, intervals, _PEEL_INTERVALS * 2)
        ctpop = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), [ir.IntType(64)]), "llvm.ctpop.i64")
        inside, counts = None, []
        for k in range(_PEEL_INTERVALS):
            in_k = builder.and_(builder.fcmp_ordered(">", x, _splat(builder, ends[2 * k], _F8)),
                                builder.fcmp_ordered("<", x, _splat(builder, ends[2 * k + 1], _F8)))
            counts.append(builder.call(ctpop, [builder.zext(builder.bitcast(in_k, ir.IntType(8)),
                                                            ir.IntType(64))]))
            inside = in_k if inside is None else builder.or_(inside, in_k)
        keep = builder.not_(inside)
        kept = _append8(context, builder, x, idx, keep, n, vals_a, refs_a, table_a, use_permute)
        return context.make_tuple(builder, signature.return_type, [kept, *counts])

    return codegen


def _require(name: str, ty, dtype, ndim: int) -> None:
    """The intrinsics read and write through raw pointers: only C-contiguous arrays of one type."""
    if not (isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == ndim and ty.layout == "C"):
        raise TypingError(f"{name} must be a C-contiguous {ndim}-d {dtype} array, got {ty}")


def _compress8_signature(vals, refs, n, row, col, low, table, first_ref):
    """The typed signature (integers as int64), or a TypingError for arguments it would misuse."""
    _require("vals", vals, types.float32, 1)
    _require("refs", refs, types.int32, 1)
    _require("row", row, types.float32, 1)
    _require("table", table, types.int32, 2)
    for name, ty in (("n", n), ("col", col), ("first_ref", first_ref)):
        if not isinstance(ty, types.Integer):
            raise TypingError(f"{name} must be an integer, got {ty}")
    if low != types.float32:
        raise TypingError(f"low must be a float32 threshold, got {low}")
    return types.int64(vals, refs, types.int64, row, types.int64, types.float32, table, types.int64)


@intrinsic
def compress8(typingctx, vals, refs, n, row, col, low, table, first_ref):
    """``compress8(vals, refs, n, row, col, low, table, first_ref) -> n'``: append the entries
    ``row[col + l] >= low`` of ``l = 0..7`` to ``vals[n:]`` (float32) and ``first_ref + l`` to
    ``refs[n:]`` (int32), in order; return ``n`` plus their number. Reads ``row[col : col + 8]``
    and writes up to ``vals[n + 7]`` / ``refs[n + 7]`` (give the outputs 8 spare lanes).
    ``table`` is :data:`COMPRESS_TABLE`."""
    sig = _compress8_signature(vals, refs, n, row, col, low, table, first_ref)
    return sig, _compress8_codegen(has_avx2())


@intrinsic
def compress8_portable(typingctx, vals, refs, n, row, col, low, table, first_ref):
    """:func:`compress8` always lane by lane (the path of CPUs without AVX2; tests compare the
    two)."""
    sig = _compress8_signature(vals, refs, n, row, col, low, table, first_ref)
    return sig, _compress8_codegen(False)


def _peel8_signature(vals, refs, n, col, intervals, table):
    """The typed signature of :func:`compress8_peel`, or a TypingError."""
    _require("vals", vals, types.float32, 1)
    _require("refs", refs, types.int32, 1)
    _require("table", table, types.int32, 2)
    for name, ty in (("n", n), ("col", col)):
        if not isinstance(ty, types.Integer):
            raise TypingError(f"{name} must be an integer, got {ty}")
    want = types.UniTuple(types.float32, 2 * _PEEL_INTERVALS)
    if intervals != want:
        raise TypingError(f"intervals must be a {want} of float32 (low, high) pairs, got {intervals}")
    return types.UniTuple(types.int64, 1 + _PEEL_INTERVALS)(vals, refs, types.int64, types.int64,
                                                            intervals, table)


@intrinsic
def compress8_peel(typingctx, vals, refs, n, col, intervals, table):
    """``compress8_peel(vals, refs, n, col, intervals, table) -> (n', c_0, c_1, c_2, c_3)``:
    compact a list in place, eight entries at a time. Of ``vals[col + l]`` / ``refs[col + l]``,
    ``l = 0..7``, drop those inside one of the open intervals ``(intervals[2k],
    intervals[2k + 1])`` and count them by interval (``c_k``); append the others in order at
    ``vals[n:]`` / ``refs[n:]`` (``n <= col``; writes up to lane ``n + 7``) and return ``n`` plus
    their number. An interval with ``low >= high`` holds nothing; NaN is kept. Same two paths as
    :func:`compress8`."""
    sig = _peel8_signature(vals, refs, n, col, intervals, table)
    return sig, _peel8_codegen(has_avx2())


@intrinsic
def compress8_peel_portable(typingctx, vals, refs, n, col, intervals, table):
    """:func:`compress8_peel` always lane by lane (tests compare the two)."""
    sig = _peel8_signature(vals, refs, n, col, intervals, table)
    return sig, _peel8_codegen(False)


#: The three shuffle stages of an 8 x 8 transpose (LLVM lowers them to unpack / shuffle /
#: 128-bit permutes on x86, and to the target's own shuffles elsewhere).
_PAIR_LO, _PAIR_HI = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
_QUAD_LO, _QUAD_HI = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
_HALF_LO, _HALF_HI = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]


@intrinsic
def transpose8(typingctx, s, row, col, block):
    """``transpose8(s, row, col, block)``: ``block[l, k] = s[row + k, col + l]`` for ``k, l`` in
    ``0..7`` (``s`` a C-contiguous float32 matrix, ``block`` a float32 8 x 8 one), in registers:
    eight row loads, 24 shuffles, eight stores."""
    _require("s", s, types.float32, 2)
    _require("block", block, types.float32, 2)
    for name, ty in (("row", row), ("col", col)):
        if not isinstance(ty, types.Integer):
            raise TypingError(f"{name} must be an integer, got {ty}")
    sig = types.void(s, types.int64, types.int64, block)

    def codegen(context, builder, signature, args):
        s_v, row_v, col_v, block_v = args
        s_a = context.make_array(signature.args[0])(context, builder, s_v)
        b_a = context.make_array(signature.args[3])(context, builder, block_v)
        width = cgutils.unpack_tuple(builder, s_a.shape, 2)[1]
        shuffle = builder.shuffle_vector
        rows = []
        for k in range(8):
            at = builder.add(builder.mul(builder.add(row_v, ir.Constant(ir.IntType(64), k)), width), col_v)
            rows.append(builder.load(builder.bitcast(builder.gep(s_a.data, [at]), _F8.as_pointer()), align=4))
        t = []
        for k in range(0, 8, 2):
            t += [shuffle(rows[k], rows[k + 1], ir.Constant(_I8, _PAIR_LO)),
                  shuffle(rows[k], rows[k + 1], ir.Constant(_I8, _PAIR_HI))]
        u = []
        for a, b in ((0, 2), (4, 6), (1, 3), (5, 7)):
            u += [shuffle(t[a], t[b], ir.Constant(_I8, _QUAD_LO)), shuffle(t[a], t[b], ir.Constant(_I8, _QUAD_HI))]
        # u: [cols 0/4 of rows 0-3, cols 1/5 of rows 0-3, cols 0/4 of rows 4-7, cols 1/5 of rows 4-7,
        #     cols 2/6 of rows 0-3, cols 3/7 of rows 0-3, cols 2/6 of rows 4-7, cols 3/7 of rows 4-7]
        pairs = {0: (u[0], u[2]), 1: (u[1], u[3]), 2: (u[4], u[6]), 3: (u[5], u[7])}
        for lane, (a, b) in pairs.items():
            for out, mask in ((lane, _HALF_LO), (lane + 4, _HALF_HI)):
                dest = builder.gep(b_a.data, [ir.Constant(ir.IntType(64), 8 * out)])
                builder.store(shuffle(a, b, ir.Constant(_I8, mask)), builder.bitcast(dest, _F8.as_pointer()),
                              align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch(typingctx, array, index):
    """``prefetch(array, index)``: ask the CPU to bring the cache line of ``array[index]`` (a
    C-contiguous 1-d array) towards the core (LLVM's ``llvm.prefetch``: read, high locality; a
    hint that never faults and changes no value)."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"):
        raise TypingError(f"array must be a C-contiguous 1-d array, got {array}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"index must be an integer, got {index}")
    sig = types.void(array, types.int64)

    def codegen(context, builder, signature, args):
        array_v, index_v = args
        data = context.make_array(signature.args[0])(context, builder, array_v).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(builder.gep(data, [index_v]), byte_ptr),
                          ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
