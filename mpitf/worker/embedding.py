"""A worker's embedding lookups: pull the rows a batch uses, push their summed gradients.

Per step and table: the batch's ids are deduplicated once
(:func:`~mpitf.rows.unique_inverse`), grouped by the ps that holds them
(:class:`~mpitf.rows.RowPlacement`), and each ps gets one sparse pull with its ids in
every table and answers their rows, all ps at once, nonblocking. The model runs forward
and backward on the rows of each
occurrence (:class:`Lookup`); the row gradients are summed per unique id and pushed with
their ids, one message per ps, just before the dense push (same tag, so MPI keeps them in
order and the ps applies both under one policy decision). Buffers are made once for the
largest batch (``batch_size * lookups`` ids per table); messages are views of them. A
worker never holds more of a table than one batch's rows.
"""

import numpy as np

from ..errors import DataError, PeerError
from ..models.embedding import check_tables
from ..rows import RowPlacement, segment_sum, unique_inverse
from ..wire import header as H
from ..wire import protocol as P
from ..wire.sparse import SparseLayout


class Lookup:
    """One table's lookups in a batch: ``rows`` (ids.shape + (dim,)) to read, ``grad`` to fill.

    The model writes d(loss)/d(row) of every occurrence into ``grad`` (every element);
    the worker sums them per unique id.
    """

    __slots__ = ("ids", "rows", "grad")

    def __init__(self, ids, rows, grad):
        self.ids, self.rows, self.grad = ids, rows, grad


