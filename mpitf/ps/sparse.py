"""One ps's rows of every embedding table: answer pulls by id, apply sparse gradients.

A ps holds rows ``placement.global_ids(ps)`` of each table (in host memory, numpy), with
the optimizer's slots for the same rows. A sparse push stays in the frame it came in
(:mod:`mpitf.ps.sparse_inbox` lends the frame to its worker); the gradients are applied
when the ps applies that worker's dense push, so the consistency policy decides for both
(:meth:`apply` takes the workers whose gradients make the step).

Sparse apply is the dense kernel on the rows present: gather the rows and their slots,
run the optimizer's own arithmetic on them (its fused kernel), scatter them back; SGD
(no slots) updates the rows where they lie, with the same arithmetic. The
check of the ids, the gathers and the scatters are compiled loops over buffers made at
start-up (:class:`~mpitf.tables.shard.TableShard`, over :mod:`mpitf.tables.rowkernels`); a
push's ids are checked once, when it arrives (their local rows kept for the apply), and a
lone push's gradients are applied where they lie in the frame it came in. Rows absent
from a step keep their slots untouched; for Adam this is TensorFlow's ``LazyAdamOptimizer`` (only
present rows update ``m`` and ``v``; the bias correction follows the global step). In
sync mode each step's gradients are summed by id across workers in worker order
(:func:`~mpitf.tables.rows.segment_sum`, sequential per id) and divided by the number of
gradients, as the dense mean, so deterministic sync is bit for bit a single process's sum.
"""

import logging

import numpy as np

from ..errors import PeerError
from ..models.embedding import initial_rows
from ..tables.changes import delta_rows
from ..tables.dynamic import DynamicShard
from ..tables.rows import Dedup, segment_sum
from ..tables.shard import TableShard
from ..wire import header as H
from ..wire import protocol as P
from ..wire.sparse import SparseLayout

_log = logging.getLogger("mpitf")


def message_layout(tables, batch_size):
    """Return the :class:`SparseLayout` of the sparse messages of ``tables``."""
    return SparseLayout([(t.dim, t.dtype) for t in tables],
                        [t.max_ids(batch_size) for t in tables])


def _initial(table, placement, ps, seed, given):
    """Return ``initial(ids)``: the rows ``given`` by the chief (this ps's), else mpitf's."""
    if given is None:
        return lambda ids: initial_rows(table, seed, ids)
    return lambda ids: given[placement.local(ids, ps)]


