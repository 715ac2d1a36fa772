"""An int64 id -> int64 value map in two flat arrays, compiled, that grows by doubling.

Open addressing with linear probing over (key, value) pairs (:mod:`~mpitf.tables.dynkernels`;
a probe reads one cache line): any int64 is a key,
the load stays at most one half (a probe ends soon), and a removal shifts the entries
behind it back (no tombstones), so a map whose ids come and go stays as fast as a new one.
Its memory follows the entries it holds, never the range of the ids.
"""

import numpy as np

from . import dynkernels as K

__all__ = ["IdMap"]


class IdMap:
    """Ids to values >= 0 (a row's slot, a count): find, put, delete in batches, and items."""

    def __init__(self, capacity=1024):
        self.size = 0
        self._make(max(16, 1 << (2 * max(1, int(capacity)) - 1).bit_length()))
        K.warm_up()

    def _make(self, entries):
        self.table = np.full((entries, 2), K.EMPTY, np.int64)
        self.shift = 64 - (entries.bit_length() - 1)

    @property
    def entries(self):
        """Return the entries of the table (a power of two, at least twice :attr:`size`)."""
        return len(self.table)

    def __len__(self):
        return self.size

    def reserve(self, more):
        """Make room for ``more`` new keys at a load of at most one half (doubling)."""
        entries = self.entries
        while 2 * (self.size + more) > entries:
            entries *= 2
        if entries != self.entries:
            old = self.table
            self._make(entries)
            K.map_rehash(old, self.table, self.shift)

    def find(self, ids, out):
        """Write each id's value into ``out`` (-1 where absent); return how many were found."""
        return K.map_find(self.table, self.shift, ids, out)

    def put(self, ids, values):
        """Set each id's value (ids distinct); return how many were held already."""
        self.reserve(len(ids))
        present = K.map_put(self.table, self.shift, ids, values)
        self.size += len(ids) - present
        return present

    def delete(self, ids):
        """Remove ``ids``; return how many were held."""
        removed = K.map_delete(self.table, self.shift, ids)
        self.size -= removed
        return removed

    def items(self):
        """Return ``(ids, values)`` of every entry, ids ascending (new arrays)."""
        ids, values = np.empty(self.size, np.int64), np.empty(self.size, np.int64)
        K.map_items(self.table, ids, values)
        order = np.argsort(ids, kind="stable")
        return ids[order], values[order]
