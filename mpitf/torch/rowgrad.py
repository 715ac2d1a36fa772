"""The backward of a table module's forward: each occurrence's gradient, summed per row.

torch's CPU backward of ``embedding_bag`` / ``embedding`` into the pulled rows adds
occurrence by occurrence (index_add): 35 ms on one thread for 4096 x 26 ids of 16 floats,
more than the rest of the step. :class:`RowGather` runs torch's forward on the pulled rows
and, in backward, writes each occurrence's gradient (its bag's output gradient times the
occurrence's weight: 1, 1 / the bag's size for "mean", its per_sample_weight, 0 for the
padding id) into the lookup's per-occurrence buffer
(:attr:`~mpitf.worker.embedding.Lookup.grad`); the session sums it per pulled row
(compiled, in float64: 2.5 ms) into the sparse push. "max" keeps torch's backward.
"""

import numpy as np
import torch

__all__ = ["RowGather", "bag_weights"]


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
    """``apply(rows, weights, run, lookup, bag, weight)``: ``run(rows, weights)`` forward.

    ``rows`` are the pulled rows (a leaf that requires grad), ``weights`` the
    per_sample_weights or None; backward writes ``lookup.grad`` (each occurrence: its
    output row's gradient, from ``bag`` (None: one output row per occurrence, as
    ``embedding``), times ``weight``) and returns the weights' gradient when asked.
    """

    @staticmethod
    def forward(ctx, rows, weights, run, lookup, bag, weight):
        ctx.lookup, ctx.bag, ctx.weight = lookup, bag, weight
        ctx.save_for_backward(rows, weights)
        return run(rows, weights)

    @staticmethod
    def backward(ctx, grad_out):
        lookup, bag, weight = ctx.lookup, ctx.bag, ctx.weight
        go = grad_out.detach().contiguous().numpy()
        dim = go.shape[-1]
        out = lookup.grad.reshape(-1, dim)
        per = go.reshape(-1, dim) if bag is None else go[bag]
        if weight is None:
            out[...] = per
        else:
            np.multiply(per, weight[:, None], out=out, casting="unsafe")
        grad_weights = None
        if ctx.needs_input_grad[1]:  # d(loss)/d(per_sample_weight): row . bag's gradient
            rows, _ = ctx.saved_tensors
            inverse = torch.from_numpy(lookup.inverse.reshape(-1))
            grad_weights = (rows.detach()[inverse] * torch.from_numpy(per)).sum(1)
            grad_weights = grad_weights.reshape(ctx.saved_tensors[1].shape)
        return None, grad_weights, None, None, None, None
