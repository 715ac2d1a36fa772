"""One ps's slice of the model: parameters in a reply frame, optimizer slots, moving average.

The parameters are the payload of a reply :class:`~mpitf.wire.frame.Frame`, right behind
its header, so answering a worker is one send of one contiguous view; the optimizer updates
them in place. A ps on a GPU keeps its shard on the device; how its frames reach MPI
(directly, or staged through pinned host memory) is the frame's business.
"""

import numpy as np

from ..wire.frame import Frame


class Shard:
    """The variables one ps owns, as flat buffers, with the optimizer that updates them."""

    def __init__(self, slices, size, dtype, optimizer, backend, average=None, pool=None):
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
        self.pool = pool  # the KernelPool whose threads run the fused kernel (None: one)
        self.average = average  # an ExponentialMovingAverage or None
        self.average_frame = Frame.allocate(backend, size, dtype) if average is not None else None

    def apply(self, grad, step):
        """Update the parameters with ``grad`` at global step ``step`` (before the update)."""
        self.optimizer.apply(self.params, grad, self.slots, step, self.pool)
        if self.average is not None:
            self.average.apply(self.average_frame.payload, self.params, step)

    def start_average(self):
        """Begin the moving average at the current parameters."""
        if self.average_frame is not None:
            self.average_frame.payload[...] = self.params

    def saved_slots(self):
        """Return the slots a checkpoint keeps (scratch buffers excluded)."""
        return {k: v for k, v in self.slots.items() if not k.startswith("_")}
