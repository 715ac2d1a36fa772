"""One ps's rows of one embedding table: held, located by id, gathered, updated in place.

Sparse apply is the dense optimizer's own arithmetic on the rows present: gather the rows
and their slots, run the optimizer's kernel on them, scatter them back; SGD (no slots)
updates the rows where they lie. Rows absent from a step keep their slots untouched. The
id checks, gathers and scatters are the compiled loops of :mod:`mpitf.tables.rowkernels`
over buffers made once.
"""

import numpy as np

from ..errors import PeerError
from .changes import Changes
from .rowkernels import first_outside, local_rows, sgd_rows
from .rows import cache_aligned, put_rows, take_rows

__all__ = ["TableShard"]


class TableShard:
    """The rows of one table on one ps, its optimizer's slots and the scratch of one apply.

    Args:
        spec: the table (an ``EmbeddingTable``: name, dim, dtype).
        placement: its :class:`~mpitf.tables.rows.RowPlacement`.
        ps: the ps task that holds these rows.
        optimizer: the ps's optimizer (its slots, and its kernel on the gathered rows).
        max_rows: the most rows one apply touches (every worker's ids of one step).
        initial: ``initial(ids)`` returns the initial values of global rows ``ids``.
    """

    def __init__(self, spec, placement, ps, optimizer, max_rows, initial):
        self.spec, self.placement, self.ps = spec, placement, ps
        n, dim, dtype = placement.rows_on(ps), spec.dim, np.dtype(spec.dtype)
        start = optimizer.make_slots(1, np, dtype)  # each slot's initial value
        slots = [k for k in start if not k.startswith("_")]
        try:
            self.params = cache_aligned((n, dim), dtype)
            ids = placement.global_ids(ps)
            for lo in range(0, n, 1 << 16):  # bounded scratch while drawing a large table
                self.params[lo:lo + (1 << 16)] = initial(ids[lo:lo + (1 << 16)])
            self.slots = {k: cache_aligned((n, dim), dtype, start[k][0]) for k in slots}
        except MemoryError:
            need = n * dim * dtype.itemsize * (1 + len(slots)) / 2**20
            raise MemoryError(
                f"ps task {ps} cannot hold its {n} rows of table {spec.name!r} ({need:.0f} "
                f"MiB with the optimizer's slots): split the table over more ps tasks "
                f"(--num-ps)") from None
        self.fit(max_rows, optimizer)
        self.changes = Changes(n)  # rows changed since the last checkpoint (delta ones)
        self.mod = placement.kind == "mod" and placement.num_ps > 1
        self.lo, self.hi = (0, n) if self.mod else (int(placement.starts[ps]),
                                                    int(placement.starts[ps + 1]))
        self.same = not self.mod and self.lo == 0  # local rows are the ids (one ps, say)

    def fit(self, max_rows, optimizer):
        """Make the buffers of one apply for ``max_rows`` rows (again when a step needs more)."""
        dim, dtype = self.spec.dim, self.params.dtype
        rows = min(len(self.params), max_rows)
        self.gathered = {k: v.reshape(-1, dim) if v.size else v.reshape(0, dim)
                         for k, v in optimizer.make_slots(rows * dim, np, dtype).items()}
        self.rows_buf = np.empty((rows, dim), dtype)
        self.grad_buf = np.empty((rows, dim), dtype)
        self.local = np.empty(rows, np.int64)

    def locate(self, ids, worker_desc, out=None):
        """Return the local rows of ``ids`` (in ``out``, else scratch); refuse ids not held here.

        Where local rows are the ids themselves (one ps, or the first range), ``ids`` is
        returned, checked. A message naming rows of another ps, or more rows than this ps
        holds (so some twice), is a worker's routing bug, never user data.
        """
        pl, n, out = self.placement, len(ids), self.local if out is None else out
        bad = n > len(out)
        if not bad and self.same:
            bad = first_outside(ids, 0, self.hi) >= 0
        elif not bad:
            bad = local_rows(ids, pl.rows, pl.num_ps, self.ps, self.mod, self.lo, self.hi,
                             out[:n]) >= 0
        if bad:
            raise PeerError(f"sparse message for table {self.spec.name!r} names rows this ps "
                            f"does not hold", **worker_desc)
        return ids if self.same else out[:n]

    def unique(self, dedup, ids):
        """Return ``(unique ids, inverse)`` of the ids of several pushes (ps ``_sum``)."""
        return dedup(ids, self.spec.rows)

    def saved(self, step):
        """Return this shard's rows as a checkpoint writes them (``step``: the global step)."""
        return {"spec": self.spec, "ids": self.placement.global_ids(self.ps),
                "rows": self.params, "slots": self.slots}

    def target(self):
        """Return this shard as a restore fills it."""
        return {"spec": self.spec, "placement": self.placement, "ps": self.ps,
                "rows": self.params, "slots": self.slots}

    def stats(self):
        """Return what a report says of this shard: the rows it holds."""
        return {"rows": len(self.params)}

    def gather(self, ids, out, worker_desc):
        """Write the rows of ``ids`` into ``out`` (a reply's rows)."""
        take_rows(self.params, self.locate(ids, worker_desc), out)

    def apply(self, optimizer, local, grads, step):
        """Apply row gradients ``grads`` of unique local rows ``local`` at global ``step``."""
        u, params = len(local), self.params
        self.changes.mark(local)
        if optimizer.name == "sgd" and grads.dtype == params.dtype and params.dtype in (
                np.float32, np.float64):  # no slots: the rows are updated where they lie
            sgd_rows(params, local, grads, params.dtype.type(optimizer.learning_rate(step)))
            return
        p = take_rows(self.params, local, self.rows_buf[:u])
        slots = {}
        for k, buf in self.gathered.items():
            if k in self.slots:
                take_rows(self.slots[k], local, buf[:u])
            slots[k] = buf[:u].reshape(-1)
        if hasattr(optimizer, "apply_rows"):  # a rule per row (row-wise Adagrad)
            optimizer.apply_rows(p, grads, slots, step)
        else:
            optimizer.apply(p.reshape(-1), grads.reshape(-1), slots, step)
        put_rows(self.params, local, p)
        for k in self.slots:
            put_rows(self.slots[k], local, self.gathered[k][:u])
