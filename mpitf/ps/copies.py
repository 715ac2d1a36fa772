"""What a copy of a ps's shard holds, in the one buffer the buddy ring sends and keeps.

:func:`state_arrays`: the shard's arrays a copy holds, in a fixed order (parameters, the
optimizer's slots, the moving average). :class:`Image`: a global step, those arrays and
then the shard's embedding tables (:mod:`mpitf.ps.table_copy`), back to back in one buffer
made once (its tables' tail grown, doubling, when a table grows). Used by
:mod:`mpitf.ps.replica` (the copies sent and kept) and :mod:`mpitf.ps.heals` (a
replacement takes its shard).
"""

import numpy as np

from . import table_copy


def state_arrays(shard):
    """Return the arrays a copy of ``shard`` holds, in a fixed order (host arrays)."""
    arrays = [shard.params] + [shard.slots[k] for k in sorted(shard.slots)]
    if shard.average_frame is not None:
        arrays.append(shard.average_frame.payload)
    return arrays


class Image:
    """One buffer holding a global step and a shard's arrays, back to back, then its tables.

    Made once; the tables' tail (:mod:`mpitf.ps.table_copy`) grows, doubling, when a
    table that grows needs more.
    """

    def __init__(self, arrays, tables=None):
        self.arrays, self.tables = arrays, tables
        self.dense = 8 + sum(a.nbytes for a in arrays)
        self._make(self.dense + table_copy.nbytes(tables))

    def _make(self, total):
        self.buffer = np.empty(total, np.uint8)
        self.step = self.buffer[:8].view(np.int64)
        self.views, offset = [], 8
        for a in self.arrays:
            self.views.append(self.buffer[offset:offset + a.nbytes].view(a.dtype))
            offset += a.nbytes
        self.tail = self.buffer[self.dense:]

    def fit(self, total):
        """Make the buffer hold ``total`` bytes (doubling; its contents are not kept)."""
        if total > len(self.buffer):
            self._make(max(total, 2 * len(self.buffer)))

    def take(self, arrays, step):
        """Copy ``arrays``, the tables and ``step`` in; return the bytes to send."""
        if self.tables is not None:
            self.fit(self.dense + table_copy.nbytes(self.tables))
        self.step[0] = step
        for view, a in zip(self.views, arrays):
            view[...] = a.ravel()
        return self.dense + table_copy.write(self.tables, self.tail)

    def give(self, arrays, tables=None):
        """Copy the image out into ``arrays`` (and ``tables``); return its step."""
        for view, a in zip(self.views, arrays):
            a.ravel()[...] = view
        table_copy.read(tables, self.tail)
        return int(self.step[0])
