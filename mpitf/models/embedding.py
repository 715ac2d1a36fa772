"""The sparse variable kind: an embedding table that lives on the ps tasks, split by rows.

A model with tables adds two methods to the protocol (see :mod:`mpitf.models`)::

    tables() -> [EmbeddingTable]                     # the sparse variables
    ids(batch) -> {table name: int64 array}          # the rows this batch looks up
    loss_and_grads(params, batch, grads, lookups)    # lookups[name]: worker.embedding.Lookup

A :class:`~mpitf.worker.embedding.Lookup` gives each occurrence's row (``.rows``, the
model writes ``.grad``) or the pulled rows (``.unique_rows``, ``.inverse``; the model
writes ``.unique_grad``), whichever the model's layers need.

A worker never holds a whole table: it pulls the rows a batch uses. Row ``i``'s initial
value is a function of (seed, table name, i) alone, a counter-based draw per value
(:func:`~mpitf.tables.hashing.initial_values`), so any number of ps tasks starts from the
same table, and a table that grows (``rows=None``: any int64 id, a row made on a ps when
its id is admitted; see :class:`~mpitf.tables.growth.Growth`) makes the same rows as a
fixed one.
"""

from dataclasses import dataclass

import numpy as np

from ..config import check_choice, check_int, check_number
from ..errors import ConfigurationError
from ..tables.growth import Growth
from ..tables.hashing import HashPlacement, init_key, initial_values
from ..tables.rows import ROW_PLACEMENTS, RowPlacement

INITIALIZERS = ("uniform", "normal", "zeros")


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding table: ``rows`` x ``dim`` values of ``dtype`` (``rows`` None: it grows).

    Args:
        name: the table's name (in checkpoints, logs and errors).
        rows: the number of rows; None: a table that grows (see ``dynamic``).
        dim: the length of each row.
        dtype: the rows' dtype.
        initializer: "uniform" (U(-scale, scale), the default), "normal" (N(0, scale))
            or "zeros".
        scale: the initializer's scale.
        lookups: how many ids of this table one example looks up at most (a table shared
            by several fields looks up one per field); a step's buffers are made for
            ``batch_size * lookups`` unique ids.
        placement: how rows are split over the ps tasks, "mod" (row i on ps i % P, the
            default) or "range" (see :mod:`mpitf.tables.rows`).
        dynamic: True or a :class:`~mpitf.tables.growth.Growth` (admission, eviction) for
            a table that grows (``rows`` must then be None, which alone means the same):
            any int64 id, row ``x`` on the ps a hash of ``x`` names (``placement`` is
            then "hash").
    """

    name: str
    rows: int | None
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"
    scale: float = 0.05
    lookups: int = 1
    placement: str = "mod"
    dynamic: Growth | bool | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"a table needs a non-empty name, got {self.name!r}")
        growth = self.dynamic
        if growth is not None and growth is not False and self.rows is not None:
            raise ConfigurationError(f"table {self.name!r} grows (dynamic=...): leave its rows "
                                     f"None, got rows={self.rows}")
        if self.rows is None:
            growth = Growth() if growth in (None, True, False) else growth
            if not isinstance(growth, Growth):
                raise ConfigurationError(f"table {self.name!r}: dynamic must be True or a "
                                         f"Growth, got {growth!r}")
            object.__setattr__(self, "dynamic", growth)
            object.__setattr__(self, "placement", "hash")
        else:
            object.__setattr__(self, "dynamic", None)
            check_int(f"table {self.name!r} rows", self.rows, 1)
        check_int(f"table {self.name!r} dim", self.dim, 1)
        check_int(f"table {self.name!r} lookups", self.lookups, 1)
        check_choice(f"table {self.name!r} initializer", self.initializer, INITIALIZERS)
        check_number(f"table {self.name!r} scale", self.scale, low=0.0)
        if self.dynamic is None:
            check_choice(f"table {self.name!r} placement", self.placement, ROW_PLACEMENTS)
        if np.dtype(self.dtype).kind != "f":
            raise ConfigurationError(
                f"table {self.name!r} needs a floating dtype, got {self.dtype!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if self.dynamic is not None and self.dtype not in ("float32", "float64"):
            raise ConfigurationError(f"table {self.name!r} grows: it needs float32 or float64, "
                                     f"got {self.dtype}")

    @property
    def itemsize(self):
        """Return the bytes of one value."""
        return np.dtype(self.dtype).itemsize

    def max_ids(self, batch_size):
        """Return the most unique ids one batch of ``batch_size`` examples can look up."""
        n = batch_size * self.lookups
        return n if self.rows is None else min(self.rows, n)

    def row_placement(self, num_ps):
        """Return where the rows live over ``num_ps`` ps tasks (RowPlacement, HashPlacement)."""
        if self.dynamic is not None:
            return HashPlacement(num_ps, self.dynamic.negative_ids)
        return RowPlacement(self.rows, num_ps, self.placement)


def initial_rows(table, seed, ids):
    """Return the initial values of rows ``ids`` (int64) of ``table``.

    Each value is a draw of (seed, table name, id, its column) alone: the same whichever
    other rows are asked for, on any ps, for a fixed table and one that grows.
    """
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty((len(ids), table.dim), table.dtype)
    return initial_values(out, ids, init_key(seed, table.name), table.initializer, table.scale)


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