class _TableState:
    """One table's buffers and the routing of the current batch."""

    def __init__(self, spec, num_ps, batch_size):
        self.spec = spec
        self.placement = RowPlacement(spec.rows, num_ps, spec.placement)
        self.max_ids = spec.max_ids(batch_size)
        occurrences = batch_size * spec.lookups
        self.rows = np.zeros((self.max_ids, spec.dim), spec.dtype)
        self.grads = np.zeros((self.max_ids, spec.dim), spec.dtype)
        self.occ_rows = np.zeros((occurrences, spec.dim), spec.dtype)
        self.occ_grads = np.zeros((occurrences, spec.dim), spec.dtype)
        self.routed = self.inverse = self.offsets = None
        self.shape = ()

    def route(self, ids):
        """Deduplicate and group ``ids`` by ps; return the number of occurrences."""
        spec, flat = self.spec, ids.reshape(-1)
        if flat.size > len(self.occ_rows):
            raise DataError(f"table {spec.name!r}: a batch looks up {flat.size} ids, more than "
                            f"batch_size x lookups = {len(self.occ_rows)}; raise the table's "
                            "lookups")
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= spec.rows:
                bad = lo if lo < 0 else hi
                raise DataError(f"table {spec.name!r}: id {bad} is outside [0, {spec.rows}) "
                                "(ids are never wrapped or clipped)")
        uids, inverse = unique_inverse(flat)
        order, self.offsets = self.placement.route(uids)
        self.routed = uids[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        self.inverse = rank[inverse.reshape(-1)]
        self.shape = ids.shape
        return flat.size


class Embeddings:
    """The embedding tables of a worker's model, pulled and pushed through ``client``.

    Args:
        client: the worker's :class:`~mpitf.worker.client.Client` (communicator, ps ranks,
            deadline, ps steps).
        tables: the model's :class:`~mpitf.models.embedding.EmbeddingTable` list.
        batch_size: examples per step (the buffers are made for it).
    """

    def __init__(self, client, tables, batch_size):
        self.client = client
        self.specs = check_tables(tables)
        num_ps = len(client.ps_ranks)
        self.batch_size = batch_size
        self.tables = [_TableState(t, num_ps, batch_size) for t in self.specs]
        self.layout = SparseLayout([(t.dim, t.dtype) for t in self.specs],
                                   [t.max_ids for t in self.tables])
        self.requests = [self.layout.allocate() for _ in range(num_ps)]
        self.replies = [self.layout.allocate(reply=True) for _ in range(num_ps)]
        self.counts = np.zeros((num_ps, len(self.specs)), np.int64)
        self.sends = []
        self.lookups = {}
        self.bytes_sent = self.bytes_received = 0

    @property
    def assignment(self):
        """Return what every ps needs to hold its rows (the PsAssignment's ``sparse``)."""
        return {"tables": self.specs, "batch_size": self.batch_size}

    def lookup(self, ids):
        """Pull the rows of ``ids`` ({table: int array}); return {table: :class:`Lookup`}."""
        self._wait_sends()
        lay, client = self.layout, self.client
        values = []
        for t, table in enumerate(self.tables):
            value = ids.get(table.spec.name) if isinstance(ids, dict) else None
            if value is None:
                raise DataError(f"the model's ids(batch) gave no ids for table "
                                f"{table.spec.name!r}")
            value = np.asarray(value)
            if value.dtype.kind not in "iu":
                raise DataError(f"table {table.spec.name!r}: ids must be integers, got "
                                f"{value.dtype.name}")
            table.route(value)
            values.append(value)
            self.counts[:, t] = np.diff(table.offsets)
        receives, sends = [], []
        for p, rank in enumerate(client.ps_ranks):
            buf, counts = self.requests[p], self.counts[p]
            lay.counts(buf)[...] = counts
            for table, dest in zip(self.tables, lay.ids(buf, counts)):
                dest[...] = table.routed[table.offsets[p]:table.offsets[p + 1]]
            H.pack_request(lay.header(buf), P.SPARSE_PULL, client.ps_steps[p], client.worker,
                           int(counts.sum()), client.request_flags)
            end = lay.ids_end(counts)
            receives.append(P.frame_op(client.comm.Irecv, self.replies[p], rank,
                                       P.TAG_SPARSE_REPLY))
            sends.append(P.frame_op(client.comm.Isend, buf[:end], rank, P.TAG_REQUEST))
            self.bytes_sent += end
        nps = len(client.ps_ranks)
        P.wait_all(receives + sends, client.deadline,
                   lambda i: dict(client._describe_ps(i % nps), operation="sparse pull"))
        for p in range(nps):
            reply = self.replies[p]
            if H.unpack_reply(lay.header(reply)).kind != P.SPARSE_REPLY:
                raise PeerError("unexpected answer to a sparse pull", **client._describe_ps(p))
            self.bytes_received += lay.reply_end(self.counts[p])
            for table, rows in zip(self.tables, lay.reply_rows(reply, self.counts[p])):
                table.rows[table.offsets[p]:table.offsets[p + 1]] = rows
        self.lookups = {}
        for table, value in zip(self.tables, values):
            k, dim = len(table.inverse), table.spec.dim
            occ = np.take(table.rows[:table.offsets[-1]], table.inverse, axis=0,
                          out=table.occ_rows[:k])
            self.lookups[table.spec.name] = Lookup(
                value, occ.reshape(table.shape + (dim,)),
                table.occ_grads[:k].reshape(table.shape + (dim,)))
        return self.lookups

    def reduce(self):
        """Sum each table's occurrence gradients per unique id (after the backward pass)."""
        for table in self.tables:
            n, k = table.offsets[-1], len(table.inverse)
            segment_sum(table.occ_grads[:k], table.inverse, table.grads[:n])

    def nonfinite(self):
        """Return the name of a table whose row gradients hold NaN or Inf, or None."""
        for table in self.tables:
            if not np.isfinite(np.add.reduce(table.grads[:table.offsets[-1]], axis=None)):
                if not np.isfinite(table.grads[:table.offsets[-1]]).all():
                    return table.spec.name
        return None

    def push(self):
        """Start sending every ps its ids and their summed row gradients (nonblocking).

        Call it just before the dense push: the ps applies both when it handles that one.
        """
        lay, client = self.layout, self.client
        for p, rank in enumerate(client.ps_ranks):
            buf, counts = self.requests[p], self.counts[p]
            for table, dest in zip(self.tables, lay.rows(buf, counts)):
                dest[...] = table.grads[table.offsets[p]:table.offsets[p + 1]]
            H.pack_request(lay.header(buf), P.SPARSE_PUSH, client.ps_steps[p], client.worker,
                           int(counts.sum()), client.request_flags)
            end = lay.end(counts)
            self.sends.append(P.frame_op(client.comm.Isend, buf[:end], rank, P.TAG_REQUEST))
            self.bytes_sent += end

    def _wait_sends(self):
        if self.sends:
            nps = len(self.client.ps_ranks)
            P.wait_all(self.sends, self.client.deadline, lambda i: dict(
                self.client._describe_ps(i % nps), operation="sparse push"))
            self.sends = []
