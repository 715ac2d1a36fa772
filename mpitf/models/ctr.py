"""A click-through model: embeddings of categorical fields and dense features into an MLP.

Wide & deep / DLRM style, logistic loss. Batches are ``(ids, dense, y)``: ids int64
``(N, F)`` (field f's ids in ``[0, table_rows[f])``), dense float ``(N, D)`` (D may be
0), y in {0, 1}. Field f looks up table ``field{f}``; the tables live on the ps tasks
(:mod:`mpitf.models.embedding`).
"""

import numpy

from ..config import check_int
from .embedding import EmbeddingTable
from .layers import ReferenceModel, dense_stack, dense_stack_backward

__all__ = ["CTR", "logistic_loss"]


def logistic_loss(logits, y):
    """Return (mean log loss, d loss / d logits) for labels ``y`` in {0, 1}."""
    z = logits.reshape(-1)
    p = 1.0 / (1.0 + numpy.exp(-z))
    loss = numpy.logaddexp(0.0, z) - y * z
    return float(loss.mean()), ((p - y) / len(z)).astype(logits.dtype).reshape(logits.shape)


class CTR(ReferenceModel):
    """Embeddings of ``len(table_rows)`` fields + ``dense_dim`` features -> MLP -> logit.

    Variables: ``hidden{k}/weights|biases`` and ``logit/weights|biases``; tables
    ``field{f}`` of ``table_rows[f]`` x ``dim``, or, given ``growth`` (a
    :class:`~mpitf.tables.growth.Growth`), tables that grow: any int64 id, one per field
    (``table_rows`` then only counts the fields; its entries may be None).
    """

    def __init__(self, table_rows, dim=8, dense_dim=0, hidden=(32,), dtype=numpy.float32,
                 placement="mod", scale=0.05, growth=None):
        super().__init__(dtype)
        # tables that grow have no row count: None (a file of raw ids has none either)
        self.table_rows = tuple(None if growth is not None and r is None else
                                check_int("table_rows", r, 1) for r in table_rows)
        self.dim = check_int("embedding dim", dim, 1)
        self.dense_dim = check_int("dense_dim", dense_dim, 0)
        self.hidden = tuple(check_int("hidden units", h, 1) for h in hidden)
        self.growth = growth
        if growth is not None:
            self._tables = tuple(EmbeddingTable(f"field{f}", None, self.dim, self.dtype.name,
                                                scale=scale, dynamic=growth)
                                 for f in range(len(self.table_rows)))
        else:
            self._tables = tuple(EmbeddingTable(f"field{f}", r, self.dim, self.dtype.name,
                                                scale=scale, placement=placement)
                                 for f, r in enumerate(self.table_rows))
        self._layers = [f"hidden{i + 1}" for i in range(len(self.hidden))] + ["logit"]
        widths = (len(self.table_rows) * self.dim + self.dense_dim, *self.hidden, 1)
        for name, fan_in, fan_out in zip(self._layers, widths[:-1], widths[1:]):
            self._specs.append((f"{name}/weights", (fan_in, fan_out), fan_in))
            self._specs.append((f"{name}/biases", (fan_out,), None))

    def tables(self):
        """Return the embedding tables, one per field."""
        return self._tables

    def ids(self, batch):
        """Return {table: ids} of a batch ``(ids, dense, y)``."""
        ids = batch[0]
        return {t.name: ids[:, f] for f, t in enumerate(self._tables)}

    def _inputs(self, rows, dense_x):
        parts = list(rows)
        if self.dense_dim:
            parts.append(numpy.asarray(dense_x, self.dtype))
        return numpy.concatenate(parts, axis=1)

    def logits(self, params, rows, dense_x):
        """Return the logits ``(N,)`` given each field's rows ``[(N, dim)]`` and dense x."""
        return dense_stack(params, self._layers, self._inputs(rows, dense_x))[0].reshape(-1)

    def loss_and_grads(self, params, batch, grads, lookups):
        """Write the dense gradients into ``grads`` and the rows' into ``lookups``."""
        rows = [lookups[t.name].rows for t in self._tables]
        x = self._inputs(rows, batch[1])
        logits, caches = dense_stack(params, self._layers, x)
        loss, d = logistic_loss(logits, numpy.asarray(batch[2], self.dtype))
        d = dense_stack_backward(d, caches, params, self._layers, grads)
        for f, t in enumerate(self._tables):
            lookups[t.name].grad[...] = d[:, f * self.dim:(f + 1) * self.dim]
        return loss
