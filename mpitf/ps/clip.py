"""Clipping on the ps: a sync step's averaged gradient scaled to a global L2 norm.

DDP's ``clip_grad_norm_`` runs after the all-reduce: it clips the mean of the workers'
gradients, and no part of it is applied before the norm of all of it is known. Here every
ps holds part of that mean, so the ps tasks agree on the norm each step: each sums the
squares of its part and they allreduce the sum over the ps tasks' communicator (every ps
applies every sync step, so they meet in the same order). With buckets no bucket is
applied before the last one is in: each bucket's mean is copied aside (one shard-sized
buffer, made once) and the last bucket clips and applies them all, in push order.

The norm comes from the session's ``clip_norm`` or, step by step, from the workers
(mpitf.torch's ``clip_grad_norm_``: a ``RATES`` request's last value, 0 for none).
"""

from ..models.clipping import clip_by_global_norm

__all__ = ["StepClip"]


class StepClip:
    """The clip norm of a ps's steps, and the buckets of a step held until it is known.

    Args:
        max_norm: the session's ``clip_norm`` (None: no clipping until a worker asks).
        comm: the ps tasks' communicator (``server.job_comm``).
        count: the buckets of a push to this ps (1: one frame).
    """

    def __init__(self, max_norm, comm, count):
        self.max_norm = max_norm
        self.comm = comm
        self.held = [None] * count  # per bucket: (workers, steps) of its mean, held aside
        self.buffer = None  # the step's mean, bucket by bucket (made at the first hold)
        self.last_norm = None  # the norm of the last clipped step's gradient, before clipping

    def clip(self, arrays):
        """Scale ``arrays`` (this ps's part of the mean) to the global norm; keep the norm."""
        self.last_norm = clip_by_global_norm(arrays, self.max_norm, self.comm)

    def hold(self, svc, grad, workers, bucket, steps):
        """Copy bucket ``bucket``'s mean aside; return True once the step's last one is in."""
        if self.buffer is None:
            self.buffer = svc.xp.empty_like(svc.shard.params)
        lo, hi = svc.pipeline.ranges[bucket]
        out = self.buffer[lo:hi]
        if grad.dtype == out.dtype:
            out[...] = grad
        else:  # a 16-bit wire's single gradient, widened (numba: imported only then)
            from ..wire.convert import widen_into

            widen_into(grad, out)
        self.held[bucket] = (tuple(workers), steps)
        return bucket == svc.pipeline.last

    def release(self, svc):
        """Clip the held mean and return ``(grad, workers, bucket, steps)`` per bucket."""
        held = [h for h in self.held if h is not None]
        if len(held) != len(self.held):
            missing = self.held.index(None)
            raise RuntimeError(f"the step's last bucket came before bucket {missing}")
        self.clip((self.buffer,))
        ranges = svc.pipeline.ranges
        out = [(self.buffer[lo:hi], workers, k, steps)
               for k, ((lo, hi), (workers, steps)) in enumerate(zip(ranges, self.held))]
        self.held = [None] * len(self.held)
        return out
