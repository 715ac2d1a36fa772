"""Which ps task holds which row of an embedding table: pure and deterministic, no messages.

A table of ``rows`` rows is split by rows over all ``num_ps`` ps tasks. Two ways, both a
function of (rows, num_ps) alone, so every rank computes the same map:

- ``"mod"`` (the default): row ``i`` lives on ps ``i % P`` at local index ``i // P``.
  Ids drawn from a skewed distribution (popular ids are usually small) spread evenly.
- ``"range"``: contiguous ranges, TensorFlow's slice sizes (the first ``rows % P`` ps get
  one row more); row ``i`` lives on the ps whose range holds it, at ``i - start``.

Everything here takes and returns int64 numpy arrays; the loops over ids are compiled
(:mod:`mpitf.tables.rowkernels`) or numpy's, never one Python step per row.
"""

import numpy as np

from ..errors import ConfigurationError

ROW_PLACEMENTS = ("mod", "range")


def _kernels():
    """Return :mod:`mpitf.tables.rowkernels`, imported on first use.

    numba then loads only in a process that has embedding tables: a dense worker never
    imports it.
    """
    from . import rowkernels

    return rowkernels


class RowPlacement:
    """The split of one table's rows over ``num_ps`` ps tasks (``"mod"`` or ``"range"``).

    Args:
        rows: the table's number of rows (at least 1).
        num_ps: the number of ps tasks (at least 1).
        kind: "mod" (row i on ps i % num_ps) or "range" (contiguous ranges of rows,
            the first ``rows % num_ps`` ps one row more).

    Raises:
        ConfigurationError: another kind, or no rows or no ps.
    """

    def __init__(self, rows, num_ps, kind="mod"):
        if kind not in ROW_PLACEMENTS:
            raise ConfigurationError(
                f"row placement must be one of {list(ROW_PLACEMENTS)}, got {kind!r}")
        if int(rows) < 1 or int(num_ps) < 1:
            raise ConfigurationError(
                f"a table needs at least one row and one ps, got rows={rows}, num_ps={num_ps}")
        self.rows, self.num_ps, self.kind = int(rows), int(num_ps), kind
        base, extra = divmod(self.rows, self.num_ps)
        sizes = [base + (p < extra) for p in range(self.num_ps)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __repr__(self):
        return f"RowPlacement(rows={self.rows}, num_ps={self.num_ps}, kind={self.kind!r})"

    def __eq__(self, other):
        return isinstance(other, RowPlacement) and \
            (other.rows, other.num_ps, other.kind) == (self.rows, self.num_ps, self.kind)

    def rows_on(self, ps):
        """Return how many rows ps ``ps`` holds."""
        if self.kind == "mod":
            return len(range(ps, self.rows, self.num_ps))
        return int(self.starts[ps + 1] - self.starts[ps])

    def owner(self, ids):
        """Return the ps task of each id (ids must lie in ``[0, rows)``)."""
        if self.kind == "mod":
            return ids % self.num_ps
        return np.searchsorted(self.starts, ids, side="right") - 1

    def local(self, ids, ps):
        """Return the local row index on ps ``ps`` of each of its ``ids``."""
        if self.num_ps == 1:
            return ids
        if self.kind == "mod":
            return ids // self.num_ps
        return ids - self.starts[ps]

    def global_ids(self, ps):
        """Return the table rows ps ``ps`` holds, in local order (int64)."""
        if self.kind == "mod":
            return np.arange(ps, self.rows, self.num_ps, dtype=np.int64)
        return np.arange(self.starts[ps], self.starts[ps + 1], dtype=np.int64)

    def keys(self, ids):
        """Return each id's key: ps ``p``'s rows are keys ``[starts[p], starts[p + 1])``.

        A bijection of ``[0, rows)`` onto itself that numbers ps 0's rows first, then ps
        1's, ... (local order within each), so sorting keys groups ids by owner: one sort
        both deduplicates and routes. For ``"range"`` (or one ps) the key is the id.
        """
        if self.num_ps == 1 or self.kind == "range":
            return ids
        owner = ids % self.num_ps
        return self.starts[owner] + ids // self.num_ps

    def route(self, dedup, ids):
        """Return ``(unique keys, offsets per ps, bad)`` of ``ids`` (inverse: ``dedup.finish``)."""
        keys, bad = dedup.start(ids, self)
        return keys, None if bad >= 0 else np.searchsorted(keys, self.starts), bad

    def refusal(self, name, x):
        """Return the message for id ``x``, outside the table."""
        return (f"table {name!r}: id {x} is outside [0, {self.rows}) (ids are never wrapped "
                "or clipped)")

    def ids_of_keys(self, keys, ps, out):
        """Write the ids of ps ``ps``'s ``keys`` into ``out``; return ``out``."""
        if self.num_ps == 1 or self.kind == "range":
            out[...] = keys
            return out
        np.subtract(keys, self.starts[ps], out=out)
        np.multiply(out, self.num_ps, out=out)
        return np.add(out, ps, out=out)


def row_view(a):
    """Return a 2-D C-contiguous array as 1-D, one opaque item per row (a view).

    ``np.put`` and ``np.take`` move such rows as one memcpy each: measured 10x faster
    than ``a[ids] = rows`` for 20k rows of 16 float32.
    """
    return a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(-1)


def cache_aligned(shape, dtype, fill=None):
    """Return a new C-contiguous array whose data starts on a 64-byte cache line.

    numpy's large arrays start 16 bytes past a page, so a 64-byte row (16 float32) would
    straddle two lines: gathering a table's rows by id then misses twice per row
    (measured: gather -36 %, SGD in place -35 % on 20k rows of a 1M x 16 table).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    out = raw[start:start + nbytes].view(dtype).reshape(shape)
    if fill is not None:
        out.fill(fill)
    return out


CACHE_LINE = 64


def take_rows(src, index, out):
    """Write rows ``src[index]`` of a 2-D C-contiguous array into ``out``; return ``out``.

    A compiled loop copying each row as a few words (faster than ``np.take``, which copies
    a row per item, by 1.4-2x measured on 20 418 rows of 16 float32).
    """
    k = _kernels()
    k.take_rows(k.row_words(src), index, k.row_words(out))
    return out


def put_rows(dst, index, src):
    """Write the rows of ``src`` into rows ``index`` of 2-D C-contiguous ``dst``."""
    k = _kernels()
    k.put_rows(k.row_words(dst), index, k.row_words(src))


def segment_sum(values, segments, out, scratch=None):
    """Sum the rows of ``values`` into ``out[segments[i]]``; return ``out`` (overwritten).

    Adds in the order of the rows, in float64 (``scratch``: a float64 array of at least
    ``out``'s shape, made here when None), as ``np.bincount`` with weights does, so a sum
    is the same on every run and in any process that sums the same rows in the same order
    (the worker's sum per unique id, the ps's sum over workers in worker order). Compiled
    (:func:`~mpitf.tables.rowkernels.segment_sum_rows`) for float32 and float64 rows; other
    dtypes take one ``np.bincount`` per column, the same sums.
    """
    n, dim = out.shape
    if values.dtype not in _COMPILED or out.dtype != values.dtype:
        for d in range(dim):
            out[:, d] = np.bincount(segments, weights=values[:, d], minlength=n)
        return out
    acc = np.empty((n, dim)) if scratch is None else scratch.reshape(-1)[:n * dim].reshape(n, dim)
    _kernels().segment_sum_rows(values, segments, acc, out)
    return out


_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))


def all_finite(a):
    """Return True when no element of float array ``a`` is NaN or Inf.

    One compiled pass over the exponent bits for float16/32/64 in C order (no sum that
    could overflow, no temporary); numpy's ``isfinite`` for other arrays.
    """
    exponent = _EXPONENT.get(a.dtype)
    if exponent is None or not a.flags.c_contiguous:
        return bool(np.isfinite(a).all())
    return not _kernels().any_nonfinite(a.reshape(-1).view(exponent.dtype), exponent)


_EXPONENT = {np.dtype(np.float16): np.uint16(0x7C00), np.dtype(np.float32): np.uint32(0x7F800000),
             np.dtype(np.float64): np.uint64(0x7FF0000000000000)}


class Dedup:
    """Deduplicate up to ``capacity`` ids: sorted unique values and inverse, as ``np.unique``.

    When the ids' bound is known and its bitmap (one bit per id, and a count per 64) is no
    larger than a hash table for ``capacity`` ids: one bit per id, sorted for free
    (:func:`~mpitf.tables.rowkernels.bitmap_unique`); else a hash table of ``(id, index)`` pairs
    at least twice ``capacity`` and a radix sort of the unique keys alone
    (:func:`~mpitf.tables.rowkernels.hash_unique`,
    :func:`~mpitf.tables.rowkernels.sort_unique`). Every buffer is made once (on first
    use), for ``capacity`` ids; the returned arrays are views, valid until the next call.
    Measured (4096 x 26 Zipf(1.2) ids below 10**6,
    20 418 unique, at load 12; benchmarks/README.md): 0.28-0.52 ms, against 3.0 ms for
    the numpy radix argsort it replaces and 17 ms for ``np.unique(return_inverse=True)``.
    """

    def __init__(self, capacity):
        n = max(1, int(capacity))
        bits = max(4, (2 * n - 1).bit_length())  # at least twice the ids: short probes
        self.shift, self.entries = 64 - bits, 1 << bits
        self.table = None  # the hash table, made on first use
        self.any_table = None  # ... and the one of ids of any sign (group), grown on use
        self.bitmaps = {}  # bound -> (bits, prefix), made on first use
        self.firsts, self.where = np.empty(n, np.int64), np.empty(n, np.int64)
        self.perm, self.rank = np.empty(n, np.int64), np.empty(n, np.int64)
        self.k = _kernels()
        self.unique = np.empty(n + self.k.SCAN_AHEAD, np.int64)  # a bitmap scan's slack
        self.inverse = np.empty(n, np.intp)
        self.counts = np.empty(1 << self.k.RADIX_BITS, np.int64)
        self.capacity = n
        self._todo = None  # the inverse's work left by start() for finish()
        self.k.warm_up()

    def __call__(self, ids, bound=None):
        """Return ``(unique ids, inverse)`` of 1-D ``ids`` in ``[0, bound)`` as ``np.unique``.

        ``bound`` None: any non-negative int64. An id outside raises ``ValueError``.
        """
        keys, bad = self._start(ids, bound, 1, False, _NO_STARTS)
        if bad >= 0:
            x = int(np.ravel(ids)[bad])
            raise ValueError(f"id {x} is outside [0, {bound})" if bound else f"id {x} is negative")
        return keys, self.finish()

    def route(self, ids, placement):
        """Return ``(unique keys, inverse, bad)`` of ``ids`` under ``placement``.

        The keys are :meth:`RowPlacement.keys` of the ids, sorted: ps ``p``'s are
        ``keys[searchsorted(keys, starts)[p]:...[p + 1]]``. ``bad`` is the index of the
        first id outside ``[0, placement.rows)`` (then the other two are empty), else -1.
        """
        keys, bad = self.start(ids, placement)
        return keys, self.finish(), bad

    def start(self, ids, placement):
        """Return ``(unique keys, bad)`` as :meth:`route`; the inverse waits for :meth:`finish`.

        A worker sends its pulls between the two: the ids are numbered while rows travel.
        """
        mod = placement.kind == "mod" and placement.num_ps > 1
        if placement.num_ps >= len(self.counts):
            self.counts = np.empty(placement.num_ps + 1, np.int64)
        return self._start(ids, placement.rows, placement.num_ps, mod, placement.starts)

    def group(self, ids, num_ps, negatives=True):
        """Return ``(unique ids, offsets, bad)`` of any int64 ``ids``, grouped by hash owner.

        A dynamic table's routing (:class:`~mpitf.tables.hashing.HashPlacement`): ps ``p``'s
        ids are ``unique[offsets[p]:offsets[p + 1]]``, in first-seen order; ``bad`` is the
        index of the first negative id when ``negatives`` is False, else -1. The inverse
        waits for :meth:`finish`.
        """
        if self._todo is not None:
            self.finish()
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        if len(ids) > self.capacity:
            raise ValueError(f"{len(ids)} ids, but this Dedup was made for at most "
                             f"{self.capacity}")
        if self.any_table is None:
            from . import dynkernels

            dynkernels.warm_up()
            self.any_table = np.full(1024, dynkernels.EMPTY, np.int32)
            self.offsets = np.empty(num_ps + 1, np.int64)
            self._group, self._empty = dynkernels.hash_group, dynkernels.EMPTY
        if len(self.offsets) < num_ps + 1:
            self.offsets = np.empty(num_ps + 1, np.int64)
        inverse = self.inverse[:len(ids)]
        while True:  # a table for twice the unique ids, not the ids: it stays in cache
            table = self.any_table
            shift = 64 - (len(table).bit_length() - 1)
            u, bad = self._group(ids, num_ps, negatives, shift, table, len(table) // 2,
                                 self.firsts, self.where, self.offsets, self.unique, inverse)
            if bad != -2:
                break
            self.any_table = np.full(2 * len(table), self._empty, np.int32)
        if bad >= 0:
            return self.unique[:0], None, bad
        self._todo = (ids, inverse, None if num_ps > 1 else ())  # (): numbered already
        return self.unique[:u], self.offsets[:num_ps + 1], -1

    def finish(self):
        """Return the inverse of the ids of the last :meth:`start` (empty after a bad id)."""
        todo, self._todo = self._todo, None
        if todo is None:
            return self.inverse[:0]
        ids, inverse, args = todo
        if args == ():
            return inverse
        if args is None:
            self.k.renumber(inverse, self.where)
        else:
            self.k.bitmap_inverse(ids, *args, inverse)
        return inverse

    def _start(self, ids, bound, num_ps, mod, starts):
        if self._todo is not None:
            self.finish()  # a bitmap is clean again only once its inverse is done
        ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
        n = len(ids)
        if n > self.capacity:
            raise ValueError(f"{n} ids, but this Dedup was made for at most {self.capacity}")
        inverse = self.inverse[:n]
        if bound is not None and -(-int(bound) // 64) <= self.entries:  # no larger
            bitmap = self.bitmaps.get(int(bound))
            if bitmap is None:
                words = -(-int(bound) // 64)
                bitmap = self.bitmaps[int(bound)] = (np.zeros(words, np.uint64),
                                                     np.empty(words, np.int64))
            u, bad, lo, hi = self.k.bitmap_unique(ids, int(bound), num_ps, mod, starts, *bitmap,
                                                  self.perm, self.rank, self.counts, self.unique)
            if bad >= 0:
                return self.unique[:0], bad
            self._todo = (ids, inverse, (mod, *bitmap, self.perm, lo, hi))
            return self.unique[:u], -1
        if self.table is None:
            self.table = np.full((self.entries, 2), self.k.EMPTY, np.int64)
        u, bad = self.k.hash_unique(ids, _ANY if bound is None else int(bound), self.shift,
                                    self.table, self.firsts, self.where, inverse)
        if bad >= 0:
            return self.unique[:0], bad
        self.k.sort_unique(self.firsts, u, num_ps, mod, starts, self.where, self.perm,
                           self.rank, self.counts, self.unique)
        self._todo = (ids, inverse, None)
        return self.unique[:u], -1


_ANY = np.iinfo(np.int64).max
_NO_STARTS = np.zeros(2, np.int64)


def unique_inverse(ids):
    """Return ``(unique ids, inverse)`` of 1-D non-negative ints, as ``np.unique`` gives them."""
    ids = np.asarray(ids)
    return Dedup(len(ids))(ids)
