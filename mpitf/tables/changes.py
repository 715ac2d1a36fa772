"""The rows of one ps's table changed since the last checkpoint, for delta checkpoints.

:class:`Changes` holds a mark per row (per slot of a table that grows), made once with the
shard and grown with its storage, so marking a step's rows allocates nothing; ids evicted
since the last checkpoint are kept too (eviction is rare: at a checkpoint, every
``evict_every`` steps, past a capacity). :func:`delta_rows` gives what a delta checkpoint
writes of a shard; :func:`apply_delta` puts a delta's rows (and evictions) into a shard on
restore, under any ps count.
"""

import numpy as np

from .idmap import IdMap

__all__ = ["Changes", "apply_delta", "delta_rows", "reset_counts"]


class Changes:
    """Which rows of a shard changed since the last checkpoint, and the ids evicted since."""

    def __init__(self, rows):
        self.marks = np.zeros(rows, np.bool_)
        self.evicted = []  # arrays of ids

    def grow(self, rows):
        """Hold a mark for ``rows`` rows (the shard's storage grew), keeping the marks."""
        marks = np.zeros(rows, np.bool_)
        marks[:len(self.marks)] = self.marks
        self.marks = marks

    def mark(self, rows):
        """Mark local rows (slots) ``rows`` changed."""
        self.marks[rows] = True

    def evict(self, ids):
        """Record that ``ids`` lost their rows."""
        if len(ids):
            self.evicted.append(np.array(ids, np.int64))

    def clear(self):
        """Forget the changes: a checkpoint (full or delta) or a restore holds them."""
        self.marks[:] = False
        self.evicted.clear()


def delta_rows(shard, step):
    """Return a shard's rows changed since its last checkpoint, as a checkpoint writes them.

    A fixed table: ``ids``, ``rows``, ``slots`` of the marked rows. A table that grows:
    the rows held now that changed (made, updated or restored), with ``state/last_seen``
    and ``state/uses``; ``evicted``: the ids evicted since that hold no row now; and the
    counts of ids not admitted yet, whole (``pending/...``). Stale rows are evicted first,
    as a full checkpoint does.
    """
    if not hasattr(shard, "map"):
        rows = np.flatnonzero(shard.changes.marks)
        return {"spec": shard.spec, "ids": _global_ids(shard.placement, shard.ps, rows),
                "rows": shard.params[rows],
                "slots": {k: v[rows] for k, v in shard.slots.items()}}
    shard.evict_stale(step)
    ids, slots = shard.map.items()
    changed = shard.changes.marks[slots]
    ids, slots = ids[changed], slots[changed]
    evicted = np.unique(np.concatenate([np.empty(0, np.int64)] + shard.changes.evicted))
    held = np.empty(len(evicted), np.int64)
    shard.map.find(evicted, held)
    extra = {"state/last_seen": shard.last_seen[slots], "state/uses": shard.uses[slots],
             "evicted": evicted[held < 0]}
    if shard.counts is not None:
        extra["pending/ids"], extra["pending/counts"] = shard.counts.items()
    return {"spec": shard.spec, "ids": ids, "rows": shard.params[slots],
            "slots": {k: v[slots] for k, v in shard.slots.items()}, "extra": extra}


def _global_ids(placement, ps, rows):
    """Return the table rows of ps ``ps``'s local rows ``rows`` (not every row's: a delta)."""
    if placement.kind == "mod":
        return rows * placement.num_ps + ps
    return rows + int(placement.starts[ps])


def apply_delta(shard, ids, values, evicted=None):
    """Put a delta's rows ``ids`` (this shard's) with ``values`` into a dynamic shard.

    ``values`` as :meth:`~mpitf.tables.dynamic.DynamicShard.restore` takes them. The ids in
    ``evicted`` lose their rows first; an id held already takes the delta's values, a new
    one gets a row.
    """
    ids = np.ascontiguousarray(ids, np.int64)
    if evicted is not None and len(evicted):
        evicted = np.ascontiguousarray(evicted, np.int64)
        slots = np.empty(len(evicted), np.int64)
        shard.map.find(evicted, slots)
        gone = slots >= 0
        shard._evict(evicted[gone], slots[gone])
    slots = np.empty(len(ids), np.int64)
    shard.map.find(ids, slots)
    old = slots >= 0
    at = slots[old]
    shard.params[at] = values["rows"][old]
    for k, v in shard.slots.items():
        if k in values["slots"]:
            v[at] = values["slots"][k][old]
    for k in ("last_seen", "uses"):
        if f"state/{k}" in values:
            getattr(shard, k)[at] = values[f"state/{k}"][old]
    new = ~old
    if new.any():
        shard.restore(ids[new], {k: ({s: a[new] for s, a in v.items()} if k == "slots"
                                     else v[new]) for k, v in values.items()})


def reset_counts(shard):
    """Forget a dynamic shard's counts of ids not admitted yet (a delta holds them whole)."""
    if shard.counts is not None:
        shard.counts = IdMap(1024)
