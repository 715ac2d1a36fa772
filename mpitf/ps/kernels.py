"""Fused optimizer kernels for a ps's host (numpy) buffers: one pass over memory per chunk.

Each kernel updates the parameters and the optimizer's slots of elements ``[lo, hi)`` in one
loop, compiled by numba (``nogil``: a :class:`~mpitf.ps.threads.KernelPool` runs chunks on
several threads at once). The arithmetic is the reference ufunc passes of
:mod:`mpitf.ps.optimizers`, operation for operation in the buffers' dtype, with the
hyper-parameters rounded to that dtype as numpy rounds a Python float: the results are the
same bits (no ``fastmath``: no reassociation, no fused multiply-add).

A kernel is ``kernel(lo, hi, params, grad, reply, *slots, *scalars)``; :data:`FUSED` maps
an optimizer's name to ``(slot names, scalars(optimizer, step) -> (kernel, scalars))``. A
new optimizer (AdamW, RMSprop, weight decay) is one kernel and one entry. The gradient may
arrive in a wire dtype (bfloat16, float16: converted to float32 as it is read), and the
kernel may write the new parameters, rounded, into ``reply`` in a wire dtype as well
(:mod:`mpitf.wire.convert`); with a float32 gradient and no reply it is the same arithmetic.
"""

import math

import numpy as np
from numba import njit

from ..wire.convert import WIRE_DTYPES, part, store, widen, wire_view

__all__ = ["FUSED", "fused_apply", "warm_up"]

# error_model="numpy": a division by zero gives inf/nan as the ufuncs do, not an exception.
_jit = njit(nogil=True, cache=True, fastmath=False, parallel=False, error_model="numpy")


@_jit
def _sgd(lo, hi, p, g, r, lr):
    p, g, r = p[lo:hi], g[lo:hi], part(r, lo, hi)  # slices: the loop runs from 0, vectorized
    for i in range(p.shape[0]):
        x = p[i] - widen(g[i]) * lr
        p[i] = x
        store(r, i, x)


@_jit
def _momentum(lo, hi, p, g, r, a, lr, mu):
    p, g, r, a = p[lo:hi], g[lo:hi], part(r, lo, hi), a[lo:hi]
    for i in range(p.shape[0]):
        ai = a[i] * mu + widen(g[i])
        a[i] = ai
        x = p[i] - ai * lr
        p[i] = x
        store(r, i, x)


@_jit
def _nesterov(lo, hi, p, g, r, a, lr, mu):
    p, g, r, a = p[lo:hi], g[lo:hi], part(r, lo, hi), a[lo:hi]
    for i in range(p.shape[0]):
        gi = widen(g[i])
        ai = a[i] * mu + gi
        a[i] = ai
        x = p[i] - (ai * mu + gi) * lr
        p[i] = x
        store(r, i, x)


@_jit
def _adam(lo, hi, p, g, r, m, v, c1, c2, eps, lr_t):
    p, g, r, m, v = p[lo:hi], g[lo:hi], part(r, lo, hi), m[lo:hi], v[lo:hi]
    for i in range(p.shape[0]):
        gi, mi, vi = widen(g[i]), m[i], v[i]
        mi = mi + (gi - mi) * c1
        vi = vi + (gi * gi - vi) * c2
        m[i] = mi
        v[i] = vi
        x = p[i] - (mi / (np.sqrt(vi) + eps)) * lr_t
        p[i] = x
        store(r, i, x)


@_jit
def _adagrad(lo, hi, p, g, r, a, lr):
    p, g, r, a = p[lo:hi], g[lo:hi], part(r, lo, hi), a[lo:hi]
    for i in range(p.shape[0]):
        gi = widen(g[i])
        ai = a[i] + gi * gi
        a[i] = ai
        x = p[i] - (gi / np.sqrt(ai)) * lr
        p[i] = x
        store(r, i, x)


@_jit
def _ftrl(lo, hi, p, g, r, accum, linear, lr, l2x2, l1):
    p, g, r = p[lo:hi], g[lo:hi], part(r, lo, hi)
    accum, linear = accum[lo:hi], linear[lo:hi]
    for i in range(p.shape[0]):
        gi, a_old = widen(g[i]), accum[i]
        a_new = gi * gi + a_old
        lin = linear[i] + gi
        old_pow, new_pow = np.sqrt(a_old), np.sqrt(a_new)  # accum ** -learning_rate_power
        lin = lin - ((new_pow - old_pow) / lr) * p[i]
        quadratic = new_pow / lr + l2x2
        c = lin  # clip(lin, -l1, l1), NaN kept
        if c < -l1:
            c = -l1
        elif c > l1:
            c = l1
        linear[i] = lin
        x = (c - lin) / quadratic
        p[i] = x
        accum[i] = a_new
        store(r, i, x)


