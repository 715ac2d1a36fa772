"""``EmbeddingBag`` and ``Embedding`` whose weight lives on the ps by rows (an mpitf table).

torch's arguments and forward. Until a :class:`~mpitf.torch.DistributedOptimizer` wraps
the model, a module is torch's own (its weight a local parameter, initialised as torch's).
Wrapping makes its weight an :class:`~mpitf.models.embedding.EmbeddingTable` named by its
state_dict key (``"emb.weight"``), which every ps starts from the chief's values; the local
weight is then emptied. Each forward checks the ids, pulls the rows of the batch's unique
ids (:meth:`~mpitf.worker.session.TrainingSession.lookup`), and runs torch's
``embedding_bag`` / ``embedding`` over them with each id's index among them: backward
writes one gradient per pulled row straight into the sparse push, which ``step()`` sends
before the dense push. The ps updates the rows present only (torch's sparse SGD, Adagrad).
"""

import operator

import numpy as np
import torch
from torch.nn import functional as F

from ..errors import ConfigurationError
from . import rowgrad
from .ids import check_ids, growth_of
from .rowgrad import RowGather, bag_weights

__all__ = ["Embedding", "EmbeddingBag"]

_MODES = ("sum", "mean", "max")


class _RowTable(torch.nn.Module):
    """What both modules share: the weight, its checks, and the lookup once bound."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None,
                 scale_grad_by_freq=False, sparse=False, _weight=None, device=None,
                 dtype=None, max_ids=1 << 16, dynamic=None):
        super().__init__()
        self.dynamic = growth_of(num_embeddings, dynamic, padding_idx, _weight)
        if max_norm is not None or scale_grad_by_freq:
            raise ConfigurationError(
                "mpitf.torch tables do not support max_norm or scale_grad_by_freq (the rows "
                "live on the ps); leave them at None and False")
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigurationError(f"mpitf.torch tables live on the CPU, got device {device}")
        sizes = []
        for what, value in (("num_embeddings", 1 if self.dynamic else num_embeddings),
                            ("embedding_dim", embedding_dim), ("max_ids", max_ids)):
            try:  # any integer, numpy's too (a size read from a file), as torch takes
                size = operator.index(value)
            except TypeError:
                size = 0
            if isinstance(value, bool) or size < 1:
                raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
            sizes.append(size)
        num_embeddings, embedding_dim, max_ids = sizes
        if self.dynamic is not None:
            num_embeddings = None
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigurationError(f"padding_idx {padding_idx} is outside the "
                                         f"{num_embeddings} rows")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.sparse, self.max_ids = padding_idx, sparse, max_ids
        self.max_norm, self.scale_grad_by_freq = None, False
        if _weight is None:  # a table that grows has no rows until the ps makes them
            self.weight = torch.nn.Parameter(torch.empty((num_embeddings or 0, embedding_dim),
                                                         dtype=dtype))
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ConfigurationError("_weight must be num_embeddings x embedding_dim")
            self.weight = torch.nn.Parameter(_weight)
        self.table_name = None  # the table's name once bound (its state_dict key)
        self._front = None  # the DistributedOptimizer that bound it
        self._acc = None  # float64 scratch of the backward (rowgrad.RowGather)

    def reset_parameters(self):
        """Draw the weight as torch does: N(0, 1), the padding row zero."""
        if self.dynamic is not None:
            return  # its rows are drawn on the ps from (seed, table, id)
        torch.nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def bind(self, name, front):
        """Make the weight table ``name`` on the ps, looked up through ``front``.

        Called by DistributedOptimizer once every ps holds the rows: the local weight is
        emptied (the worker never holds the table), its Parameter kept for the optimizer.
        ``front.table_forward(module, *args)`` runs :meth:`check` and :meth:`run` (with the
        front end's ``pull(module, ids)``, which returns the ids' Lookup) where a refusal
        ends every rank; ``front.tables_forward`` does so for several tables, one pull.
        """
        self.table_name, self._front = name, front
        self.weight.data = torch.empty((0, self.embedding_dim), dtype=self.weight.dtype)
        rowgrad.warm_up()  # numba, for the backward: now, not in the first step

    def remote(self, pull, *args):
        """Check the ids, pull their rows (``pull``) and run torch's op (the bound forward)."""
        self.check(*args)
        return self.run(pull, *args)

    def _local(self):
        """Refuse a forward of a table that grows before a DistributedOptimizer binds it."""
        if self.dynamic is not None:
            raise ConfigurationError(
                "a table that grows (num_embeddings=None) has its rows on the ps only: wrap "
                "the model in mpitf.torch.DistributedOptimizer before its first forward")

    def _rows(self, input, pull, accumulate=False):
        """Pull ``input``'s rows: (unique rows as a leaf, inverse indices, padding, lookup).

        Under grad the rows require it; ``accumulate``: torch's backward adds the rows'
        gradients into ``rows.grad``, the push's buffer (else :class:`RowGather` writes
        them there).
        """
        lookup = pull(self, input.numpy())
        rows = torch.from_numpy(lookup.unique_rows)
        grad = lookup.unique_grad  # zero: what is pushed if backward never comes
        grad[...] = 0
        if torch.is_grad_enabled() and self.weight.requires_grad:  # a frozen table: zeros
            rows.requires_grad_(True)
            if accumulate:
                rows.grad = torch.from_numpy(grad)  # backward adds in place
        inverse = torch.from_numpy(lookup.inverse)
        pad = None
        if self.padding_idx is not None:
            hits = np.flatnonzero(input.numpy().reshape(-1) == self.padding_idx)
            if len(hits):
                pad = int(lookup.inverse.reshape(-1)[hits[0]])
        return rows, inverse, pad, lookup

    def _scratch(self, size):
        """Return the float64 scratch of the backward's sums, of at least ``size`` floats.

        Made on first use for ``max_ids`` rows; a step of more rows makes it twice as large.
        """
        if self._acc is None or self._acc.size < size:
            n = self.max_ids if self.dynamic else min(self.max_ids, self.num_embeddings)
            self._acc = np.empty(max(size, n * self.embedding_dim,
                                     2 * (0 if self._acc is None else self._acc.size)))
        return self._acc

    def extra_repr(self):
        text = f"{self.num_embeddings or 'dynamic'}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        return text + (f", table={self.table_name!r}" if self.table_name else "")


