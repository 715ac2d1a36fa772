"""A worker's embedding lookups: pull the rows a batch uses, push their summed gradients.

Per step and table: the batch's ids are deduplicated in one compiled pass
(:meth:`~mpitf.tables.rows.Dedup.start`), which checks their range and sorts the unique ids'
keys (:meth:`~mpitf.tables.rows.RowPlacement.keys`, numbering each ps's rows together), so they
come grouped by the ps that holds them; each ps gets one sparse pull with its ids in
every table and answers their rows, all ps at once, nonblocking; while they travel, each
id's index among the unique ids is found (:meth:`~mpitf.tables.rows.Dedup.finish`). The model
runs forward and backward on the pulled rows (:class:`Lookup`): per occurrence
(``rows``, ``grad``: gathered and summed per id by the worker) or per pulled row
(``unique_rows``, ``inverse``, ``unique_grad``). The summed row gradients are pushed
with their ids, one message per ps, just before the dense push (same tag, so MPI keeps
them in order and the ps applies both under one policy decision). Buffers are made once
for the batch declared (``batch_size * lookups`` ids per table) and grow, doubling and
said in the log, when a step looks up more (the ps's follow); messages are views of
them; with one ps the model reads the rows in the reply and writes their gradients into
the push itself (no copy either way). A worker never holds more of a table than one
batch's rows.
"""

import logging

import numpy as np

from ..errors import DataError, PeerError
from ..models.embedding import check_tables, split_rows
from ..tables.rows import Dedup, all_finite, segment_sum, take_rows
from ..wire import header as H
from ..wire import protocol as P
from ..wire.sparse import SparseLayout
from .sparse_routes import wait_each

_log = logging.getLogger("mpitf")


class Lookup:
    """One table's lookups in a batch, and where the model writes its gradient.

    ``unique_rows`` (u x dim) are the pulled rows, ``inverse`` (the shape of ``ids``) the
    index of each id's row among them. The model writes d(loss)/d(row) in one of two ways
    (every element): per occurrence into ``grad`` (ids.shape + (dim,)), summed per id by
    :meth:`summed`; or per pulled row into ``unique_grad``, which saves the gather of
    ``rows`` and the sum when the model can work on the pulled rows themselves. ``rows``
    (each occurrence's row) is gathered the first time it is read.
    """

    __slots__ = ("ids", "unique_rows", "inverse", "_unique_grad", "_rows_buf", "_grad_buf",
                 "_scratch", "_rows", "_grad", "_wrote_unique")

    def __init__(self, ids, unique_rows, inverse, unique_grad=None, rows_buf=None,
                 grad_buf=None, scratch=None):
        self.ids, self.unique_rows = ids, unique_rows
        self.inverse = inverse.reshape(np.shape(ids))
        self._unique_grad = np.zeros_like(unique_rows) if unique_grad is None else unique_grad
        self._rows_buf, self._grad_buf, self._scratch = rows_buf, grad_buf, scratch
        self._rows = self._grad = None
        self._wrote_unique = False

    def _occurrences(self, buf):
        shape = (self.inverse.size, self.unique_rows.shape[1])
        buf = np.empty(shape, self.unique_rows.dtype) if buf is None else buf[:shape[0]]
        return buf.reshape(self.inverse.shape + shape[1:])

    @property
    def rows(self):
        """Return each occurrence's row (ids.shape + (dim,)), gathered on first use."""
        if self._rows is None:
            out = self._occurrences(self._rows_buf)
            take_rows(np.ascontiguousarray(self.unique_rows), self.inverse.reshape(-1),
                      out.reshape(-1, out.shape[-1]))
            self._rows = out
        return self._rows

    @property
    def grad(self):
        """Return the buffer for each occurrence's row gradient (the model fills it)."""
        if self._grad is None:
            self._grad = self._occurrences(self._grad_buf)
        return self._grad

    @property
    def unique_grad(self):
        """Return the buffer for each pulled row's gradient (the model fills it)."""
        self._wrote_unique = True
        return self._unique_grad

    def summed(self, name="table"):
        """Return the row gradients summed per pulled row (u x dim)."""
        if self._grad is not None:
            return segment_sum(self._grad.reshape(-1, self._grad.shape[-1]),
                               self.inverse.reshape(-1), self._unique_grad, self._scratch)
        if not self._wrote_unique:
            raise DataError(f"the model wrote no gradient for table {name!r}: fill "
                            "lookups[name].grad (per id looked up) or .unique_grad (per "
                            "pulled row) in loss_and_grads")
        return self._unique_grad


