"""Compiled loops over embedding rows: dedup by hash table, sum per id, gather and scatter.

A batch's ids are deduplicated in one pass over a preallocated open-addressing hash table
(no sort of the ids, as TensorFlow's ``Unique`` op), or, when the ids' bound is small
enough, through a bitmap with one bit per id (sorted for free); either checks that each
id lies in ``[0, bound)``. The unique ids are then ordered by their owner-major keys
(:meth:`~mpitf.tables.rows.RowPlacement.keys`, the routing), so the result is exactly
``np.unique``'s of the keys (sorted unique values, inverse). Compiled by
numba (``cache=True``: loaded from the cache after the first run) and warmed up by
:func:`warm_up` when a worker or ps builds its buffers, so no step pays for compiling.
No ``fastmath``: a sum per id adds in the order of the rows, in float64, as
``np.bincount`` does, so every result is the same bits as the numpy passes it replaces.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["EMPTY", "RADIX_BITS", "SCAN_AHEAD", "any_nonfinite", "bitmap_inverse",
           "bitmap_unique", "first_outside", "hash_unique", "local_rows", "put_rows",
           "renumber", "row_words", "segment_sum_rows", "sort_unique", "take_rows", "warm_up"]

_jit = njit(nogil=True, cache=True, error_model="numpy")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: 2**64 / the golden ratio
RADIX_BITS = 11  # bits per radix pass over the unique keys (2048 counters)
EMPTY = -1  # an unused entry of the hash table (keys are never negative)
SCAN_AHEAD = 4  # ids a bitmap scan writes per word before it looks at the word's count


@_jit
def hash_unique(ids, bound, shift, table, firsts, where, inverse):
    """Deduplicate ``ids`` through a hash table; return ``(unique count, first bad index)``.

    ``firsts`` receives the unique ids in first-seen order, ``inverse`` each id's index in
    ``firsts``. An id outside ``[0, bound)`` stops the pass and its index is returned
    (else -1). ``table`` holds ``(id, index)`` pairs, ``1 << (64 - shift)`` of them, all
    ``EMPTY`` on entry and again on return (``where`` keeps the entries used); it is at
    least twice the ids, so a probe ends soon.
    """
    mask = table.shape[0] - 1
    u, bad = 0, -1
    for i in range(ids.shape[0]):
        x = ids[i]
        if x < 0 or x >= bound:
            bad = i
            break
        h = np.int64((np.uint64(x) * _GOLDEN) >> np.uint64(shift))
        while True:
            k = table[h, 0]
            if k == x:
                inverse[i] = table[h, 1]
                break
            if k == EMPTY:
                table[h, 0] = x
                table[h, 1] = u
                firsts[u] = x
                where[u] = h
                inverse[i] = u
                u += 1
                break
            h = (h + 1) & mask
    for j in range(u):
        table[where[j], 0] = EMPTY
    return u, bad


@intrinsic
def _popcount(typingctx, x):
    if x != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


@intrinsic
def _trailing_zeros(typingctx, x):
    if x != types.uint64:
        return None

    def codegen(context, builder, sig, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))
    return types.uint64(types.uint64), codegen


@_jit
def bitmap_unique(ids, bound, num_ps, mod, starts, bits, prefix, pos, keys, counts, unique):
    """Deduplicate ``ids`` through one bit per id below ``bound``; return ``(u, bad, lo, hi)``.

    Sets each id's bit, then one scan of the words from the smallest id's to the largest's
    writes the unique ids in ascending order, and each word's count of the bits before it
    (``prefix``), so an id's index among them is ``prefix`` plus the bits below it in its
    word: no hashing and no sort, and the bits of a million ids (128 KiB) stay in cache.
    The scan writes ``SCAN_AHEAD`` ids per word whether set or not (most words hold
    fewer), so ``unique`` needs ``SCAN_AHEAD`` entries more than ``ids``.
    With ``mod`` the unique ids are then ordered by their keys (a counting sort by owner:
    ``pos`` is each ascending id's place) and ``unique`` receives the keys, as
    :func:`sort_unique`. ``bits`` is all zero on entry; it stays set for
    :func:`bitmap_inverse`, which clears words ``lo >> 6`` to ``hi >> 6`` (``lo``, ``hi``:
    the smallest and largest id). An id outside ``[0, bound)`` stops the pass before any
    bit is set: its index is returned as ``bad`` (else -1).
    """
    n = ids.shape[0]
    if n == 0:
        return 0, -1, 0, -1
    lo, hi = ids[0], ids[0]
    for i in range(n):  # a separate pass: it vectorizes
        lo, hi = min(lo, ids[i]), max(hi, ids[i])
    if lo < 0 or hi >= bound:
        for i in range(n):
            if ids[i] < 0 or ids[i] >= bound:
                return 0, i, 0, -1
    for i in range(n):  # a store for every id, no branch to mispredict: 2x faster measured
        x = ids[i]
        bits[x >> 6] |= np.uint64(1) << np.uint64(x & 63)
    u = 0
    for w in range(lo >> 6, (hi >> 6) + 1):
        prefix[w] = u
        b = bits[w]
        base = w << 6
        c = np.int64(_popcount(b))
        for k in range(SCAN_AHEAD):  # unconditional: no branch per bit (3.5x faster measured)
            unique[u + k] = base + np.int64(_trailing_zeros(b))
            b &= b - np.uint64(1)
        if c > SCAN_AHEAD:  # dense words (the popular ids) come in runs: well predicted
            j = u + SCAN_AHEAD
            while b:
                unique[j] = base + np.int64(_trailing_zeros(b))
                j += 1
                b &= b - np.uint64(1)
        u += c
    if mod:  # ps p's ids first (ascending within each), as their keys sort
        counts[:num_ps + 1] = 0
        for j in range(u):
            counts[unique[j] % num_ps + 1] += 1
        for p in range(num_ps):
            counts[p + 1] += counts[p]
        for j in range(u):
            x = unique[j]
            q = x // num_ps
            p = x - q * num_ps
            k = counts[p]
            counts[p] = k + 1
            pos[j] = k
            keys[k] = starts[p] + q
        unique[:u] = keys[:u]
    return u, -1, lo, hi


@_jit
def bitmap_inverse(ids, mod, bits, prefix, pos, lo, hi, inverse):
    """Write each id's index among :func:`bitmap_unique`'s result into ``inverse``; clear ``bits``.

    The index is ``prefix`` plus the bits below the id in its word (through ``pos`` when
    the unique ids were reordered by key). Apart from :func:`bitmap_unique` so that a
    worker sends its pulls first and numbers the ids while the rows travel.
    """
    for i in range(ids.shape[0]):
        x = ids[i]
        w = x >> 6
        below = bits[w] & ((np.uint64(1) << np.uint64(x & 63)) - np.uint64(1))
        r = prefix[w] + np.int64(_popcount(below))
        inverse[i] = pos[r] if mod else r
    for w in range(lo >> 6, (hi >> 6) + 1):
        bits[w] = 0


@_jit
def sort_unique(firsts, u, num_ps, mod, starts, keys, perm, rank, counts, unique):
    """Sort the keys of the ``u`` unique ids into ``unique``; ``keys`` then holds their ranks.

    The key of id ``x`` is ``starts[x % num_ps] + x // num_ps`` when ``mod`` (rows i mod P:
    ps p's rows get keys ``[starts[p], starts[p + 1])``), else ``x``. An LSD radix sort of
    ``RADIX_BITS`` per pass over the unique keys only (as many passes as the largest key
    has bits); ``keys[j]`` is then the place of first-seen id ``j`` among the sorted, the
    renumbering :func:`renumber` applies to the inverse.
    """
    top = 0
    for j in range(u):
        x = firsts[j]
        if mod:
            q = x // num_ps
            x = starts[x - q * num_ps] + q
        keys[j] = x
        top = max(top, x)
        perm[j] = j
    radix = np.int64(1) << RADIX_BITS
    shift = 0
    a, b = perm, rank
    while shift == 0 or (shift < 63 and (top >> shift) > 0):
        counts[:] = 0
        for j in range(u):
            counts[(keys[a[j]] >> shift) & (radix - 1)] += 1
        total = 0
        for d in range(radix):
            c = counts[d]
            counts[d] = total
            total += c
        for j in range(u):
            d = (keys[a[j]] >> shift) & (radix - 1)
            b[counts[d]] = a[j]
            counts[d] += 1
        a, b = b, a
        shift += RADIX_BITS
    # a: the first-seen index of each sorted key; each key is read once, then its rank kept
    for j in range(u):
        unique[j] = keys[a[j]]
        keys[a[j]] = j


@_jit
def renumber(inverse, rank):
    """``inverse[i] = rank[inverse[i]]`` (first-seen indices to sorted places), in place."""
    for i in range(inverse.shape[0]):
        inverse[i] = rank[inverse[i]]


@_jit
def segment_sum_rows(values, segments, acc, out):
    """``out[s] = sum of values[i] with segments[i] == s``, summed in order in ``acc`` (float64)."""
    acc[:] = 0.0
    dim = values.shape[1]
    for i in range(values.shape[0]):
        s = segments[i]
        for d in range(dim):
            acc[s, d] += values[i, d]
    for s in range(out.shape[0]):
        for d in range(dim):
            out[s, d] = acc[s, d]


@intrinsic
def _prefetch_row(typingctx, arr, i, write):
    """Ask the CPU to bring row ``i`` of 2-D ``arr`` into cache (``write``: to store into it)."""
    if not isinstance(write, types.BooleanLiteral):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], zero],
                                       wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write.literal_value)),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, types.intp, write), codegen


AHEAD = 16  # rows: a table's rows are mostly cache misses; prefetching 16 ahead: -20-25 %


@_jit
def take_rows(src, index, out):
    """``out[j] = src[index[j]]`` for every j (rows of any element type)."""
    width, n = src.shape[1], index.shape[0]
    for j in range(n):
        if j + AHEAD < n:
            _prefetch_row(src, index[j + AHEAD], False)
        r = index[j]
        for d in range(width):
            out[j, d] = src[r, d]


@_jit
def put_rows(dst, index, src):
    """``dst[index[j]] = src[j]`` for every j (rows of any element type)."""
    width, n = dst.shape[1], index.shape[0]
    for j in range(n):
        if j + AHEAD < n:
            _prefetch_row(dst, index[j + AHEAD], True)
        r = index[j]
        for d in range(width):
            dst[r, d] = src[j, d]


@_jit
def sgd_rows(params, index, grads, lr):
    """``params[index[j]] -= grads[j] * lr`` in place (the SGD kernel's arithmetic, by row)."""
    width, n = params.shape[1], index.shape[0]
    for j in range(n):
        if j + AHEAD < n:
            _prefetch_row(params, index[j + AHEAD], True)
        r = index[j]
        for d in range(width):
            params[r, d] = params[r, d] - grads[j, d] * lr


@_jit
def any_nonfinite(words, exponent):
    """Return True if a float's exponent bits (``exponent``, all ones) mark a NaN or Inf.

    ``words``: the floats as unsigned words of their width. One OR over every element, no
    branch: vectorized, 2.3x ``np.isfinite(np.add.reduce(...))`` measured on 20k x 16.
    """
    acc = 0
    for i in range(words.shape[0]):
        acc |= (words[i] & exponent) == exponent
    return acc != 0


@_jit
def first_outside(ids, lo, hi):
    """Return the index of the first id outside ``[lo, hi)``, or -1 (a vectorized min/max first)."""
    n = ids.shape[0]
    if n == 0:
        return -1
    a, b = ids[0], ids[0]
    for i in range(n):
        a, b = min(a, ids[i]), max(b, ids[i])
    if a >= lo and b < hi:
        return -1
    for i in range(n):
        if ids[i] < lo or ids[i] >= hi:
            return i
    return -1


@_jit
def local_rows(ids, rows, num_ps, ps, mod, lo, hi, out):
    """Write each id's local row on ps ``ps`` into ``out``; return the first foreign index.

    ``mod``: id ``x`` is ps ``x % num_ps``'s local row ``x // num_ps``; else ps ``ps``
    holds ``[lo, hi)`` and ``x`` is its row ``x - lo``. Returns -1 when every id is in
    ``[0, rows)`` and held by ``ps``.
    """
    for j in range(ids.shape[0]):
        x = ids[j]
        if x < 0 or x >= rows:
            return j
        if mod:
            if x % num_ps != ps:
                return j
            out[j] = x // num_ps
        else:
            if x < lo or x >= hi:
                return j
            out[j] = x - lo
    return -1


def row_words(a):
    """Return 2-D C-contiguous ``a`` as rows of the widest unsigned words its rows fill (a view).

    The gather and scatter then copy whole rows as a few 8- or 4-byte words, whatever the
    table's dtype (float16 included, which numba does not compute with).
    """
    width = a.shape[1] * a.itemsize
    for word in (np.uint64, np.uint32, np.uint16):
        if width % np.dtype(word).itemsize == 0:
            return a.view(word)
    return a.view(np.uint8)


_warm = False


def warm_up():
    """Compile (or load from numba's cache) the kernels for the common types; once a process."""
    global _warm
    if _warm:
        return
    ids = np.zeros(2, np.int64)
    table = np.full((16, 2), EMPTY, np.int64)
    firsts, where, perm, rank = (np.empty(2, np.int64) for _ in range(4))
    inverse, counts = np.empty(2, np.intp), np.empty(1 << RADIX_BITS, np.int64)
    starts = np.zeros(2, np.int64)
    u, _ = hash_unique(ids, 1, 60, table, firsts, where, inverse)
    bits, prefix = np.zeros(1, np.uint64), np.empty(1, np.int64)
    _, _, lo, hi = bitmap_unique(ids, 1, 2, True, starts, bits, prefix, perm, rank, counts,
                                 np.empty(2 + SCAN_AHEAD, np.int64))
    bitmap_inverse(ids, True, bits, prefix, perm, lo, hi, inverse)
    sort_unique(firsts, u, 1, False, starts, where, perm, rank, counts, firsts.copy())
    renumber(inverse, where)
    local_rows(ids, 1, 1, 0, True, 0, 1, firsts)
    first_outside(ids, 0, 1)
    for dtype in (np.float32, np.float64):
        v = np.zeros((2, 2), dtype)
        segment_sum_rows(v, inverse, np.zeros((1, 2)), v[:1])
        sgd_rows(v, ids[:1], v[1:].copy(), dtype(0.5))
    for word in (np.uint64, np.uint32, np.uint16):
        any_nonfinite(np.zeros(2, word), word(1))
    for word in (np.uint64, np.uint32):
        w = np.zeros((2, 2), word)
        take_rows(w, ids[:1], w[1:].copy())
        put_rows(w, ids[:1], w[1:].copy())
    _warm = True
