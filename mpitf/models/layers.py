"""Layers with hand-written backward passes, on whichever array module holds the data.

Every layer is a pair of functions:

- ``forward(inputs..., params...) -> (out, cache)``
- ``backward(dout, cache, params..., grads...) -> dinput``

A backward pass writes the parameter gradients into arrays the caller passes
in (views into mpitf's flat gradient buffer), so no parameter-gradient array is
ever allocated here; it returns only the gradient of its input.

Images are NHWC (batch, height, width, channels), as in TensorFlow's default,
and convolution kernels are HWIO (height, width, in_channels, out_channels),
TensorFlow's ``conv2d`` filter layout, so weights port between the two.

The array module (``numpy`` or ``cupy``) is taken from the arrays themselves
with :func:`_xp`; this module never imports cupy.
"""

import sys

import numpy

from ..config import check_batch_size
from ..errors import ConfigurationError

__all__ = [
    "accuracy",
    "conv2d",
    "conv2d_backward",
    "dense",
    "dense_backward",
    "dense_stack",
    "dense_stack_backward",
    "evaluate",
    "ReferenceModel",
    "max_pool2x2",
    "max_pool2x2_backward",
    "relu",
    "relu_backward",
    "softmax_cross_entropy",
    "truncated_normal",
]


def _xp(a):
    """Return the array module (numpy, cupy, ...) that owns array ``a``."""
    if isinstance(a, numpy.ndarray):
        return numpy
    return sys.modules[type(a).__module__.split(".")[0]]


def _matmul_into(a, b, out):
    """Compute ``a @ b`` into ``out`` in place, without a temporary when possible."""
    xp = _xp(out)
    if out.flags.c_contiguous and out.dtype == a.dtype == b.dtype:
        xp.matmul(a, b, out=out)
    else:
        out[...] = a @ b


# --- dense -----------------------------------------------------------------


def dense(x, w, b):
    """Compute ``x @ w + b``; the cache is ``x``.

    Args:
        x: inputs, shape ``(N, D_in)``.
        w: weights, shape ``(D_in, D_out)``.
        b: biases, shape ``(D_out,)``.
    """
    return x @ w + b, x


def dense_backward(dy, cache, w, dw, db):
    """Write ``dL/dw`` into ``dw`` and ``dL/db`` into ``db``; return ``dL/dx``."""
    x = cache
    _matmul_into(x.T, dy, dw)
    db[...] = dy.sum(axis=0)
    return dy @ w.T


# --- relu ------------------------------------------------------------------


def dense_stack(params, names, x):
    """Run dense layers ``names`` in order, ReLU between them (not after the last).

    Returns the output and the caches :func:`dense_stack_backward` needs.
    """
    caches, h = [], x
    for k, name in enumerate(names):
        h, dense_cache = dense(h, params[f"{name}/weights"], params[f"{name}/biases"])
        relu_cache = None
        if k < len(names) - 1:
            h, relu_cache = relu(h)
        caches.append((dense_cache, relu_cache))
    return h, caches


def dense_stack_backward(d, caches, params, names, grads, final=None):
    """Backpropagate ``d`` through :func:`dense_stack`, writing into ``grads``; return d/dx.

    ``final(names)``, if given, is called as each layer's gradients are written (the last
    layer first), so a bucketed push can send them while backward goes on.
    """
    for name, (dense_cache, relu_cache) in zip(reversed(names), reversed(caches)):
        if relu_cache is not None:
            d = relu_backward(d, relu_cache)
        d = dense_backward(d, dense_cache, params[f"{name}/weights"],
                           grads[f"{name}/weights"], grads[f"{name}/biases"])
        if final is not None:
            final((f"{name}/weights", f"{name}/biases"))
    return d


def relu(x):
    """Compute ``max(x, 0)``; the cache is the output."""
    y = _xp(x).maximum(x, 0)
    return y, y


def relu_backward(dy, cache):
    """Return ``dL/dx`` for ``relu`` (zero where the output was zero)."""
    return dy * (cache > 0)


# --- conv2d (NHWC, HWIO kernels, stride 1) -----------------------------------