class _TableState:
    """One table's buffers and the routing of the current batch.

    ``pulled`` and ``summed`` are the current batch's rows and their gradients (u x dim):
    with one ps, views of the reply and of the push (nothing copied); else ``rows`` and
    ``grads``, gathered from and scattered to each ps's messages.
    """

    def __init__(self, spec, num_ps, occurrences):
        self.spec = spec
        self.placement = spec.row_placement(num_ps)  # rows by range or mod, or ids by hash
        self.occurrences = occurrences  # the ids one step may look up (more: it grows)
        self.max_ids = occurrences if spec.rows is None else min(spec.rows, occurrences)
        self.dedup = Dedup(occurrences)
        self.rows = np.zeros((self.max_ids, spec.dim), spec.dtype)
        self.grads = np.zeros((self.max_ids, spec.dim), spec.dtype)
        self.occ_rows = np.zeros((occurrences, spec.dim), spec.dtype)
        self.occ_grads = np.zeros((occurrences, spec.dim), spec.dtype)
        self.scratch = np.empty(self.max_ids * spec.dim)  # float64 sums per id, pages on use
        self.keys = self.inverse = self.offsets = self.pulled = self.summed = None

    def route(self, ids):
        """Deduplicate ``ids`` and group them by ps; the inverse waits for :meth:`number`."""
        spec, flat = self.spec, ids.reshape(-1)
        self.keys, self.offsets, bad = self.placement.route(self.dedup, flat)
        self.inverse = None  # numbered by number(), while the pulls travel
        if bad >= 0:
            raise DataError(self.placement.refusal(spec.name, int(flat[bad])))

    def number(self):
        """Find each id's index among the unique ids (the inverse), once the pulls are sent."""
        self.inverse = self.dedup.finish()

    def ids_to(self, p, out):
        """Write the ids ps ``p`` holds of this batch into ``out``."""
        keys = self.keys[self.offsets[p]:self.offsets[p + 1]]
        return self.placement.ids_of_keys(keys, p, out)

    def lookup(self, ids):
        """Return the :class:`Lookup` of ``ids`` over the pulled rows."""
        return Lookup(ids, self.pulled, self.inverse, self.summed, self.occ_rows,
                      self.occ_grads, self.scratch)


