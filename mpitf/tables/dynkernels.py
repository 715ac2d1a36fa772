"""Compiled loops of the tables that grow: an int64 id -> slot map, routing and initial rows.

The map is open addressing with linear probing over one ``(entries, 2)`` int64 array of
(key, value) pairs (one cache line per probe; a value of -1 marks an empty entry, so
every int64 is a valid key) and backward-shift
deletion, so no tombstones pile up as rows come and go. Hashes and draws come from
splitmix64's finaliser (a counter-based generator): an id's owner ps and its initial
values are functions of the id (and the seed and table) alone, whatever the ps count or
the order in which ids arrive. Compiled as :mod:`~mpitf.tables.rowkernels` is (numba,
``cache=True``, no ``fastmath``).
"""

import math

import numpy as np
from numba import njit

from .rowkernels import AHEAD, _prefetch_row

_jit = njit(nogil=True, cache=True, error_model="numpy")
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32, _S11 = (np.uint64(s) for s in (30, 27, 31, 32, 11))
_UNIT = 1.0 / 9007199254740992.0  # 2 ** -53
EMPTY = -1  # the value of an unused entry
ADMIT = 1 << 40  # admission draws are draws (key, id, ADMIT + count): apart from the columns'


@_jit
def mix(z):
    """Return splitmix64's finaliser of uint64 ``z`` (a bijection; every bit mixed)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@_jit
def owner_of(x, num_ps):
    """Return the ps (of ``num_ps``) that holds id ``x``: a hash, not a row range."""
    return np.int64(((mix(np.uint64(x)) >> _S32) * np.uint64(num_ps)) >> _S32)


@_jit
def _slot(x, shift):
    return np.int64((np.uint64(x) * _GOLDEN) >> np.uint64(shift))


@_jit
def map_find(table, shift, ids, out):
    """Write each id's value into ``out``, -1 where absent; return how many were found.

    The entry of the id ``AHEAD`` places on is prefetched: most probes of a large map miss
    the cache, and their misses then overlap.
    """
    mask, found, n = table.shape[0] - 1, 0, ids.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            _prefetch_row(table, _slot(ids[i + AHEAD], shift), False)
        x = ids[i]
        h = _slot(x, shift)
        out[i] = EMPTY
        while table[h, 1] != EMPTY:
            if table[h, 0] == x:
                out[i] = table[h, 1]
                found += 1
                break
            h = (h + 1) & mask
    return found


@_jit
def map_put(table, shift, ids, values):
    """Set ``map[ids[i]] = values[i]``; return how many ids were already present."""
    mask, present = table.shape[0] - 1, 0
    for i in range(ids.shape[0]):
        x = ids[i]
        h = _slot(x, shift)
        while table[h, 1] != EMPTY and table[h, 0] != x:
            h = (h + 1) & mask
        present += table[h, 1] != EMPTY
        table[h, 0] = x
        table[h, 1] = values[i]
    return present


@_jit
def map_delete(table, shift, ids):
    """Remove ``ids`` (backward shift: later entries of a probe move up); return how many."""
    mask, removed = table.shape[0] - 1, 0
    for i in range(ids.shape[0]):
        x = ids[i]
        h = _slot(x, shift)
        while table[h, 1] != EMPTY and table[h, 0] != x:
            h = (h + 1) & mask
        if table[h, 1] == EMPTY:
            continue
        removed += 1
        hole = h
        j = (h + 1) & mask
        while table[j, 1] != EMPTY:
            home = _slot(table[j, 0], shift)
            # move j into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole
                                                             and home > j):
                table[hole, 0] = table[j, 0]
                table[hole, 1] = table[j, 1]
                hole = j
            j = (j + 1) & mask
        table[hole, 1] = EMPTY
    return removed


@_jit
def map_rehash(table, new, shift):
    """Insert every entry of one map into an empty larger one (``shift``: the larger's)."""
    mask = new.shape[0] - 1
    for h in range(table.shape[0]):
        if table[h, 1] != EMPTY:
            x = table[h, 0]
            j = _slot(x, shift)
            while new[j, 1] != EMPTY:
                j = (j + 1) & mask
            new[j, 0] = x
            new[j, 1] = table[h, 1]


@_jit
def map_items(table, out_keys, out_vals):
    """Write every (key, value) into the outputs in table order; return the count."""
    n = 0
    for h in range(table.shape[0]):
        if table[h, 1] != EMPTY:
            out_keys[n] = table[h, 0]
            out_vals[n] = table[h, 1]
            n += 1
    return n


@_jit
def draw(key, x, k):
    """Return a uniform float64 in [0, 1) that is a function of (``key``, id ``x``, ``k``) alone."""
    z = mix(mix(np.uint64(key) + np.uint64(x) * _GOLDEN) + np.uint64(k + 1) * _GOLDEN)
    return np.float64(z >> _S11) * _UNIT


@_jit
def init_rows(out, ids, slots, key, scale, normal):
    """Write the initial row of each ``ids[j]`` whose ``slots[j] < 0`` into ``out[j]``.

    ``uniform``: U(-scale, scale) per value; ``normal``: N(0, scale), Box-Muller on two
    draws. Each value is a draw of (key, id, its column): the same row on any ps.
    """
    dim = out.shape[1]
    for j in range(ids.shape[0]):
        if slots[j] >= 0:
            continue
        x = ids[j]
        for d in range(dim):
            if normal:
                u1 = 1.0 - draw(key, x, 2 * d)
                u2 = draw(key, x, 2 * d + 1)
                out[j, d] = scale * math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
            else:
                out[j, d] = scale * (2.0 * draw(key, x, d) - 1.0)


@_jit
def take_or_zero(src, slots, out):
    """``out[j] = src[slots[j]]``, or zeros where ``slots[j] < 0`` (rows of any element type)."""
    width = src.shape[1]
    for j in range(slots.shape[0]):
        r = slots[j]
        if r < 0:
            for d in range(width):
                out[j, d] = 0
        else:
            for d in range(width):
                out[j, d] = src[r, d]


@_jit
def hash_group(ids, num_ps, negatives, shift, table, limit, firsts, rank, offsets, unique,
               inverse):
    """Deduplicate any int64 ``ids`` and group the unique ones by owner; return ``(u, bad)``.

    ``table``: int32 indices into ``firsts`` (-1 empty on entry and return; 4 bytes an
    entry, it stays in cache). Unique ids are numbered first-seen (``firsts``, ``inverse``),
    then counting-sorted by :func:`owner_of` into ``unique`` (ps ``p``'s at ``offsets[p]:
    offsets[p + 1]``), each one's place in ``rank`` (for ``renumber``; one ps: no sort).
    ``bad``: the first negative id's index if ``negatives`` is False; -2 at ``limit``
    unique ids (double the table); else -1.
    """
    mask, u, bad = table.shape[0] - 1, 0, -1
    for i in range(ids.shape[0]):
        x = ids[i]
        if (x < 0 and not negatives) or u == limit:
            bad = i if u < limit else -2
            break
        h = _slot(x, shift)
        while True:
            k = table[h]
            if k == EMPTY:
                table[h], firsts[u], rank[u], inverse[i] = u, x, h, u
                u += 1
                break
            if firsts[k] == x:
                inverse[i] = k
                break
            h = (h + 1) & mask
    for j in range(u):
        table[rank[j]] = EMPTY
    if bad != -1:
        return 0, bad
    if num_ps == 1:  # one owner: first-seen order is the order (rank unused)
        unique[:u] = firsts[:u]
        offsets[0], offsets[1] = 0, u
        return u, -1
    offsets[:num_ps + 1] = 0
    for j in range(u):
        offsets[owner_of(firsts[j], num_ps) + 1] += 1
    for p in range(num_ps):
        offsets[p + 1] += offsets[p]
    for j in range(u):
        p = owner_of(firsts[j], num_ps)
        k = offsets[p]
        offsets[p] = k + 1
        unique[k] = firsts[j]
        rank[j] = k
    for p in range(num_ps, 0, -1):  # each count was moved one place on: back to starts
        offsets[p] = offsets[p - 1]
    offsets[0] = 0
    return u, -1


@_jit
def count_seen(table, shift, ids, slots, min_count, probability, key, admit):
    """Count each absent id (``slots[j] < 0``) once more; mark ``admit[j]`` when it gets a row.

    An id is admitted when its count reaches ``min_count`` and a draw of (key, id, count)
    falls below ``probability``: the same decision in any run. The map must have room for
    every id. Returns ``(admitted, new keys)`` (admitted ids' counts stay: the caller
    removes them).
    """
    mask, n, new = table.shape[0] - 1, 0, 0
    for j in range(ids.shape[0]):
        admit[j] = False
        if slots[j] >= 0:
            continue
        x = ids[j]
        h = _slot(x, shift)
        while table[h, 1] != EMPTY and table[h, 0] != x:
            h = (h + 1) & mask
        new += table[h, 1] == EMPTY
        c = (table[h, 1] if table[h, 1] != EMPTY else 0) + 1
        table[h, 0] = x
        table[h, 1] = c
        if c >= min_count and (probability >= 1.0 or draw(key, x, ADMIT + c) < probability):
            admit[j] = True
            n += 1
    return n, new


@_jit
def first_foreign(ids, num_ps, ps, negatives):
    """Return the index of the first id ps ``ps`` does not own (or negative, if refused), or -1."""
    for j in range(ids.shape[0]):
        x = ids[j]
        if (x < 0 and not negatives) or (num_ps > 1 and owner_of(x, num_ps) != ps):
            return j
    return -1


@_jit
def compact(slots, grads, out_slots, out_grads):
    """Copy the rows with ``slots[j] >= 0`` (and their slots) to the front; return their count."""
    k, width = 0, grads.shape[1]
    for j in range(slots.shape[0]):
        if slots[j] >= 0:
            out_slots[k] = slots[j]
            for d in range(width):
                out_grads[k, d] = grads[j, d]
            k += 1
    return k


@_jit
def touch(last_seen, uses, slots, step):
    """Note that rows ``slots`` were updated at ``step`` (once more)."""
    for j in range(slots.shape[0]):
        last_seen[slots[j]] = step
        uses[slots[j]] += 1


_warm = False


def warm_up():
    """Compile (or load from numba's cache) the kernels for the common types; once a process."""
    global _warm
    if _warm:
        return
    table = np.full((8, 2), EMPTY, np.int64)
    ids, out = np.arange(2, dtype=np.int64), np.empty(2, np.int64)
    map_put(table, 61, ids, ids)
    map_find(table, 61, ids, out)
    map_delete(table, 61, ids[:1])
    map_rehash(table, np.full((16, 2), EMPTY, np.int64), 60)
    map_items(table, np.empty(8, np.int64), np.empty(8, np.int64))
    admit = np.zeros(2, np.bool_)
    count_seen(table, 61, ids, np.full(2, -1, np.int64), 2, 1.0, 0, admit)
    touch(out.copy(), out.copy(), np.zeros(1, np.int64), 1)
    first_foreign(ids, 2, 0, True)
    for dtype in (np.float32, np.float64):
        rows = np.zeros((2, 2), dtype)
        init_rows(rows, ids, np.full(2, -1, np.int64), 1, 0.1, False)
        compact(ids, rows, out, rows.copy())
    for word in (np.uint64, np.uint32):
        w = np.zeros((2, 2), word)
        take_or_zero(w, np.array([0, -1], np.int64), w.copy())
    for num_ps in (1, 2):
        hash_group(ids, num_ps, True, 61, np.full(8, EMPTY, np.int32), 4, out.copy(),
                   out.copy(), np.empty(3, np.int64), out.copy(), np.empty(2, np.intp))
    _warm = True
