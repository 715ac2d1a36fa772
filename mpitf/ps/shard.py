"""One ps's slice of the model: parameters in a reply frame, optimizer slots, moving average.

The parameters are the payload of a reply :class:`~mpitf.wire.frame.Frame`, right behind
its header, so answering a worker is one send of one contiguous view; the optimizer updates
them in place. A ps on a GPU keeps its shard on the device; how its frames reach MPI
(directly, or staged through pinned host memory) is the frame's business.
"""

import numpy as np

from ..wire.frame import Frame
from .kernels import warm_up
from .threads import KernelPool


class Shard:
    """The variables one ps owns, as flat buffers, with the optimizer that updates them."""

    def __init__(self, slices, size, dtype, optimizer, backend, average=None, threads=1):
        self.slices = slices
        self.size = size
        self.dtype = np.dtype(dtype)
        self.backend = backend
        self.xp = backend.xp
        self.optimizer = optimizer
        self.reply = Frame.allocate(backend, size, dtype)
        self.params = self.reply.payload
        # Slots are made with the array module, then placed on the backend's device (a
        # no-op for numpy and CuPy; it matters for backends whose module is numpy).
        self.slots = {k: backend.to_device(v)
                      for k, v in optimizer.make_slots(size, self.xp, dtype).items()}
        # The kernel threads, and the kernel compiled (or loaded from numba's cache) now,
        # at start-up, not in the first step. A device shard runs the ufunc passes.
        self.pool = KernelPool(threads) if backend.name == "numpy" else None
        if self.pool is not None:
            warm_up(optimizer, self.dtype)
        self.average = average  # an ExponentialMovingAverage or None
        self.average_frame = Frame.allocate(backend, size, dtype) if average is not None else None
        self._views = {}  # (lo, hi) -> (params, slots, average) views of one bucket, made once

    def apply(self, grad, step, lo=0, hi=None):
        """Update the parameters with ``grad`` at global step ``step`` (before the update).

        ``lo``, ``hi``: update elements ``[lo, hi)`` only (a bucket), ``grad`` being theirs.
        The optimizers work element by element, so a slice's update is the same arithmetic
        as the whole shard's on those elements (bit for bit).
        """
        if hi is None or (lo == 0 and hi == self.size):
            params, slots = self.params, self.slots
            average = self.average_frame.payload if self.average is not None else None
        else:
            views = self._views.get((lo, hi))
            if views is None:
                views = self._views[(lo, hi)] = (
                    self.params[lo:hi], {k: v[lo:hi] for k, v in self.slots.items()},
                    self.average_frame.payload[lo:hi] if self.average is not None else None)
            params, slots, average = views
        self.optimizer.apply(params, grad, slots, step, self.pool)
        if average is not None:
            self.average.apply(average, params, step)

    def publish(self, lo, hi):
        """Make elements ``[lo, hi)`` as updated visible to MPI (the header untouched)."""
        if self.reply.staged:
            for frame in (self.reply, self.average_frame):
                if frame is not None:
                    frame.publish(lo, hi)
        else:
            self.backend.synchronize()

    def close(self):
        """Stop the kernel threads."""
        if self.pool is not None:
            self.pool.close()

    def start_average(self):
        """Begin the moving average at the current parameters."""
        if self.average_frame is not None:
            self.average_frame.payload[...] = self.params

    def saved_slots(self):
        """Return the slots a checkpoint keeps (scratch buffers excluded)."""
        return {k: v for k, v in self.slots.items() if not k.startswith("_")}
