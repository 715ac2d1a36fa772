"""Embedding tables in the buddy ring's copies (``--ps-replication-steps`` with tables).

A ps's copy of its shard (:mod:`mpitf.ps.replica`) carries, after the dense arrays, the
rows of every table it holds, written into the tail of the same send buffer:

- a fixed table (:class:`~mpitf.tables.shard.TableShard`): its rows and each optimizer
  slot, whole (their size never changes);
- a table that grows (:class:`~mpitf.tables.dynamic.DynamicShard`): a head of nine int64
  words (slots in use, free slots, entries of the admission counts' map and the ids it
  holds, rows admitted, evicted, gradients skipped, the last capacity warning, entries of
  the id map), then its
  storage as it lies: each slot's id, last step seen and uses, rows and optimizer slots
  up to the highest slot in use, the free list, and the admission counts' map table. The
  id -> slot map is not sent: the ward rebuilds it (as large) from the slots' ids when it
  adopts the copy (once), so a copy costs a few array copies and no search.

:func:`nbytes` says how many bytes the tables take now (the buffer grows, doubling, when
a table does); :func:`write` fills them; :func:`read` restores them into another ps's
tables of the same specs (the ward's, or a replacement's).
"""

import numpy as np

__all__ = ["nbytes", "write", "read", "snapshot"]

_HEAD = 9  # int64 words heading a dynamic table's part


def _grows(table):
    return hasattr(table, "map")


def _row_arrays(table, n=None):
    """Return a table's rows and its optimizer slots (up to slot ``n``), in a fixed order."""
    arrays = [table.params] + [table.slots[k] for k in sorted(table.slots)]
    return arrays if n is None else [a[:n] for a in arrays]


def _dynamic_bytes(table):
    high, row = table.high, table.params.itemsize * table.spec.dim
    counts = table.counts.entries * 16 if table.counts is not None else 0
    return 8 * _HEAD + high * (24 + row * (1 + len(table.slots))) + 8 * table.nfree + counts


def nbytes(tables):
    """Return the bytes a copy of ``tables`` (a :class:`~mpitf.ps.sparse.SparseTables`) takes."""
    if tables is None:
        return 0
    return sum(_dynamic_bytes(t) if _grows(t) else sum(a.nbytes for a in _row_arrays(t))
               for t in tables.tables)


class _Cursor:
    """Reads or writes arrays back to back in a byte buffer."""

    def __init__(self, buffer):
        self.buffer, self.offset = buffer, 0

    def view(self, nbytes, dtype):
        view = self.buffer[self.offset:self.offset + nbytes].view(dtype)
        self.offset += nbytes
        return view

    def put(self, a):
        self.view(a.nbytes, a.dtype)[...] = a.reshape(-1)

    def get(self, a):
        a.reshape(-1)[...] = self.view(a.nbytes, a.dtype)


def write(tables, buffer):
    """Write ``tables`` into ``buffer`` (uint8, :func:`nbytes` long at least); return the bytes."""
    if tables is None:
        return 0
    out = _Cursor(buffer)
    for t in tables.tables:
        if not _grows(t):
            for a in _row_arrays(t):
                out.put(a)
            continue
        counts = t.counts
        head = out.view(8 * _HEAD, np.int64)
        head[:] = (t.high, t.nfree, 0 if counts is None else counts.entries,
                   0 if counts is None else counts.size, t.admitted, t.evicted, t.skipped,
                   t.warned_at, t.map.entries)
        high = t.high
        for a in (t.ids[:high], t.last_seen[:high], t.uses[:high], *_row_arrays(t, high),
                  t.free[:t.nfree]):
            out.put(a)
        if counts is not None:
            out.put(counts.table)
    return out.offset


def read(tables, buffer):
    """Restore ``tables`` from a copy :func:`write` made of tables of the same specs."""
    if tables is None:
        return
    src = _Cursor(buffer)
    for t in tables.tables:
        if not _grows(t):
            for a in _row_arrays(t):
                src.get(a)
            continue
        high, nfree, entries, size, *counters, map_entries = (
            int(v) for v in src.view(8 * _HEAD, np.int64))
        t.admitted, t.evicted, t.skipped, t.warned_at = counters
        if t.capacity_rows < max(high, nfree):
            rows = max(1, t.capacity_rows)
            while rows < max(high, nfree):
                rows *= 2
            t.high = t.nfree = 0  # nothing of the old storage is kept
            t._grow(rows)
        t.high, t.nfree = high, nfree
        for a in (t.ids[:high], t.last_seen[:high], t.uses[:high], *_row_arrays(t, high),
                  t.free[:nfree]):
            src.get(a)
        live = np.ones(high, np.bool_)
        live[t.free[:nfree]] = False
        slots = np.flatnonzero(live).astype(np.int64)
        t.map._make(map_entries)  # as large as the sender's: the same bytes reported
        t.map.size = 0
        t.map.put(np.ascontiguousarray(t.ids[slots]), slots)
        if t.counts is not None:
            t.counts._make(entries)
            src.get(t.counts.table)
            t.counts.size = size


def snapshot(tables):
    """Return a new buffer holding a copy of ``tables`` (a hand-over to a replacement)."""
    buffer = np.empty(nbytes(tables), np.uint8)
    write(tables, buffer)
    return buffer