class SparseTables:
    """Every table's rows on one ps, and the sparse pushes waiting to be applied.

    Args:
        sparse: the assignment's ``sparse`` dict: ``tables`` (EmbeddingTable objects) and
            ``batch_size`` (of one worker's step).
        ps, num_ps: this ps task and the number of ps tasks.
        optimizer: the ps's optimizer (its kernels run on the gathered rows).
        seed: the job's seed (the tables' initial values).
        num_workers: the workers that push.
    """

    def __init__(self, sparse, ps, num_ps, optimizer, seed, num_workers):
        self.specs = tuple(sparse["tables"])
        self.ps, self.optimizer, self.num_workers = ps, optimizer, num_workers
        self.layout = message_layout(self.specs, sparse["batch_size"])
        self.placements = [t.row_placement(num_ps) for t in self.specs]
        given = sparse.pop("initial", None) or {}  # the chief's rows of a table, if sent
        self.tables = [DynamicShard(t, pl, ps, optimizer, n * num_workers, seed)
                       if t.dynamic is not None else
                       TableShard(t, pl, ps, optimizer, n * num_workers,
                                  _initial(t, pl, ps, seed, given.get(t.name)))
                       for t, pl, n in zip(self.specs, self.placements, self.layout.max_ids)]
        self.messages = [None] * num_workers  # each worker's push, in the frame it came in
        self.pending = [None] * num_workers  # ... and its local rows of every table
        self.has_pending = [False] * num_workers
        self._make_buffers()

    def _make_buffers(self):
        """Make the buffers of a step's messages, for the layout's ids per table."""
        workers, max_ids = self.num_workers, self.layout.max_ids
        self.locals = [[np.empty(n, np.int64) for n in max_ids] for _ in range(workers)]
        self.replies = [self.layout.allocate(reply=True) for _ in range(workers)]
        total = [n * workers for n in max_ids]
        self.cat_ids = [np.empty(n, np.int64) for n in total]
        self.dedup = [Dedup(n) for n in total]
        self.cat_grads = [np.empty((n, t.dim), t.dtype) for n, t in zip(total, self.specs)]
        self.scratch = [np.empty(len(t.grad_buf) * t.spec.dim) for t in self.tables]

    def _fit(self, counts, message, end, describe):
        """Check a message's ids per table; grow the buffers if a step holds more than ever.

        A worker's buffers grow when its batch does (worker/embedding.py); the ps grows
        its own when a message first holds more (said once a growth): nothing is sized by
        hand, and a step within the sizes allocates nothing.
        """
        if any(c < 0 for c in counts) or end(counts) > len(message):
            raise PeerError(f"sparse message with {counts} ids per table, which its "
                            f"{len(message)} bytes do not hold", **describe)
        old = self.layout.max_ids
        if all(c <= m for c, m in zip(counts, old)):
            return
        grown = [max(m, c, 2 * m) if c > m else m for c, m in zip(counts, old)]
        self.layout = SparseLayout([(t.dim, t.dtype) for t in self.specs], grown)
        for table, n in zip(self.tables, grown):
            table.fit(n * self.num_workers, self.optimizer)
        self._make_buffers()
        _log.info("ps task %d: a sparse message of %s ids per table, more than the %s its "
                  "buffers held: they grow to %s", self.ps, counts, old, grown)

    def saved(self, step, delta=False):
        """Return this ps's rows of every table as a checkpoint writes them (at ``step``).

        ``delta``: only the rows changed since the last checkpoint (tables/changes.py).
        """
        return [delta_rows(t, step) if delta else t.saved(step) for t in self.tables]

    def checkpointed(self):
        """Forget the changed rows: a checkpoint (or a restore) holds every table now."""
        for t in self.tables:
            t.changes.clear()

    def targets(self):
        """Return this ps's tables as a restore fills them."""
        return [t.target() for t in self.tables]

    def stats(self):
        """Return {table: its shard's stats} (rows held; admitted, evicted for dynamic ones)."""
        return {t.spec.name: t.stats() for t in self.tables}

    @property
    def capacity(self):
        """Return the bytes of the largest sparse request (the pool frames take it)."""
        return self.layout.capacity

    def pull(self, worker, message, step, describe):
        """Gather the rows a pull asks for into ``worker``'s reply buffer; return the view."""
        counts = self.layout.counts(message).tolist()
        self._fit(counts, message, self.layout.ids_end, describe)
        lay, reply = self.layout, self.replies[worker]
        for table, ids, rows in zip(self.tables, lay.ids(message, counts),
                                    lay.reply_rows(reply, counts)):
            table.gather(ids, rows, describe)
        H.pack_reply(lay.header(reply), step, self.ps, 0, 0, 0, 0, 0, kind=P.SPARSE_REPLY)
        return reply[:lay.reply_end(counts)]

    def stash(self, worker, message, describe):
        """Keep a sparse push (its frame's bytes, not copied) until the policy applies it.

        Its ids are checked now; their local rows are kept for the apply (checked once).
        """
        counts = self.layout.counts(message).tolist()
        self._fit(counts, message, self.layout.end, describe)
        lay = self.layout
        self.pending[worker] = [table.locate(ids, describe, out) for table, ids, out in
                                zip(self.tables, lay.ids(message, counts), self.locals[worker])]
        self.messages[worker] = message
        self.has_pending[worker] = True
        return lay.end(counts)

    def discard(self, worker):
        """Forget ``worker``'s sparse push (its dense push was dropped as stale)."""
        self.has_pending[worker] = False

    def apply(self, workers, count, step):
        """Apply the sparse pushes of ``workers`` (summed by id in worker order) / count."""
        lay = self.layout
        present = [w for w in sorted(workers) if self.has_pending[w]]
        if not present:
            return
        parts = []
        for w in present:
            counts = lay.counts(self.messages[w]).tolist()
            parts.append((lay.ids(self.messages[w], counts), lay.rows(self.messages[w], counts),
                          self.pending[w]))
            self.has_pending[w] = False
        for t, table in enumerate(self.tables):
            local, grads = self._sum(t, [(i[t], g[t], r[t]) for i, g, r in parts])
            if len(local) == 0:
                continue
            if count > 1:
                np.divide(grads, count, out=grads)
            table.apply(self.optimizer, local, grads, step)

    def _sum(self, t, parts):
        """Return (local rows, summed rows) of one table over the parts, in their order."""
        table = self.tables[t]
        if len(parts) == 1:  # the lent frame is this ps's: divided and read in place
            _, grads, local = parts[0]
            return local, grads
        n = 0
        cat_ids, cat_grads = self.cat_ids[t], self.cat_grads[t]
        for ids, grads, _ in parts:
            cat_ids[n:n + len(ids)] = ids
            cat_grads[n:n + len(ids)] = grads
            n += len(ids)
        uids, inverse = table.unique(self.dedup[t], cat_ids[:n])
        return table.locate(uids, {}), segment_sum(cat_grads[:n], inverse,
                                                   table.grad_buf[:len(uids)], self.scratch[t])