def _pads(kh, kw, padding):
    """Return ``((top, bottom), (left, right))`` padding for 'same' or 'valid'."""
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        # As TensorFlow: an odd leftover row or column goes to the bottom/right.
        return ((kh - 1) // 2, kh // 2), ((kw - 1) // 2, kw // 2)
    raise ConfigurationError(f"padding must be 'same' or 'valid', got {padding!r}")


def _im2col(xpad, kh, kw, ho, wo):
    """Gather every ``kh x kw`` patch into rows of shape ``(N*ho*wo, kh*kw*C)``."""
    xp = _xp(xpad)
    n, c = xpad.shape[0], xpad.shape[3]
    cols = xp.empty((n, ho, wo, kh, kw, c), dtype=xpad.dtype)
    # kh*kw strided copies: small kernels make this loop cheap and backend-neutral.
    for i in range(kh):
        for j in range(kw):
            cols[:, :, :, i, j, :] = xpad[:, i : i + ho, j : j + wo, :]
    return cols.reshape(n * ho * wo, kh * kw * c)


def conv2d(x, w, b, padding="same"):
    """Convolve NHWC images ``x`` with HWIO kernels ``w`` at stride 1 and add ``b``.

    Args:
        x: images, shape ``(N, H, W, C)``.
        w: kernels, shape ``(KH, KW, C, F)``.
        b: biases, shape ``(F,)``.
        padding: ``"same"`` (output ``H x W``) or ``"valid"`` (``H-KH+1 x W-KW+1``).

    Returns:
        ``(y, cache)`` with ``y`` of shape ``(N, HO, WO, F)``.
    """
    kh, kw, c, f = w.shape
    if x.ndim != 4 or x.shape[3] != c:
        raise ConfigurationError(
            f"conv2d expects NHWC input with {c} channels, got shape {tuple(x.shape)}"
        )
    (pt, pb), (pl, pr) = _pads(kh, kw, padding)
    xp = _xp(x)
    xpad = xp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0))) if pt + pb + pl + pr else x
    n, hp, wp = xpad.shape[:3]
    ho, wo = hp - kh + 1, wp - kw + 1
    if ho < 1 or wo < 1:
        raise ConfigurationError(f"{kh}x{kw} 'valid' conv2d does not fit {tuple(x.shape)}")
    cols = _im2col(xpad, kh, kw, ho, wo)
    y = (cols @ w.reshape(kh * kw * c, f) + b).reshape(n, ho, wo, f)
    return y, (cols, x.shape, padding)


def conv2d_backward(dy, cache, w, dw, db):
    """Write ``dL/dw`` into ``dw`` and ``dL/db`` into ``db``; return ``dL/dx``."""
    cols, x_shape, padding = cache
    kh, kw, c, f = w.shape
    n, ho, wo, _ = dy.shape
    dy2 = dy.reshape(n * ho * wo, f)
    dw[...] = (cols.T @ dy2).reshape(dw.shape)
    db[...] = dy2.sum(axis=0)
    dcols = (dy2 @ w.reshape(kh * kw * c, f).T).reshape(n, ho, wo, kh, kw, c)
    (pt, pb), (pl, pr) = _pads(kh, kw, padding)
    xp = _xp(dy)
    dxpad = xp.zeros((n, ho + kh - 1, wo + kw - 1, c), dtype=dy.dtype)
    for i in range(kh):
        for j in range(kw):
            dxpad[:, i : i + ho, j : j + wo, :] += dcols[:, :, :, i, j, :]
    h, wdt = x_shape[1], x_shape[2]
    return dxpad[:, pt : pt + h, pl : pl + wdt, :]


# --- max pool 2x2, stride 2 --------------------------------------------------


def _pool_windows(x):
    """View NHWC ``x`` as ``(N, H/2, W/2, C, 4)`` windows (odd edges are dropped)."""
    xp = _xp(x)
    n, h, w, c = x.shape
    h2, w2 = h // 2, w // 2
    win = x[:, : 2 * h2, : 2 * w2, :].reshape(n, h2, 2, w2, 2, c)
    return xp.ascontiguousarray(win.transpose(0, 1, 3, 5, 2, 4)).reshape(n, h2, w2, c, 4)


def max_pool2x2(x):
    """Take the maximum of each 2x2 window of NHWC ``x`` at stride 2 ('valid').

    Returns:
        ``(y, cache)`` with ``y`` of shape ``(N, H//2, W//2, C)``.
    """
    if x.ndim != 4 or x.shape[1] < 2 or x.shape[2] < 2:
        raise ConfigurationError(f"max_pool2x2 expects NHWC with H, W >= 2, got {x.shape}")
    win = _pool_windows(x)
    arg = win.argmax(axis=-1)
    y = _xp(x).take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    return y, (arg, x.shape)


def max_pool2x2_backward(dy, cache):
    """Return ``dL/dx``: each window's gradient goes to its (first) maximum."""
    arg, x_shape = cache
    xp = _xp(dy)
    n, h2, w2, c = dy.shape
    onehot = xp.arange(4) == arg[..., None]
    dwin = (onehot * dy[..., None]).reshape(n, h2, w2, c, 2, 2)
    dx = xp.zeros(x_shape, dtype=dy.dtype)
    dx[:, : 2 * h2, : 2 * w2, :] = dwin.transpose(0, 1, 4, 2, 5, 3).reshape(
        n, 2 * h2, 2 * w2, c
    )
    return dx