class Embeddings:
    """The embedding tables of a worker's model, pulled and pushed over ``link``.

    Args:
        link: the worker's :class:`~mpitf.worker.link.PsLink` (communicator, ps ranks,
            request flags, deadline, ps steps).
        tables: the model's :class:`~mpitf.models.embedding.EmbeddingTable` list.
        batch_size: examples per step (the buffers are made for it).
    """

    def __init__(self, link, tables, batch_size):
        self.link = link
        self.specs = check_tables(tables)
        num_ps = len(link.ranks)
        self.batch_size = batch_size
        self.tables = [_TableState(t, num_ps, batch_size * t.lookups) for t in self.specs]
        self._make_messages()
        self.counts = np.zeros((num_ps, len(self.specs)), np.int64)
        self.sends = []
        self.lookups = {}  # this step's, until the push
        self.packed = True  # the requests hold every table's ids (one lookup of them all)
        self.bytes_sent = self.bytes_received = 0
        self.ends = [0] * num_ps  # per ps, the bytes of its last sparse request
        if link.replicated:  # a lost ps's push goes again to its buddy (sparse_routes.py)
            link.on_reroute.append(self._rerouted)

    def _make_messages(self):
        """Make the sparse messages' layout and buffers for the tables' sizes."""
        num_ps = len(self.link.ranks)
        self.layout = SparseLayout([(t.dim, t.dtype) for t in self.specs],
                                   [t.max_ids for t in self.tables])
        self.requests = [self.layout.allocate() for _ in range(num_ps)]
        self.replies = [self.layout.allocate(reply=True) for _ in range(num_ps)]

    def _grow(self, t, ids):
        """Make table ``t``'s buffers hold a step of ``ids`` ids (doubling), and say so.

        A step within the sizes allocates nothing; the ps grows its own when a message
        first holds more (ps/sparse.py). Called between steps' sends (none in flight).
        """
        table = self.tables[t]
        grown = max(ids, 2 * table.occurrences)
        state = _TableState(table.spec, len(self.link.ranks), grown)
        self.tables[t] = state
        self._make_messages()
        _log.warning("worker %d: table %r looked up %d ids in a step, more than its "
                     "buffers held (%d): they grow to %d ids, here and on the ps",
                     self.link.worker, table.spec.name, ids, table.occurrences, grown)

    @property
    def assignment(self):
        """Return what every ps needs to hold its rows (the PsAssignment's ``sparse``)."""
        return {"tables": self.specs, "batch_size": self.batch_size}

    def assignments(self, initial):
        """Return each ps's ``sparse`` assignment, starting from its rows of ``initial``."""
        return [{**self.assignment, "initial": rows}
                for rows in split_rows(self.specs, len(self.link.ranks), initial)]

    def lookup(self, ids, partial=False):
        """Pull the rows of ``ids`` ({table: int array}); return {table: :class:`Lookup`}.

        ``partial``: ``ids`` may name some tables only (a front end that looks tables up
        one by one, in forward): the others keep this step's earlier lookup, if any; the
        rows are then copied out of the replies, and :meth:`push` packs every table's.
        """
        self._wait_sends()
        lay, link = self.layout, self.link
        values, chosen = [], []
        for t, table in enumerate(self.tables):
            value = ids.get(table.spec.name) if isinstance(ids, dict) else None
            if value is None and partial:
                self.counts[:, t] = 0
                continue
            if value is None:
                raise DataError(f"the model's ids(batch) gave no ids for table "
                                f"{table.spec.name!r}")
            value = np.asarray(value)
            if value.dtype.kind not in "iu":
                raise DataError(f"table {table.spec.name!r}: ids must be integers, got "
                                f"{value.dtype.name}")
            if value.dtype != np.int64:
                value = value.astype(np.int64)
            if value.size > table.occurrences:
                self._grow(t, value.size)
                table = self.tables[t]
            table.route(value)
            values.append(value)
            chosen.append(table)
            self.counts[:, t] = np.diff(table.offsets)
        whole = len(chosen) == len(self.tables)
        receives, sends = [], []
        for p, rank in enumerate(link.ranks):
            buf, counts = self.requests[p], self.counts[p]
            lay.counts(buf)[...] = counts
            for table, dest in zip(self.tables, lay.ids(buf, counts)):
                if table in chosen:
                    table.ids_to(p, dest)
            H.pack_sparse_pull(lay.header(buf), link.steps[p], link.worker, int(counts.sum()),
                               link.flags | link.ward_flags[p])
            end = self.ends[p] = lay.ids_end(counts)
            receives.append(P.frame_op(link.comm.Irecv, self.replies[p], rank,
                                       link.sparse_tag(p)))
            sends.append(P.frame_op(link.comm.Isend, buf[:end], rank, P.TAG_REQUEST))
            self.bytes_sent += end
        for table in chosen:
            table.number()
        nps = len(link.ranks)
        if link.replicated:  # a lost ps's pull is asked again at its buddy
            wait_each(link, receives, sends, "sparse pull", self._resend_pull)
        else:
            P.wait_all(receives + sends, link.deadline,
                       lambda i: link.describe(i % nps, "sparse pull"))
        self.packed = whole  # the requests hold every looked-up table's ids
        for p in range(nps):
            reply = self.replies[p]
            if H.unpack_reply(lay.header(reply)).kind != P.SPARSE_REPLY:
                raise PeerError("unexpected answer to a sparse pull", **link.describe(p))
            self.bytes_received += lay.reply_end(self.counts[p])
            rows = lay.reply_rows(reply, self.counts[p])
            if nps == 1 and whole:  # the reply's rows and the push's are the batch's: no copies
                grads = lay.rows(self.requests[0], self.counts[0])
                for table, r, g in zip(self.tables, rows, grads):
                    table.pulled, table.summed = r, g
                continue
            for table, r in zip(self.tables, rows):
                if table in chosen:
                    table.rows[table.offsets[p]:table.offsets[p + 1]] = r
        if nps > 1 or not whole:
            for table in chosen:
                n = table.offsets[-1]
                table.pulled, table.summed = table.rows[:n], table.grads[:n]
        found = {t.spec.name: t.lookup(v) for t, v in zip(chosen, values)}
        self.lookups = {**self.lookups, **found} if partial else found
        return found

    def forget(self, name):
        """Leave table ``name``'s lookup of this step out of the push (an evaluation's)."""
        self.lookups.pop(name, None)
        self.packed = False

    def reduce(self):
        """Sum each table's gradients per pulled row (after the backward pass)."""
        for name, lookup in self.lookups.items():
            lookup.summed(name)

    def nonfinite(self):
        """Return the name of a table whose row gradients hold NaN or Inf, or None."""
        for table in self.tables:
            if table.spec.name in self.lookups and not all_finite(table.summed):
                return table.spec.name
        return None

    def push(self):
        """Start sending every ps its ids and their summed row gradients (nonblocking).

        Call it just before the dense push: the ps applies both when it handles that one.
        """
        lay, link = self.layout, self.link
        for t, table in enumerate(self.tables if not self.packed else ()):  # table by table
            self.counts[:, t] = np.diff(table.offsets) if table.spec.name in self.lookups else 0
        for p, rank in enumerate(link.ranks):
            buf, counts = self.requests[p], self.counts[p]
            if not self.packed:
                lay.counts(buf)[...] = counts
                for table, dest in zip(self.tables, lay.ids(buf, counts)):
                    if len(dest):
                        table.ids_to(p, dest)
            if len(link.ranks) > 1 or not self.packed:  # else the model wrote into the push
                for table, dest in zip(self.tables, lay.rows(buf, counts)):
                    if len(dest):
                        dest[...] = table.grads[table.offsets[p]:table.offsets[p + 1]]
            H.pack_sparse_push(lay.header(buf), link.steps[p], link.worker, int(counts.sum()),
                               link.flags | link.ward_flags[p])
            end = self.ends[p] = lay.end(counts)
            self.sends.append(P.frame_op(link.comm.Isend, buf[:end], rank, P.TAG_REQUEST))
            self.bytes_sent += end
        self.lookups, self.packed = {}, False  # a push without a lookup sends no rows

    def _wait_sends(self):
        if self.sends:
            link, sends = self.link, self.sends
            self.sends = []  # answered or not, this push is not sent again
            if link.replicated:
                wait_each(link, None, sends, "sparse push")
                return
            nps = len(link.ranks)
            P.wait_all(sends, link.deadline, lambda i: link.describe(i % nps, "sparse push"))

    def _resend(self, p):
        """Send ps ``p``'s last sparse request again, marked, to its (new) rank."""
        link, buf = self.link, self.requests[p]
        H.mark_ward(self.layout.header(buf))
        return P.frame_op(link.comm.Isend, buf[:self.ends[p]], link.ranks[p], P.TAG_REQUEST)

    def _resend_pull(self, p):
        link = self.link
        receive = P.frame_op(link.comm.Irecv, self.replies[p], link.ranks[p], link.sparse_tag(p))
        return receive, self._resend(p)

    def _rerouted(self, p):
        """(The link's hook) ps ``p`` was lost: this step's push to it goes to its buddy."""
        if self.sends:
            self.sends[p] = self._resend(p)
