"""One ps's rows of a table that grows: an id -> slot map over row storage that doubles.

A row is made when its id is admitted (:class:`~mpitf.tables.growth.Growth`): with every
id admitted, the first time a gradient reaches it (a pull of an id without a row reads
its initial values, drawn on the fly, so pulls never change the table and a fixed table
and a dynamic one train the same bits); with a minimum count or a probability, when the
step's pushes bring its count there (it read zeros until then: that step's gradient is
counted, not applied). Rows are evicted after ``evict_after_steps`` without a gradient
(every ``evict_every`` steps, else at each checkpoint) and, the least used first, beyond
``capacity`` rows (a warning with the numbers). Evicted slots go on a free list; memory
grows with the rows held (storage and map double), never with the range of the ids.
"""

import logging

import numpy as np

from ..errors import CheckpointError, PeerError
from . import dynkernels as K
from .changes import Changes
from .hashing import init_key, initial_values
from .idmap import IdMap
from .rowkernels import row_words
from .rows import cache_aligned, put_rows
from .shard import TableShard

__all__ = ["DynamicShard"]

_log = logging.getLogger("mpitf")
START_ROWS = 1024


class DynamicShard(TableShard):
    """The rows one ps holds of a dynamic table, their slots, ages, uses and counters.

    Args: as :class:`~mpitf.tables.shard.TableShard`'s, with ``seed`` (the initial values'
    draws) for ``initial``.
    """

    def __init__(self, spec, placement, ps, optimizer, max_rows, seed):
        self.spec, self.placement, self.ps = spec, placement, ps
        self.growth, self.key = spec.dynamic, init_key(seed, spec.name)
        dim, dtype = spec.dim, np.dtype(spec.dtype)
        start = optimizer.make_slots(1, np, dtype)
        self.slot_start = {k: start[k][0] for k in start if not k.startswith("_")}
        self.map = IdMap(START_ROWS)
        self.counts = None if self.growth.admits_all else IdMap(START_ROWS)
        self.capacity_rows, self.high, self.nfree = 0, 0, 0
        self.params = cache_aligned((0, dim), dtype)
        self.slots = {k: cache_aligned((0, dim), dtype) for k in self.slot_start}
        self.ids, self.last_seen, self.uses, self.free = (np.empty(0, np.int64) for _ in range(4))
        self.changes = Changes(0)  # slots changed since the last checkpoint (delta ones)
        self._grow(START_ROWS)
        self.fit(max_rows, optimizer)
        self.admitted = self.evicted = self.skipped = 0
        self.warned_at = 0  # the rows evicted for capacity when last said (doubling: not a flood)

    # -- storage ---------------------------------------------------------------------------

    def fit(self, max_rows, optimizer):
        """Make the buffers of one apply for ``max_rows`` rows (again when a step needs more)."""
        dim, dtype = self.spec.dim, self.params.dtype
        rows = max(1, int(max_rows))
        self.gathered = {k: v.reshape(-1, dim) if v.size else v.reshape(0, dim)
                         for k, v in optimizer.make_slots(rows * dim, np, dtype).items()}
        self.rows_buf, self.grad_buf = np.empty((rows, dim), dtype), np.empty((rows, dim), dtype)
        self.local, self.found = np.empty(rows, np.int64), np.empty(rows, np.int64)
        self.admit = np.empty(rows, np.bool_)
        self.compact_grads = np.empty((rows, dim), dtype)

    def _grow(self, rows):
        """Make the row storage hold ``rows`` rows (copying the slots in use)."""
        n, dim, dtype = self.high, self.spec.dim, self.params.dtype
        params = cache_aligned((rows, dim), dtype)
        params[:n] = self.params[:n]
        self.params = params
        for k, v in self.slots.items():
            grown = cache_aligned((rows, dim), dtype)
            grown[:n] = v[:n]
            self.slots[k] = grown
        for name in ("ids", "last_seen", "uses"):
            grown = np.zeros(rows, np.int64)
            grown[:n] = getattr(self, name)[:n]
            setattr(self, name, grown)
        free = np.empty(rows, np.int64)
        free[:self.nfree] = self.free[:self.nfree]
        self.free, self.capacity_rows = free, rows
        self.changes.grow(rows)

    def _alloc(self, n):
        """Return ``n`` free slots: evicted ones first, then new ones (storage doubles)."""
        reuse = min(n, self.nfree)
        out = np.empty(n, np.int64)
        out[:reuse] = self.free[self.nfree - reuse:self.nfree][::-1]
        self.nfree -= reuse
        more = n - reuse
        if self.high + more > self.capacity_rows:
            rows = self.capacity_rows
            while self.high + more > rows:
                rows *= 2
            self._grow(rows)
        out[reuse:] = np.arange(self.high, self.high + more)
        self.high += more
        return out

    def _make(self, ids, step, values=None):
        """Give each of ``ids`` (new, distinct) a slot; return the slots.

        Their rows are ``values`` (a dict as :meth:`saved` gives) or initial ones.
        """
        slots = self._alloc(len(ids))
        if values is None:
            rows = np.empty((len(ids), self.spec.dim), self.params.dtype)
            initial_values(rows, ids, self.key, self.spec.initializer, self.spec.scale)
            put_rows(self.params, slots, rows)
            for k, v in self.slots.items():
                v[slots] = self.slot_start[k]
            self.last_seen[slots], self.uses[slots] = step, 0
        else:
            self.params[slots] = values["rows"]
            for k, v in self.slots.items():
                v[slots] = values["slots"].get(k, self.slot_start[k])
            self.last_seen[slots] = values.get("state/last_seen", step)
            self.uses[slots] = values.get("state/uses", 0)
        self.ids[slots] = ids
        self.changes.mark(slots)
        if self.map.put(ids, slots):
            raise CheckpointError(f"table {self.spec.name!r}: an id is saved twice")
        return slots

    def _evict(self, ids, slots):
        self.changes.evict(ids)
        self.map.delete(ids)
        self.free[self.nfree:self.nfree + len(slots)] = slots
        self.nfree += len(slots)
        self.evicted += len(slots)

    # -- the TableShard interface -----------------------------------------------------------

    def locate(self, ids, worker_desc, out=None):
        """Check that this ps owns every id; return the ids (their slots are found at apply)."""
        g = self.growth
        if len(ids) > len(self.found) or K.first_foreign(
                ids, self.placement.num_ps, self.ps, g.negative_ids) >= 0:
            raise PeerError(f"sparse message for table {self.spec.name!r} names ids this ps "
                            f"does not hold", **worker_desc)
        return ids

    def unique(self, dedup, ids):
        """Return ``(unique ids, inverse)`` of the ids of several pushes (any int64)."""
        unique, _, _ = dedup.group(ids, 1)
        return unique, dedup.finish()

    def gather(self, ids, out, worker_desc):
        """Write the rows of ``ids`` into ``out``: held rows, else initial values or zeros."""
        self.locate(ids, worker_desc)
        found = self.found[:len(ids)]
        held = self.map.find(ids, found)
        K.take_or_zero(row_words(self.params), found, row_words(out))
        if held < len(ids) and self.growth.admits_all:  # as the row will start
            initial_values(out, ids, self.key, self.spec.initializer, self.spec.scale, found)

    def apply(self, optimizer, ids, grads, step):
        """Apply row gradients of unique ``ids``, admitting ids first; then evict if due."""
        n = len(ids)
        found = self.found[:n]
        if self.map.find(ids, found) < n:
            self._admit(ids, found, step)
            m = K.compact(found, grads, self.local[:n], self.compact_grads[:n])
            self.skipped += n - m
            found, grads = self.local[:m], self.compact_grads[:m]
        K.touch(self.last_seen, self.uses, found, step)
        if len(found):
            super().apply(optimizer, found, grads, step)
        self._after(step)

    def _admit(self, ids, found, step):
        """Make the rows of the absent ids admitted now (every one, or by count)."""
        missing = found < 0
        if self.counts is None:
            found[missing] = self._make(ids[missing], step)
            self.admitted += int(missing.sum())
            return
        c, g, admit = self.counts, self.growth, self.admit[:len(ids)]
        c.reserve(int(missing.sum()))
        n, new = K.count_seen(c.table, c.shift, ids, found, g.admit_min_count,
                              g.admit_probability, self.key, admit)
        c.size += new
        if n:
            chosen = ids[admit]
            c.delete(chosen)
            self._make(chosen, step)  # from the next step: this one read zeros
            self.admitted += n

    def _after(self, step):
        g = self.growth
        if g.evict_after_steps and g.evict_every and step % g.evict_every == 0:
            self.evict_stale(step)
        if g.capacity and len(self.map) > g.capacity:
            self.evict_least_used(step)

    # -- eviction --------------------------------------------------------------------------

    def evict_stale(self, step):
        """Evict the rows no gradient reached for ``evict_after_steps`` steps."""
        if not self.growth.evict_after_steps or not len(self.map):
            return
        ids, slots = self.map.items()
        old = step - self.last_seen[slots] >= self.growth.evict_after_steps
        if old.any():
            self._evict(ids[old], slots[old])

    def evict_least_used(self, step):
        """Evict the least used rows (then the oldest, then the smallest ids) beyond capacity.

        Says so (a warning with the numbers) the first time, then each time the evictions
        in all have doubled.
        """
        held, cap = len(self.map), self.growth.capacity
        ids, slots = self.map.items()
        order = np.lexsort((ids, self.last_seen[slots], self.uses[slots]))[:held - cap]
        self._evict(ids[order], slots[order])
        if self.evicted < 2 * self.warned_at:
            return
        self.warned_at = self.evicted
        _log.warning("ps task %d, table %r: capacity of %d rows reached at step %d: evicted "
                     "the %d least used (held %d, admitted %d, evicted %d in all)", self.ps,
                     self.spec.name, cap, step, held - cap, len(self.map), self.admitted,
                     self.evicted)

    # -- checkpoints and reports -------------------------------------------------------------

    def saved(self, step):
        """Evict what is due, then return the rows held by id (ascending), slots, ages, counts."""
        self.evict_stale(step)
        ids, slots = self.map.items()
        extra = {"state/last_seen": self.last_seen[slots], "state/uses": self.uses[slots]}
        if self.counts is not None:
            extra["pending/ids"], extra["pending/counts"] = self.counts.items()
        return {"spec": self.spec, "ids": ids, "rows": self.params[slots],
                "slots": {k: v[slots] for k, v in self.slots.items()}, "extra": extra}

    def target(self):
        """Return this shard as a restore fills it (by id, through :meth:`restore`)."""
        return {"spec": self.spec, "placement": self.placement, "ps": self.ps, "dynamic": self}

    def restore(self, ids, values):
        """Hold rows ``ids`` with their ``rows``, ``slots`` and ``state/...`` from a checkpoint."""
        self._make(np.ascontiguousarray(ids, np.int64), 0, values)

    def restore_counts(self, ids, counts):
        """Take the counts of ids not admitted yet from a checkpoint."""
        if self.counts is not None and len(ids):
            self.counts.put(np.ascontiguousarray(ids, np.int64),
                            np.ascontiguousarray(counts, np.int64))

    def stats(self):
        """Return the rows held, admitted, evicted, gradients skipped, and bytes of storage."""
        per_row = self.params.itemsize * self.spec.dim * (1 + len(self.slots)) + 8 * 4
        return {"rows": len(self.map), "admitted": self.admitted, "evicted": self.evicted,
                "skipped": self.skipped, "pending": len(self.counts or ()),
                "bytes": self.capacity_rows * per_row + self.map.entries * 16
                + (self.counts.entries * 16 if self.counts is not None else 0)}
