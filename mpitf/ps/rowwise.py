"""Row-wise Adagrad for tables (TorchRec's default fused optimizer), torch's Adagrad elsewhere.

A table row keeps one accumulator, the sum over steps of the mean of its squared gradient
over the row; the row moves by ``lr/(1+(t-1)*lr_decay) * g/(sqrt(acc)+eps)``, as
``torchrec.optim.RowWiseAdagrad`` and FBGEMM's ``EXACT_ROWWISE_ADAGRAD``. The accumulator
lies in the tables' ``sum`` slot, one value per element like every slot, each element of a
row holding the row's (so it is checkpointed, resharded and restored as the other slots;
it takes ``dim`` times the memory of one value per row). Dense variables take
torch.optim.Adagrad's update (:class:`~mpitf.ps.torch_optimizers.TorchAdagrad`), as a
TorchRec DLRM trains its dense layers beside its fused tables. The ps's tables call
:meth:`RowwiseAdagrad.apply_rows` with the rows as rows (:mod:`mpitf.tables.shard`).
"""

import numpy as np

from .torch_optimizers import TorchAdagrad

__all__ = ["RowwiseAdagrad"]


class RowwiseAdagrad(TorchAdagrad):
    """torch.optim.Adagrad on dense variables, row-wise Adagrad on table rows."""

    name = "rowwise_adagrad"
    _scratch = None  # (u x dim, u x 1) buffers of the row update, grown, kept between steps

    def _buffers(self, rows):
        """Return a (u x dim) and a (u x 1) scratch for ``rows``: made once, doubling."""
        u, dim = rows.shape
        have = self._scratch
        if have is None or have[0].dtype != rows.dtype or have[0].shape[1] != dim \
                or have[0].shape[0] < u:
            n = max(u, 2 * have[0].shape[0] if have is not None else 0)
            have = self._scratch = (np.empty((n, dim), rows.dtype), np.empty((n, 1), rows.dtype))
        return have[0][:u], have[1][:u]

    def apply_rows(self, rows, grads, slots, step):
        """Update ``rows`` (u x dim, in place) from ``grads`` row-wise; ``slots`` flat views."""
        acc = slots["sum"].reshape(rows.shape)
        if self.weight_decay:
            grads = grads + self.weight_decay * rows
        work, per_row = self._buffers(rows)
        np.square(grads, out=work)
        np.mean(work, axis=1, keepdims=True, dtype=rows.dtype, out=per_row)
        np.add(acc, per_row, out=acc)
        np.sqrt(acc[:, :1], out=per_row)
        per_row += self.eps
        clr = self.learning_rate(step) / (1.0 + step * self.lr_decay)
        np.divide(grads, per_row, out=work)  # addcdiv's order: g / std, then times the rate
        work *= -clr
        rows += work