def _sgd_scalars(opt, step, t):
    return _sgd, (t(opt.learning_rate(step)),)


def _torch_sgd_scalars(opt, step, t):
    # torch.optim.SGD without momentum or weight decay is plain SGD: its passes (the
    # gradient times the rate, then subtracted) round as ``_sgd`` does
    if opt.momentum or opt.weight_decay:
        return None, ()
    return _sgd_scalars(opt, step, t)


def _momentum_scalars(opt, step, t):
    kernel = _nesterov if opt.use_nesterov else _momentum
    return kernel, (t(opt.learning_rate(step)), t(opt.momentum))


def _adam_scalars(opt, step, t):
    b1, b2, n = opt.beta1, opt.beta2, step + 1
    lr_t = opt.learning_rate(step) * math.sqrt(1.0 - b2**n) / (1.0 - b1**n)
    return _adam, (t(1.0 - b1), t(1.0 - b2), t(opt.epsilon), t(lr_t))


def _adagrad_scalars(opt, step, t):
    return _adagrad, (t(opt.learning_rate(step)),)


def _ftrl_scalars(opt, step, t):
    # Only TF's default power, -0.5 (a square root). numba's float32 ``**`` differs from
    # numpy's by an ulp in a fifth of the cases, and FTRL's difference of two powers
    # magnifies that to thousands of ulps: any other power keeps the reference passes.
    if opt.learning_rate_power != -0.5:
        return None, ()
    return _ftrl, (t(opt.learning_rate(step)), t(2.0 * opt.l2), t(opt.l1))


# name -> (the slots the kernel takes, in order; scalars(optimizer, step, dtype type))
FUSED = {
    "sgd": ((), _sgd_scalars),
    "torch_sgd": ((), _torch_sgd_scalars),
    "momentum": (("momentum",), _momentum_scalars),
    "adam": (("m", "v"), _adam_scalars),
    "adagrad": (("accumulator",), _adagrad_scalars),
    "ftrl": (("accum", "linear"), _ftrl_scalars),
}
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# the parameters' dtype -> the dtypes their gradient and reply may have
_WIRE_OF = {np.dtype(np.float32): frozenset((np.dtype(np.float32), *WIRE_DTYPES)),
            np.dtype(np.float64): frozenset((np.dtype(np.float64),))}


def fused_apply(optimizer, params, grad, slots, step, pool=None, reply=None):
    """Run ``optimizer``'s fused kernel if it has one for these buffers; return whether it ran.

    It runs on C-contiguous numpy buffers of float32 or float64, over ``pool``'s threads, or
    on this thread when ``pool`` is None. ``grad`` is in the parameters' dtype, or (float32
    parameters) bfloat16 or float16, widened as it is read; ``reply`` (None: none) receives
    the new parameters in its own dtype: the parameters', bfloat16 or float16.
    """
    entry = FUSED.get(optimizer.name)
    if entry is None or not _takes(params, grad, reply):
        return False
    names, scalars = entry
    kernel, args = scalars(optimizer, step, params.dtype.type)
    if kernel is None:
        return False
    arrays = (params, wire_view(grad), None if reply is None else wire_view(reply),
              *(slots[k] for k in names))
    if pool is None:
        kernel(0, params.shape[0], *arrays, *args)
    else:
        pool.run(kernel, params.shape[0], arrays + args)
    return True


def _takes(params, grad, reply):
    """Whether the kernels take these buffers (else the reference passes run).

    Every push pays for this check: attribute reads in the cheapest order and a set of
    dtypes (hashed, not compared one by one) keep it small beside a 4 KiB kernel call.
    """
    wire = _WIRE_OF.get(params.dtype) if type(params) is np.ndarray else None
    if wire is None:
        return False
    shape = params.shape
    if type(grad) is not np.ndarray or grad.dtype not in wire or grad.shape != shape or not (
            params.flags.c_contiguous and grad.flags.c_contiguous):
        return False
    return reply is None or (type(reply) is np.ndarray and reply.dtype in wire
                             and reply.shape == shape and reply.flags.c_contiguous)


def warm_up(optimizer, dtype, wire=None):
    """Compile (or load from numba's cache) ``optimizer``'s kernel for ``dtype`` now.

    ``wire``: the dtype gradients and the reply travel in (None: ``dtype``). A ps calls
    this at start-up, so the first step does not pay for the compilation. Returns the
    seconds it took.
    """
    import time

    start = time.perf_counter()
    dtype = np.dtype(dtype)
    if optimizer.name in FUSED and dtype in _DTYPES:
        wire = dtype if wire is None else np.dtype(wire)
        params, grad = np.zeros(1, dtype), np.zeros(1, wire)
        slots = optimizer.make_slots(1, np, dtype)
        fused_apply(optimizer, params, grad, slots, 0, None,
                    None if wire == dtype else np.zeros(1, wire))
    return time.perf_counter() - start
