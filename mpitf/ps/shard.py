"""One ps's slice of the model: parameters in a reply frame, optimizer slots, moving average.

The parameters live right behind a reply header in one buffer, so answering a worker is
one send of one contiguous view; the optimizer updates them in place.
"""

import numpy as np

from .. import protocol as P


class Frame:
    """A header followed by a payload in one preallocated buffer."""

    def __init__(self, xp, size, dtype):
        hdr = P.HEADER_BYTES // np.dtype(dtype).itemsize
        self.buffer = xp.zeros(hdr + size, dtype)
        self.header = self.buffer[:hdr].view(np.int64)
        self.payload = self.buffer[hdr:]
        self.bytes = self.buffer.view(np.uint8)


class Shard:
    """The variables one ps owns, as flat buffers, with the optimizer that updates them."""

    def __init__(self, slices, size, dtype, optimizer, xp, average=None):
        self.slices = slices
        self.size = size
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self.optimizer = optimizer
        self.reply = Frame(xp, size, dtype)
        self.params = self.reply.payload
        self.slots = optimizer.make_slots(size, xp, dtype)
        self.average = average  # an ExponentialMovingAverage or None
        self.average_frame = Frame(xp, size, dtype) if average is not None else None

    def apply(self, grad, step):
        """Update the parameters with ``grad`` at global step ``step`` (before the update)."""
        self.optimizer.apply(self.params, grad, self.slots, step)
        if self.average is not None:
            self.average.apply(self.average_frame.payload, self.params, step)

    def start_average(self):
        """Begin the moving average at the current parameters."""
        if self.average_frame is not None:
            self.average_frame.payload[...] = self.params

    def saved_slots(self):
        """Return the slots a checkpoint keeps (scratch buffers excluded)."""
        return {k: v for k, v in self.slots.items() if not k.startswith("_")}

    def first_nonfinite(self, grad):
        """Return the index of the first slice of ``grad`` holding NaN or Inf, or None.

        A single reduction checks the whole gradient cheaply; only on failure are the
        slices searched one by one.
        """
        total = float(self.xp.add.reduce(grad))
        if np.isfinite(total):
            return None
        for i, s in enumerate(self.slices):
            if not bool(self.xp.isfinite(grad[s.offset:s.offset + s.size]).all()):
                return i
        return None  # the sum overflowed but every element is finite
