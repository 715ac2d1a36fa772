"""The backward of a table module's forward: each occurrence's gradient, summed per row.

torch's CPU backward of ``embedding_bag`` / ``embedding`` into the pulled rows adds
occurrence by occurrence (index_add): 35 ms on one thread for 4096 x 26 ids of 16 floats,
more than the rest of the step. :class:`RowGather` runs torch's forward on the pulled rows
and, in backward, sums each occurrence's gradient (its bag's output gradient times the
occurrence's weight: 1, 1 / the bag's size for "mean", its per_sample_weight, 0 for the
padding id) per pulled row in one compiled pass (:func:`bag_grad_rows`, in float64 in the
order of the occurrences, as ``segment_sum``) straight into the lookup's ``unique_grad``,
the sparse push. "max" keeps torch's backward.
"""

import numpy as np
import torch

__all__ = ["RowGather", "bag_grad_rows", "bag_weights", "warm_up"]

_NO_BAGS = np.zeros(0, np.int64)  # one output row per occurrence (embedding)
_ONES = np.zeros(0)  # every weight 1


def warm_up():
    """Load numba and make :func:`bag_grad_rows` its compiled pass (once).

    A table module calls this as DistributedOptimizer binds it, so no step pays for the
    import; importing mpitf.torch for a model without tables never loads numba (0.5 s of
    every process's start here).
    """
    global bag_grad_rows
    if bag_grad_rows is _compiled_on_first_call:
        from numba import njit

        bag_grad_rows = njit(nogil=True, cache=True, error_model="numpy")(_sum_rows)


def _compiled_on_first_call(*args):
    warm_up()
    return bag_grad_rows(*args)


def _sum_rows(grad_out, bag, weight, inverse, acc, out):
    """``out[inverse[i]] += grad_out[bag[i]] * weight[i]`` over the occurrences, in order.

    Summed in ``acc`` (float64, rows x dim, zeroed here) and written to ``out`` once;
    an empty ``bag`` means occurrence ``i``'s output row is ``i``, an empty ``weight`` 1.
    """
    acc[:] = 0.0
    dim = grad_out.shape[1]
    for i in range(inverse.shape[0]):
        s = inverse[i]
        b = i if bag.shape[0] == 0 else bag[i]
        w = 1.0 if weight.shape[0] == 0 else weight[i]
        for d in range(dim):
            acc[s, d] += grad_out[b, d] * w
    for s in range(out.shape[0]):
        for d in range(dim):
            out[s, d] = acc[s, d]


bag_grad_rows = _compiled_on_first_call  # numba's compiled _sum_rows after warm_up()


def bag_weights(ids, offsets, include_last_offset, mode, per_sample_weights, pad):
    """Return (each occurrence's bag, its weight in that bag) as numpy arrays.

    ``ids`` are the checked ids (numpy, 1-D with ``offsets`` or 2-D); ``pad`` the padding
    id or None. An occurrence in no bag (past the last offset) has weight 0. The weights
    are None where every one is 1 (sum, no per_sample_weights, no padding).
    """
    n = ids.size
    if ids.ndim == 2:
        bags, size = ids.shape
        bag = np.repeat(np.arange(bags), size)
    else:
        o = offsets.numpy().astype(np.int64)
        starts = o[:-1] if include_last_offset else o
        ends = o[1:] if include_last_offset else np.append(o[1:], n)
        bag = np.zeros(n, np.int64)
        end = int(ends[-1]) if len(ends) else 0
        bag[:end] = np.repeat(np.arange(len(starts)), ends - starts)
    end = n if ids.ndim == 2 else end
    if per_sample_weights is None and mode == "sum" and pad is None and end == n:
        return bag, None  # every weight 1
    weight = np.ones(n) if per_sample_weights is None else \
        per_sample_weights.detach().numpy().reshape(-1).astype(np.float64)
    weight[end:] = 0
    if pad is not None:
        weight[ids.reshape(-1) == pad] = 0
    if mode == "mean":
        counts = np.bincount(bag, weights=(weight != 0), minlength=1)
        weight = weight / np.maximum(counts, 1)[bag]
    return bag, weight


class RowGather(torch.autograd.Function):
    """``apply(rows, weights, run, lookup, bag, weight, acc, padded)``: ``run(rows, weights)``.

    ``rows`` are the pulled rows (a leaf that requires grad), ``weights`` the
    per_sample_weights or None; backward writes the rows' gradient into
    ``lookup.unique_grad`` (:func:`bag_grad_rows` over ``bag``: None for one output row per
    occurrence, as ``embedding``; ``weight``: None for 1; ``acc``: float64 scratch of at
    least rows x dim) and returns the weights' gradient when asked (none where ``padded``,
    the occurrences of the padding id, or None).
    """

    @staticmethod
    def forward(ctx, rows, weights, run, lookup, bag, weight, acc, padded=None):
        ctx.lookup, ctx.bag, ctx.weight, ctx.acc, ctx.padded = lookup, bag, weight, acc, padded
        ctx.save_for_backward(rows, weights)
        return run(rows, weights)

    @staticmethod
    def backward(ctx, grad_out):
        lookup, bag = ctx.lookup, ctx.bag
        go = grad_out.detach().contiguous().numpy()
        dim = go.shape[-1]
        go = go.reshape(-1, dim)
        out = lookup.unique_grad
        inverse = lookup.inverse.reshape(-1)
        bag_grad_rows(go, _NO_BAGS if bag is None else bag,
                      _ONES if ctx.weight is None else ctx.weight, inverse,
                      ctx.acc[:out.size].reshape(out.shape), out)
        grad_weights = None
        if ctx.needs_input_grad[1]:  # d(loss)/d(per_sample_weight): row . bag's gradient
            rows, weights = ctx.saved_tensors
            per = torch.from_numpy(go if bag is None else go[bag])
            grad_weights = (rows.detach()[torch.from_numpy(inverse)] * per).sum(1)
            if ctx.padded is not None:  # a padding id's weight gets none, as in torch
                grad_weights[torch.from_numpy(ctx.padded)] = 0
            grad_weights = grad_weights.reshape(weights.shape)
        return None, grad_weights, None, None, None, None, None, None
