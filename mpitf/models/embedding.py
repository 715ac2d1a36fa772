"""The sparse variable kind: an embedding table that lives on the ps tasks, split by rows.

A model with tables adds two methods to the protocol (see :mod:`mpitf.models`)::

    tables() -> [EmbeddingTable]                     # the sparse variables
    ids(batch) -> {table name: int64 array}          # the rows this batch looks up
    loss_and_grads(params, batch, grads, lookups)    # lookups[name]: worker.embedding.Lookup

A :class:`~mpitf.worker.embedding.Lookup` gives each occurrence's row (``.rows``, the
model writes ``.grad``) or the pulled rows (``.unique_rows``, ``.inverse``; the model
writes ``.unique_grad``), whichever the model's layers need.

A worker never holds a whole table: it pulls the rows a batch uses. Row ``i``'s initial
value is a function of (seed, table name, i) alone: rows are drawn in blocks of
:data:`INIT_BLOCK` rows, block ``b`` from Philox keyed by ``SeedSequence((seed,
crc32(name), b))``, so any number of ps tasks starts from the same table.
"""

import zlib
from dataclasses import dataclass

import numpy as np

from ..config import check_choice, check_int, check_number
from ..errors import ConfigurationError
from ..tables.rows import ROW_PLACEMENTS, RowPlacement

INIT_BLOCK = 4096
INITIALIZERS = ("uniform", "normal", "zeros")


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding table: ``rows`` x ``dim`` values of ``dtype``.

    ``initializer``: "uniform" (U(-scale, scale), the default), "normal" (N(0, scale))
    or "zeros". ``lookups``: how many ids of this table one example looks up at most (a
    table shared by several fields looks up one per field); a step's buffers are made for
    ``batch_size * lookups`` unique ids. ``placement``: how rows are split over the ps
    tasks, "mod" (row i on ps i % P, the default) or "range" (see :mod:`mpitf.tables.rows`).
    """

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"
    scale: float = 0.05
    lookups: int = 1
    placement: str = "mod"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"a table needs a non-empty name, got {self.name!r}")
        check_int(f"table {self.name!r} rows", self.rows, 1)
        check_int(f"table {self.name!r} dim", self.dim, 1)
        check_int(f"table {self.name!r} lookups", self.lookups, 1)
        check_choice(f"table {self.name!r} initializer", self.initializer, INITIALIZERS)
        check_number(f"table {self.name!r} scale", self.scale, low=0.0)
        check_choice(f"table {self.name!r} placement", self.placement, ROW_PLACEMENTS)
        if np.dtype(self.dtype).kind != "f":
            raise ConfigurationError(
                f"table {self.name!r} needs a floating dtype, got {self.dtype!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)

    @property
    def itemsize(self):
        """Return the bytes of one value."""
        return np.dtype(self.dtype).itemsize

    def max_ids(self, batch_size):
        """Return the most unique ids one batch of ``batch_size`` examples can look up."""
        return min(self.rows, batch_size * self.lookups)


def initial_rows(table, seed, ids):
    """Return the initial values of rows ``ids`` (ascending int64) of ``table``.

    Each block of :data:`INIT_BLOCK` rows that holds one of ``ids`` is drawn whole, so a
    row's value does not depend on which other rows are asked for.
    """
    out = np.empty((len(ids), table.dim), table.dtype)
    if table.initializer == "zeros" or len(ids) == 0:
        out[...] = 0
        return out
    key = zlib.crc32(table.name.encode())
    blocks = ids // INIT_BLOCK
    starts = np.flatnonzero(np.diff(blocks, prepend=-1))
    for k, lo in enumerate(starts):
        hi = starts[k + 1] if k + 1 < len(starts) else len(ids)
        b = int(blocks[lo])
        gen = np.random.Generator(np.random.Philox(np.random.SeedSequence((seed, key, b))))
        n = min(INIT_BLOCK, table.rows - b * INIT_BLOCK)
        if table.initializer == "uniform":
            block = gen.uniform(-table.scale, table.scale, (n, table.dim))
        else:
            block = gen.normal(0.0, table.scale, (n, table.dim))
        out[lo:hi] = block[ids[lo:hi] - b * INIT_BLOCK]
    return out


def check_tables(tables):
    """Return ``tables`` as a tuple, refusing a repeated name."""
    tables = tuple(tables)
    names = [t.name for t in tables]
    for t in tables:
        if not isinstance(t, EmbeddingTable):
            raise ConfigurationError(f"tables() must list EmbeddingTable objects, got {t!r}")
    if len(set(names)) != len(names):
        raise ConfigurationError(f"table names must be unique, got {names}")
    return tables


def split_rows(tables, num_ps, initial):
    """Return, for each of ``num_ps`` ps tasks, {table: its rows} of the ``initial`` tables.

    ``initial``: {table name: all its rows} (a torch module's weight, say), which each ps
    starts from instead of :func:`initial_rows`; a ps gets only the rows it holds.
    """
    out = [{} for _ in range(num_ps)]
    for t in tables:
        if t.name in initial:
            pl = RowPlacement(t.rows, num_ps, t.placement)
            for p in range(num_ps):
                rows = initial[t.name] if num_ps == 1 else initial[t.name][pl.global_ids(p)]
                out[p][t.name] = np.ascontiguousarray(rows, t.dtype)
    return out