class EmbeddingBag(_RowTable):
    """torch.nn.EmbeddingBag whose weight the ps holds by rows (see the module docstring).

    Args: torch's (``num_embeddings``, ``embedding_dim``, ``mode``, ``padding_idx``,
    ``include_last_offset``, ``_weight``, ``dtype``; ``sparse`` is accepted and ignored,
    the rows are always updated sparsely; ``max_norm`` and ``scale_grad_by_freq`` are
    refused), and ``max_ids``: the ids one step is expected to look up in this table
    (the size of the buffers made at the start on every worker and ps; a step of more
    makes them larger, doubling, said once in the log). ``num_embeddings=None`` (or
    ``dynamic=True``, or a :class:`~mpitf.tables.growth.Growth` for admission and
    eviction): a table that grows, any int64 id, its rows made on the ps when an id is
    admitted and drawn from (seed, table, id) (U(-0.05, 0.05)).
    """

    def __init__(self, num_embeddings, embedding_dim, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, mode="mean", sparse=False, _weight=None,
                 include_last_offset=False, padding_idx=None, device=None, dtype=None,
                 max_ids=1 << 16, dynamic=None):
        if mode not in _MODES:
            raise ConfigurationError(f"mode must be one of {_MODES}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm,
                         scale_grad_by_freq, sparse, _weight, device, dtype, max_ids, dynamic)
        self.mode, self.include_last_offset, self.norm_type = mode, include_last_offset, norm_type

    def forward(self, input, offsets=None, per_sample_weights=None):
        """Return each bag's sum, mean or max of its rows (torch's ``embedding_bag``)."""
        if self._front is None:
            self._local()
            return F.embedding_bag(input, self.weight, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights,
                                   include_last_offset=self.include_last_offset,
                                   padding_idx=self.padding_idx)
        return self._front.table_forward(self, input, offsets, per_sample_weights)

    def check(self, input, offsets=None, per_sample_weights=None):
        """Refuse ids, offsets or weights torch would reject (naming the table and value)."""
        check_ids(self.table_name, self.num_embeddings, input, offsets, per_sample_weights,
                  self.include_last_offset)
        if per_sample_weights is not None and self.mode != "sum":
            raise ConfigurationError(f"table {self.table_name!r}: per_sample_weights needs "
                                     f"mode='sum', not {self.mode!r} (as torch)")

    def run(self, pull, input, offsets=None, per_sample_weights=None):
        """Pull the checked ids' rows (``pull``) and bag them."""
        rows, inverse, pad, lookup = self._rows(input, pull, accumulate=self.mode == "max")

        def run(r, w):
            return F.embedding_bag(inverse, r, offsets, mode=self.mode, per_sample_weights=w,
                                   include_last_offset=self.include_last_offset,
                                   padding_idx=pad)

        if self.mode == "max" or not rows.requires_grad:
            return run(rows, per_sample_weights)
        bag, weight = bag_weights(input.numpy(), offsets, self.include_last_offset, self.mode,
                                  per_sample_weights, self.padding_idx)
        padded = None if self.padding_idx is None or per_sample_weights is None else \
            input.numpy().reshape(-1) == self.padding_idx
        return RowGather.apply(rows, per_sample_weights, run, lookup, bag, weight,
                               self._scratch(lookup.unique_grad.size), padded)


class Embedding(_RowTable):
    """torch.nn.Embedding whose weight the ps holds by rows (see :class:`EmbeddingBag`).

    Args: torch's (``num_embeddings``, ``embedding_dim``, ``padding_idx``, ``_weight``,
    ``dtype``; ``sparse`` is accepted and ignored; ``max_norm`` and
    ``scale_grad_by_freq`` are refused), and ``max_ids`` and ``dynamic`` as for
    :class:`EmbeddingBag`.
    """

    def forward(self, input):
        """Return each id's row (``input.shape + (embedding_dim,)``)."""
        if self._front is None:
            self._local()
            return F.embedding(input, self.weight, self.padding_idx)
        return self._front.table_forward(self, input)

    def check(self, input):
        """Refuse ids torch would reject (naming the table, the id and its position)."""
        check_ids(self.table_name, self.num_embeddings, input, bag=False)

    def run(self, pull, input):
        """Pull the checked ids' rows (``pull``) and gather them."""
        rows, inverse, pad, lookup = self._rows(input, pull)
        if not rows.requires_grad:
            return F.embedding(inverse, rows, pad)
        weight = None if pad is None else (input.numpy().reshape(-1) != self.padding_idx) * 1.0
        return RowGather.apply(rows, None, lambda r, _: F.embedding(inverse, r, pad), lookup,
                               None, weight, self._scratch(lookup.unique_grad.size))