# --- softmax cross-entropy ---------------------------------------------------


def softmax_cross_entropy(logits, labels):
    """Return the batch-mean softmax cross-entropy and its gradient.

    Stable for large logits: the row maximum is subtracted before ``exp``.

    Args:
        logits: shape ``(N, K)``.
        labels: integer class indices, shape ``(N,)``.

    Returns:
        ``(loss, dlogits)``: ``loss`` a Python float, ``dlogits`` shaped like ``logits``.
    """
    xp = _xp(logits)
    n = logits.shape[0]
    labels = xp.asarray(labels).astype(xp.int64, copy=False)
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    log_prob = shifted[rows, labels] - xp.log(total[:, 0])
    loss = -float(log_prob.mean())
    dlogits = exp / total
    dlogits[rows, labels] -= 1
    dlogits /= n
    return loss, dlogits


# --- helpers shared by the reference models ------------------------------------


def truncated_normal(rng, shape, scale, dtype):
    """Draw normal values cut at two standard deviations (as TF), times ``scale``.

    Args:
        rng: a ``numpy.random.Generator``; the draw is deterministic given it.
        shape: the array shape.
        scale: the standard deviation before truncation.
        dtype: the dtype of the returned host array.
    """
    z = rng.standard_normal(shape)
    bad = numpy.abs(z) > 2
    while bad.any():
        z[bad] = rng.standard_normal(int(bad.sum()))
        bad = numpy.abs(z) > 2
    return (z * scale).astype(dtype)


def _batches(x, y, batch_size):
    """Yield ``(x, y)`` slices of at most ``batch_size`` rows."""
    check_batch_size(batch_size)
    for start in range(0, len(x), batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]


def evaluate(model, params, x, y, batch_size=512):
    """Return ``(mean loss, accuracy)`` of ``model`` with ``params`` over ``(x, y)``.

    Works in batches of ``batch_size`` rows so a large test set fits in memory.
    """
    if len(x) != len(y) or len(x) == 0:
        raise ConfigurationError(f"x and y must be non-empty and equal length, got {len(x)}, "
                                 f"{len(y)}")
    loss_sum, correct = 0.0, 0
    for xb, yb in _batches(x, y, batch_size):
        logits = model.logits(params, xb)
        xp = _xp(logits)
        yb = xp.asarray(yb)
        loss, _ = softmax_cross_entropy(logits, yb)
        loss_sum += loss * len(xb)
        correct += int((logits.argmax(axis=1) == yb).sum())
    return loss_sum / len(x), correct / len(x)


def accuracy(model, params, x, y, batch_size=512):
    """Return the fraction of rows of ``x`` whose predicted class equals ``y``."""
    if len(x) != len(y) or len(x) == 0:
        raise ConfigurationError(f"x and y must be non-empty and equal length, got {len(x)}, "
                                 f"{len(y)}")
    correct = 0
    for xb, yb in _batches(x, y, batch_size):
        logits = model.logits(params, xb)
        correct += int((logits.argmax(axis=1) == _xp(logits).asarray(yb)).sum())
    return correct / len(x)


class ReferenceModel:
    """Base of the reference models: variable list, initialisation, input staging.

    Subclasses fill ``self._specs`` with ``(name, shape, fan_in)``; ``fan_in`` is
    ``None`` for a variable that starts at zero (biases).
    """

    def __init__(self, dtype):
        self.dtype = numpy.dtype(dtype)
        if self.dtype.kind != "f":
            raise ConfigurationError(f"model dtype must be floating point, got {self.dtype}")
        self._specs = []

    def variables(self):
        """Return ``[(name, shape, dtype)]`` in creation order."""
        return [(name, shape, self.dtype) for name, shape, _ in self._specs]

    def init(self, rng):
        """Return initial host values: truncated normal / sqrt(fan_in) weights, zero biases."""
        values = {}
        for name, shape, fan_in in self._specs:
            if fan_in is None:
                values[name] = numpy.zeros(shape, dtype=self.dtype)
            else:
                values[name] = truncated_normal(rng, shape, fan_in**-0.5, self.dtype)
        return values

    def _stage(self, params, x):
        """Return ``(xp, x)`` with ``x`` moved to the params' array module and dtype."""
        xp = _xp(params[self._specs[0][0]])
        return xp, xp.asarray(x, dtype=self.dtype)
