"""One ps's slice of the model: parameters in a reply frame, optimizer slots, moving average.

The parameters live right behind a reply header in one buffer, so answering a worker is
one send of one contiguous view; the optimizer updates them in place. A ps on a GPU keeps
its shard on the device; where MPI is not CUDA-aware its frames are staged through pinned
host memory (one device-host copy per received gradient and per update).
"""

import numpy as np

from ..wire import protocol as P


class Frame:
    """A header followed by a payload, as MPI sends it and as the optimizer reads it.

    ``bytes`` is what MPI sends or receives; ``header`` is always a host int64 array;
    ``payload`` is where arithmetic happens (on the backend's device).
    """

    def __init__(self, backend, size, dtype):
        dtype = np.dtype(dtype)
        hdr = P.HEADER_BYTES // dtype.itemsize
        self.backend = backend
        self.on_device = backend.is_gpu
        self.staged = backend.is_gpu and not backend.cuda_aware
        if not self.on_device:
            buffer = backend.zeros(hdr + size, dtype)
            self.header = buffer[:hdr].view(np.int64)
            self.payload = buffer[hdr:]
            self.bytes = buffer.view(np.uint8)
        elif self.staged:
            host = backend.pinned_empty(hdr + size, dtype)
            host[:hdr] = 0
            self.header = host[:hdr].view(np.int64)
            self.host_payload = host[hdr:]
            self.bytes = host.view(np.uint8)
            self.payload = backend.zeros(size, dtype)
        else:
            buffer = backend.zeros(hdr + size, dtype)
            self.device_header = buffer[:hdr].view(np.int64)
            self.header = np.zeros(P.HEADER_WORDS, np.int64)
            self.payload = buffer[hdr:]
            self.bytes = buffer.view(np.uint8)

    def received(self):
        """Make a just-received frame readable: header on the host, payload on the device."""
        if self.staged:
            self.backend.copy_to_device_async(self.host_payload, self.payload).synchronize()
        elif self.on_device:
            self.device_header.get(out=self.header)

    def publish(self):
        """Make the header and payload as they are now visible to MPI before sending."""
        if self.staged:
            self.backend.copy_to_host_async(self.payload, self.host_payload).synchronize()
        elif self.on_device:
            self.device_header.set(self.header)
            self.backend.synchronize()


class Shard:
    """The variables one ps owns, as flat buffers, with the optimizer that updates them."""

    def __init__(self, slices, size, dtype, optimizer, backend, average=None):
        self.slices = slices
        self.size = size
        self.dtype = np.dtype(dtype)
        self.backend = backend
        self.xp = backend.xp
        self.optimizer = optimizer
        self.reply = Frame(backend, size, dtype)
        self.params = self.reply.payload
        # Slots are made with the array module, then placed on the backend's device (a
        # no-op for numpy and CuPy; it matters for backends whose module is numpy).
        self.slots = {k: backend.to_device(v)
                      for k, v in optimizer.make_slots(size, self.xp, dtype).items()}
        self.average = average  # an ExponentialMovingAverage or None
        self.average_frame = Frame(backend, size, dtype) if average is not None else None

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
