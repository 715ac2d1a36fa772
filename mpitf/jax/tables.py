"""mpitf.jax tables: embedding tables on the ps, looked up by id, trained from ``jax.grad``.

A :class:`Table` is declared when the :class:`~mpitf.jax.DistributedOptimizer` is built
(its rows: the chief's ``initial``, or drawn on the ps; ``num_embeddings=None``: a table
that grows). Per step ``opt.lookup(name, ids)`` checks the ids and pulls the rows of the
unique ones now (:meth:`~mpitf.worker.session.TrainingSession.lookup`), returning them as
a jax array with each id's index among them; the loss takes the rows as an argument, so
``jax.grad`` gives one gradient per pulled row, which ``opt.step(grads,
table_grads={name: g})`` copies into the sparse push, sent before the dense push. The ps
updates the rows present only, by the rules that mean the same sparse as dense
(:func:`mpitf.worker.frontend.check_sparse_rule`).
"""

import dataclasses
import operator

import numpy as np

from ..errors import ConfigurationError
from ..models.embedding import EmbeddingTable
from ..tables.growth import Growth
from ..worker.ids import check_range

__all__ = ["Table", "TableSteps"]

@dataclasses.dataclass(frozen=True)
class Table:
    """An embedding table on the ps: ``num_embeddings`` x ``dim`` float32 rows.

    Args:
        name: the table's name (in ``lookup``, checkpoints, logs and errors).
        num_embeddings: the number of rows; None: a table that grows (see ``dynamic``).
        dim: the length of each row.
        initial: the rows (an array of that shape) every ps starts from, the chief's;
            None: drawn on the ps, U(-0.05, 0.05).
        max_ids: the ids one step is expected to look up in it (the size of the buffers
            made at the start on every rank; a step of more makes them larger, said once).
        dynamic: True, or a :class:`~mpitf.tables.growth.Growth` for admission and
            eviction: a table that grows, any int64 id, its rows drawn on the ps from
            (seed, table, id); ``num_embeddings=None`` alone means the same.
    """

    name: str
    num_embeddings: int | None
    dim: int
    initial: object = None
    max_ids: int = 1 << 16
    dynamic: Growth | bool | None = None

    def spec(self):
        """Return the :class:`~mpitf.models.embedding.EmbeddingTable` the ps holds."""
        grows = self.num_embeddings is None or self.dynamic not in (None, False)
        if grows and self.initial is not None:
            raise ConfigurationError(f"table {self.name!r} grows: it takes no initial rows "
                                     "(they are drawn on the ps from (seed, table, id))")
        dynamic = (self.dynamic if isinstance(self.dynamic, Growth) else True) if grows \
            else None
        rows, dim, most = (int(v) if isinstance(v, np.integer) else v  # a size read from
                           for v in (self.num_embeddings, self.dim, self.max_ids))  # a file
        return EmbeddingTable(self.name, None if grows else rows, dim, "float32",
                              lookups=most, dynamic=dynamic)

    def rows(self):
        """Return the chief's initial rows as float32 numpy, checked (None: drawn)."""
        if self.initial is None:
            return None
        rows = np.asarray(self.initial, dtype=np.float32)
        if rows.shape != (self.num_embeddings, self.dim):
            raise ConfigurationError(
                f"table {self.name!r}: initial rows have shape {rows.shape}, the table "
                f"({self.num_embeddings}, {self.dim})")
        return rows


def as_tables(tables):
    """Return {name: Table} of ``tables`` (Table objects, or {name: (rows, dim)})."""
    if isinstance(tables, dict):
        tables = [t if isinstance(t, Table) else Table(name, *t) for name, t in tables.items()]
    out = {}
    for t in tables:
        if not isinstance(t, Table):
            raise ConfigurationError(f"tables must be mpitf.jax.Table objects, got {t!r}")
        if t.name in out:
            raise ConfigurationError(f"two tables are named {t.name!r}")
        out[t.name] = t
    return out


class TableSteps:
    """The tables' side of each step: ids checked, rows pulled, row gradients copied."""

    def __init__(self, tables):
        self.tables = tables  # {name: Table}

    def specs(self):
        """Return the :class:`~mpitf.models.embedding.EmbeddingTable` of each table."""
        return [t.spec() for t in self.tables.values()]

    def initial(self):
        """Return the chief's initial rows of the tables given them, by name."""
        rows = {name: t.rows() for name, t in self.tables.items()}
        return {name: r for name, r in rows.items() if r is not None}

    def table(self, name):
        """Return the :class:`Table` named ``name``, or refuse naming the tables."""
        table = self.tables.get(name)
        if table is None:
            raise ConfigurationError(f"no table {name!r}: the tables are {sorted(self.tables)}")
        return table

    def ids(self, name, ids):
        """Return ``ids`` of table ``name`` as checked int64 numpy (named refusals)."""
        table = self.table(name)
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ConfigurationError(f"table {name!r}: ids must be integers, got "
                                     f"{ids.dtype.name}")
        rows = None if table.num_embeddings is None or table.dynamic not in (None, False) \
            else operator.index(table.num_embeddings)
        check_range(name, rows, ids)
        return ids.astype(np.int64, copy=False)

    @staticmethod
    def copy_grads(lookups, table_grads, step):
        """Copy ``table_grads`` ({name: d(loss)/d(rows)}) into this step's lookups' push."""
        table_grads = dict(table_grads or {})
        for name in table_grads:
            if name not in lookups:
                raise ConfigurationError(
                    f"step {step}: table_grads has table {name!r}, which was not looked up "
                    "(for training) since the last step")
        for name, lookup in lookups.items():
            if name not in table_grads:
                raise ConfigurationError(
                    f"step {step}: table {name!r} was looked up but step() got no gradient "
                    f"for its rows: pass table_grads={{{name!r}: d(loss)/d(rows)}}, or look "
                    "it up with train=False")
            grad = np.asarray(table_grads[name])
            out = lookup.unique_grad
            if grad.shape != out.shape or grad.dtype.kind != "f":
                raise ConfigurationError(
                    f"step {step}: the gradient of table {name!r} is {grad.dtype.name} "
                    f"{grad.shape}, its pulled rows float32 {out.shape}")
            np.copyto(out, grad)
