"""A worker's frames in a 16-bit wire dtype, beside the model's float32 buffers.

With ``--wire-dtype bfloat16`` or ``float16`` what MPI moves is a second pair of flat
buffers of the same layout in that dtype (the header slot is ``HEADER_BYTES``, a multiple
of 2, so the header keeps its eight words); the model reads and writes the float32
buffers as before. A push narrows each frame's gradient (each bucket's, with buckets)
just before it leaves; a reply is widened into the float32 parameters as it lands: one
pass each (:mod:`mpitf.wire.convert`), between buffers and views made once.
"""

from ..wire.convert import narrow_into, warm_up, widen_into
from ..wire.layout import FlatLayout


class WireFrames:
    """The wire-dtype buffers of a client and the conversions to and from its float32 ones.

    Args:
        client: the :class:`~mpitf.worker.client.Client` (its layouts and float32 buffers).
        dtype: the wire dtype (bfloat16 or float16).
    """

    def __init__(self, client, dtype):
        c, zeros = client, client.backend.zeros
        self.dtype = dtype
        warm_up(dtype)  # compiled (or loaded) now, not in the first step
        self.layout = FlatLayout(c.placement, dtype=dtype)
        self.grad_layout = FlatLayout(c.placement, c.buckets, dtype) if c.bucketed \
            else self.layout
        self.params_flat = zeros(self.layout.size, dtype)
        self.grads_flat = zeros(self.grad_layout.size, dtype)
        # (ps, bucket) -> (float32 view, wire view) of its gradient and of its parameters
        self.grads = {(p, k): (c.grads_flat[b:e], self.grads_flat[w:x])
                      for (p, k, (_, b, e)), (_, _, (_, w, x))
                      in zip(c.grad_layout.frames, self.grad_layout.frames)}
        self.params = {}
        for p, ranges in enumerate(c.buckets):
            b, w = c.layout.segments[p][1], self.layout.segments[p][1]
            for k, (lo, hi) in enumerate(ranges):
                self.params[(p, k)] = (c.params_flat[b + lo:b + hi],
                                       self.params_flat[w + lo:w + hi])
        self.whole = [(c.params_flat[b:e], self.params_flat[w:x]) for (_, b, e), (_, w, x)
                      in zip(c.layout.segments, self.layout.segments)]

    def narrow_grad(self, ps, bucket=0):
        """Round the float32 gradient of ``ps``'s ``bucket`` into its frame."""
        narrow_into(*self.grads[(ps, bucket)])

    def narrow_grads(self):
        """Round every frame's float32 gradient into the wire buffer (a whole push)."""
        for src, dst in self.grads.values():
            narrow_into(src, dst)

    def narrow_params(self):
        """Round the float32 parameters into the wire buffer (the initial values)."""
        for src, dst in self.whole:
            narrow_into(src, dst)

    def widen_params(self, ps=None, bucket=0):
        """Widen a reply into the float32 parameters: ``ps``'s ``bucket``, or (None) all."""
        if ps is None:
            for dst, src in self.whole:
                widen_into(src, dst)
        else:
            dst, src = self.params[(ps, bucket)]
            widen_into(src, dst)
