"""The sparse messages: a pull of rows by id and a push of row gradients, laid out here.

One message each way per ps and step. A request (``SPARSE_PULL``, ``SPARSE_PUSH``) is a
frame on the request tag, so MPI keeps it in order with the dense push that follows it::

    [header | count of table 0 .. T-1 (int64) | ids of table 0, 1, ... (int64)
            | rows of table 0 (count_0 x dim_0), rows of table 1, ...]     (push only)

The header's ``count`` word holds the number of ids in all; the pull sends the message
up to the ids, the push the whole (the ids again, so a push stands on its own). The
answer to a pull (``SPARSE_REPLY``, on its own tag) is ``[header | rows of table 0, ...]``
in the order of the ids asked for. Both sides preallocate one buffer for the largest
batch and send views of it; nothing here allocates per step.
"""

import numpy as np

from .header import HEADER_BYTES


def _align(n, to=8):
    return -(-n // to) * to


class SparseLayout:
    """Where each part of a sparse message lies, for tables of the given dims and dtypes.

    Args:
        tables: ``[(dim, dtype)]``, one per table, in the model's order.
        max_ids: the most ids of each table one message carries.
    """

    def __init__(self, tables, max_ids):
        self.dims = [int(d) for d, _ in tables]
        self.dtypes = [np.dtype(t) for _, t in tables]
        self.max_ids = [int(n) for n in max_ids]
        self.num_tables = len(self.dims)
        self.ids_start = HEADER_BYTES + 8 * self.num_tables
        self.capacity = self.end(self.max_ids)
        self.reply_capacity = self.reply_end(self.max_ids)

    def ids_end(self, counts):
        """Return the byte where the ids end (a pull request's size)."""
        return self.ids_start + 8 * int(sum(counts))

    def end(self, counts):
        """Return a push's size in bytes."""
        end = _align(self.ids_end(counts))
        for n, d, t in zip(counts, self.dims, self.dtypes):
            end = _align(end, t.itemsize) + int(n) * d * t.itemsize
        return end

    def reply_end(self, counts):
        """Return a reply's size in bytes."""
        end = HEADER_BYTES
        for n, d, t in zip(counts, self.dims, self.dtypes):
            end = _align(end, t.itemsize) + int(n) * d * t.itemsize
        return end

    def counts(self, buf):
        """Return the per-table counts written in message ``buf`` (a uint8 array)."""
        return buf[HEADER_BYTES:self.ids_start].view(np.int64)

    def ids(self, buf, counts):
        """Return the ids of each table in ``buf`` (views)."""
        out, pos = [], self.ids_start
        for n in counts:
            out.append(buf[pos:pos + 8 * int(n)].view(np.int64))
            pos += 8 * int(n)
        return out

    def _rows(self, buf, counts, start):
        out, pos = [], start
        for n, d, t in zip(counts, self.dims, self.dtypes):
            pos = _align(pos, t.itemsize)
            size = int(n) * d * t.itemsize
            out.append(buf[pos:pos + size].view(t).reshape(int(n), d))
            pos += size
        return out

    def rows(self, buf, counts):
        """Return the row gradients of each table in a push ``buf`` (views)."""
        return self._rows(buf, counts, _align(self.ids_end(counts)))

    def reply_rows(self, buf, counts):
        """Return the rows of each table in a reply ``buf`` (views)."""
        return self._rows(buf, counts, HEADER_BYTES)

    def header(self, buf):
        """Return the int64 header words of message ``buf`` (a view)."""
        return buf[:HEADER_BYTES].view(np.int64)

    def allocate(self, reply=False):
        """Return a zeroed uint8 buffer for the largest request (or reply), 8-byte aligned."""
        n = self.reply_capacity if reply else self.capacity
        return np.zeros(_align(n) // 8, np.int64).view(np.uint8)
