"""The wire dtypes (bfloat16, float16): their loads and stores, and one-pass conversions.

Both sides convert: a worker narrows its float32 gradient into the push frame and widens
the reply into its float32 parameters (:func:`narrow_into`, :func:`widen_into`); a ps's
fused kernels widen a gradient as they read it and store the reply as they write it.

A kernel reads a gradient element with :func:`widen` and writes the reply's element with
:func:`store`; numba picks the conversion from the array's element type, so one kernel
serves every wire dtype and a float32 gradient costs nothing (``widen`` is the identity,
``store`` into None is nothing). numba has no 16-bit floats on the CPU, so the buffers come
in as integer views: bfloat16 as ``uint16``, float16 as ``int16`` (:func:`wire_view`). The
conversions are exact: a 16-bit float widens to float32 without rounding, and float32
narrows by rounding to nearest, ties to even, as ``ml_dtypes`` and numpy do (a NaN stays a
quiet NaN of the same sign).
"""

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["WIRE_DTYPES", "add_widened", "narrow_into", "part", "store", "warm_up", "widen",
           "widen_into", "wire_view"]

# wire dtype -> the integer view the kernels take it as
WIRE_DTYPES = {np.dtype(ml_dtypes.bfloat16): np.uint16, np.dtype(np.float16): np.int16}


def wire_view(a):
    """Return ``a`` as the kernels take it: a 16-bit float array as its integer view."""
    view = WIRE_DTYPES.get(a.dtype)
    return a if view is None else a.view(view)


@intrinsic
def _bf16_to_f32(typingctx, x):
    if x != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_bits(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _f16_to_f32(typingctx, x):
    if x != types.int16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


def widen(x):
    """Return a gradient element in the kernel's arithmetic dtype (numba only)."""


def store(r, i, x):
    """Write ``x`` into the reply ``r`` at ``i`` in the reply's dtype; nothing when None."""


def part(r, lo, hi):
    """Return ``r[lo:hi]``, or None for None (numba only)."""


@overload(widen, inline="always")
def _widen(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bf16_to_f32(x)
    if x == types.int16:
        return lambda x: _f16_to_f32(x)
    return None


@overload(part, inline="always")
def _part(r, lo, hi):
    if isinstance(r, types.NoneType):
        return lambda r, lo, hi: None
    return lambda r, lo, hi: r[lo:hi]


@overload(store, inline="always")
def _store(r, i, x):
    if isinstance(r, types.NoneType):
        return lambda r, i, x: None
    if r.dtype == types.uint16:
        def bfloat16(r, i, x):
            b = _f32_bits(x)
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: a quiet one
                r[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
            else:  # round to nearest, ties to even
                r[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                 >> np.uint32(16))
        return bfloat16
    if r.dtype == types.int16:
        def float16(r, i, x):
            r[i] = _f32_to_f16(x)
        return float16
    if isinstance(r.dtype, types.Float):
        def same(r, i, x):
            r[i] = x
        return same
    return None


# -- whole-buffer conversions (a worker's push and pull, a ps's reply and scratch) ----------

_jit = njit(nogil=True, cache=True, fastmath=False, error_model="numpy")


@_jit
def _narrow(src, dst):
    for i in range(src.shape[0]):
        store(dst, i, src[i])


@_jit
def _widen(src, dst):
    for i in range(src.shape[0]):
        dst[i] = widen(src[i])


@_jit
def _add_widened(dst, src):
    for i in range(dst.shape[0]):
        dst[i] = dst[i] + widen(src[i])


def warm_up(wire):
    """Compile (or load from numba's cache) the conversions of ``wire`` now, not in a step."""
    one, other = np.zeros(1, np.float32), np.zeros(1, wire)
    narrow_into(one, other)
    widen_into(other, one)
    add_widened(one, other)


def narrow_into(src, dst):
    """Round the float32 array ``src`` into ``dst`` (bfloat16 or float16): one pass."""
    _narrow(src, wire_view(dst))


def widen_into(src, dst):
    """Widen ``src`` (bfloat16 or float16) into the float32 array ``dst``: one pass, exact."""
    _widen(wire_view(src), dst)


def add_widened(dst, src):
    """Add ``src`` (bfloat16 or float16), widened, into the float32 array ``dst``."""
    _add_widened(dst, wire_view(src))
