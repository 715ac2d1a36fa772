"""Clip gradients to a global L2 norm in place, as ``torch.nn.utils.clip_grad_norm_``.

``scale = clip_norm / (norm + 1e-6)``, applied when below 1. In sync mode each ps holds a
slice of the aggregated gradient: the ps tasks sum their squares over ``comm`` (their
job's communicator; every ps applies every step, so they meet in the same order). In
async mode a worker clips its own push, whose every variable it holds.
"""

import math

from ..runtime.backend import array_module


def clip_by_global_norm(arrays, clip_norm, comm=None):
    """Scale ``arrays`` in place so their global norm is at most ``clip_norm``; return the norm."""
    squares = 0.0
    for a in arrays:
        flat = a.reshape(-1)
        squares += float(array_module(a).vdot(flat, flat))
    if comm is not None:
        squares = comm.allreduce(squares)
    norm = math.sqrt(squares)
    scale = clip_norm / (norm + 1e-6)
    if scale < 1.0:
        for a in arrays:
            array_module(a).multiply(a, scale, out=a)
    return norm
