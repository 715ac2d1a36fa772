"""The wire stage: what a worker's frames carry, converted to and from the model's buffers.

The stage sits between the model's float32 buffers and whichever transport moves the
frames (:mod:`mpitf.worker.transport`): it names the buffers MPI moves (``params_flat``,
``grads_flat`` and their layouts) and converts just before a gradient leaves and just
after a reply lands. With the float32 wire (:class:`NativeFrames`) the frames are the
model's buffers and the conversions do nothing. With ``--wire-dtype bfloat16`` or
``float16`` (:class:`WireFrames`) what MPI moves is a second pair of flat buffers of the
same layout in that dtype (the header slot is ``HEADER_BYTES``, a multiple of 2, so the
header keeps its eight words): a push narrows each frame's gradient (each bucket's, with
buckets) just before it leaves; a reply is widened into the float32 parameters as it
lands: one pass each (:mod:`mpitf.wire.convert`), between buffers and views made once.
"""

import numpy as np

from ..wire.layout import FlatLayout


def wire_stage(native, dtype, placement, buckets, backend):
    """Return the stage for frames of ``dtype``: ``native`` itself, or :class:`WireFrames`."""
    if np.dtype(dtype) == native.params_flat.dtype:
        return native
    return WireFrames(native, dtype, placement, buckets, backend)


class NativeFrames:
    """The float32 wire: the frames are the model's own buffers; nothing converts.

    Args:
        layout: the parameters' :class:`~mpitf.wire.layout.FlatLayout` (a frame per ps).
        grad_layout: the gradients' (a frame per bucket with buckets, else ``layout``).
        params_flat: the model's flat parameter buffer.
        grads_flat: the model's flat gradient buffer.
    """

    converts = False  # the transports skip the calls below

    def __init__(self, layout, grad_layout, params_flat, grads_flat):
        self.layout, self.grad_layout = layout, grad_layout
        self.params_flat, self.grads_flat = params_flat, grads_flat

    def narrow_grad(self, ps, bucket=0):
        """Nothing to round: the frame is the gradient."""

    def narrow_grads(self):
        """Nothing to round: the frames are the gradients."""

    def narrow_params(self):
        """Nothing to round: the frames are the parameters."""

    def widen_params(self, ps=None, bucket=0):
        """Nothing to widen: replies land in the parameters."""


class WireFrames:
    """The wire-dtype buffers of a worker and the conversions to and from its float32 ones.

    Args:
        native: the model's :class:`NativeFrames` (its layouts and float32 buffers).
        dtype: the wire dtype (bfloat16 or float16).
        placement: the :class:`~mpitf.placement.Placement` (the wire layouts follow it).
        buckets: per ps, its buckets' element ranges (one range: no buckets).
        backend: the array backend the buffers are made on.
    """

    converts = True

    def __init__(self, native, dtype, placement, buckets, backend):
        from ..wire import convert  # loads numba: only when a worker converts

        self._narrow, self._widen = convert.narrow_into, convert.widen_into
        n, zeros = native, backend.zeros
        self.dtype = dtype
        convert.warm_up(dtype)  # compiled (or loaded) now, not in the first step
        self.layout = FlatLayout(placement, dtype=dtype)
        self.grad_layout = FlatLayout(placement, buckets, dtype) \
            if any(len(b) > 1 for b in buckets) else self.layout
        self.params_flat = zeros(self.layout.size, dtype)
        self.grads_flat = zeros(self.grad_layout.size, dtype)
        # (ps, bucket) -> (float32 view, wire view) of its gradient and of its parameters
        self.grads = {(p, k): (n.grads_flat[b:e], self.grads_flat[w:x])
                      for (p, k, (_, b, e)), (_, _, (_, w, x))
                      in zip(n.grad_layout.frames, self.grad_layout.frames)}
        self.params = {}
        for p, ranges in enumerate(buckets):
            b, w = n.layout.segments[p][1], self.layout.segments[p][1]
            for k, (lo, hi) in enumerate(ranges):
                self.params[(p, k)] = (n.params_flat[b + lo:b + hi],
                                       self.params_flat[w + lo:w + hi])
        self.whole = [(n.params_flat[b:e], self.params_flat[w:x]) for (_, b, e), (_, w, x)
                      in zip(n.layout.segments, self.layout.segments)]

    def narrow_grad(self, ps, bucket=0):
        """Round the float32 gradient of ``ps``'s ``bucket`` into its frame."""
        self._narrow(*self.grads[(ps, bucket)])

    def narrow_grads(self):
        """Round every frame's float32 gradient into the wire buffer (a whole push)."""
        for src, dst in self.grads.values():
            self._narrow(src, dst)

    def narrow_params(self):
        """Round the float32 parameters into the wire buffer (the initial values)."""
        for src, dst in self.whole:
            self._narrow(src, dst)

    def widen_params(self, ps=None, bucket=0):
        """Widen a reply into the float32 parameters: ``ps``'s ``bucket``, or (None) all."""
        if ps is None:
            for dst, src in self.whole:
                self._widen(src, dst)
        else:
            dst, src = self.params[(ps, bucket)]
            self._widen(src, dst)
