"""How frames reach MPI: as they are, or staged through pinned host memory in chunks.

A worker's flat buffer holds one frame per ps (header, then payload). Where MPI can read
the buffer (host memory, or device memory with CUDA-aware MPI) a frame is sent as it is.
Where it cannot (device memory, MPI not CUDA-aware) the frame is staged through a pinned
host copy of the same layout; large frames go in chunks so that the device-host copy of
one chunk overlaps the transfer of the one before. Continuation chunks travel on their own
tag, so a ps's ``ANY_SOURCE`` receives can never match them.
"""

import numpy as np

from . import protocol as P


def chunk_ranges(nbytes, chunk_bytes):
    """Return the byte ranges a frame of ``nbytes`` is sent in (one range if unchunked)."""
    if not chunk_bytes or nbytes <= chunk_bytes:
        return [(0, nbytes)]
    return [(lo, min(lo + chunk_bytes, nbytes)) for lo in range(0, nbytes, chunk_bytes)]


def chunk_tag(tag, k):
    """Return the tag of chunk ``k`` of a frame sent on ``tag``."""
    return tag if k == 0 else tag + P.CHUNK_TAG_OFFSET


class DirectFrames:
    """Frames MPI reads and writes where they are: host memory, or CUDA-aware device memory.

    ``headers[p]`` is a host int64 array: for host buffers a view into the frame itself;
    for device buffers a small host copy moved in by :meth:`commit` and out by
    :meth:`fetch_header` (one tiny copy instead of eight device writes).
    """

    chunked = False

    def __init__(self, backend, flat, segments):
        self.backend = backend
        self.views = [flat[a:c].view(np.uint8) for a, _, c in segments]
        self.persistent = {}  # (call, p, peer, tag) -> a persistent request, made once
        self.on_device = backend.is_device_array(flat)
        if self.on_device:
            self.device_headers = [flat[a:b].view(np.int64) for a, b, _ in segments]
            self.headers = [np.zeros(P.HEADER_WORDS, np.int64) for _ in segments]
        else:
            self.headers = [flat[a:b].view(np.int64) for a, b, _ in segments]

    def commit(self, p):
        """Make header ``p`` visible in the frame (device buffers only)."""
        if self.on_device:
            self.device_headers[p].set(self.headers[p])

    def _start(self, init, p, peer, tag):
        # Persistent requests: the same frame goes to the same peer every step, so the
        # request is built once and only started each time (less work per message).
        key = (init, p, peer, tag)
        request = self.persistent.get(key)
        if request is None:
            request = self.persistent[key] = P.frame_op(init, self.views[p], peer, tag)
        request.Start()
        return [request]

    def isend(self, comm, p, peer, tag):
        """Start sending frame ``p``; return its requests (synchronise the stream first)."""
        return self._start(comm.Send_init, p, peer, tag)

    def irecv(self, comm, p, peer, tag):
        """Post the receive of frame ``p``; return its requests."""
        return self._start(comm.Recv_init, p, peer, tag)

    def fetch_header(self, p):
        """Copy the header of a received device frame to the host (no-op on the host)."""
        if self.on_device:
            self.device_headers[p].get(out=self.headers[p])


class StagedFrames:
    """Device frames staged through a pinned host mirror, in chunks of ``chunk_bytes``."""

    chunked = True

    def __init__(self, backend, flat, segments, chunk_bytes):
        self.backend = backend
        self.flat = flat
        self.itemsize = flat.dtype.itemsize
        self.host = backend.pinned_empty(flat.size, flat.dtype)  # preallocated once
        self.segments = segments
        self.views = [self.host[a:c].view(np.uint8) for a, _, c in segments]
        self.headers = [self.host[a:b].view(np.int64) for a, b, _ in segments]
        self.chunks = [chunk_ranges((c - a) * self.itemsize, chunk_bytes)
                       for a, _, c in segments]

    def commit(self, p):
        """Headers live in pinned memory already: nothing to do."""

    def _elements(self, p, lo, hi):
        """Return the payload element range of frame ``p`` that bytes [lo, hi) cover."""
        a, b, _ = self.segments[p]
        return max(a + lo // self.itemsize, b), a + hi // self.itemsize

    def isend(self, comm, p, peer, tag):
        """Copy the payload to the host chunk by chunk, sending each chunk once it is there."""
        events = []
        for lo, hi in self.chunks[p]:
            e0, e1 = self._elements(p, lo, hi)
            events.append(self.backend.copy_to_host_async(self.flat[e0:e1], self.host[e0:e1]))
        requests = []
        for k, ((lo, hi), event) in enumerate(zip(self.chunks[p], events)):
            event.synchronize()
            requests.append(P.frame_op(comm.Isend, self.views[p][lo:hi], peer, chunk_tag(tag, k)))
        return requests

    def irecv(self, comm, p, peer, tag):
        """Post the receives of every chunk of frame ``p``."""
        return [P.frame_op(comm.Irecv, self.views[p][lo:hi], peer, chunk_tag(tag, k))
                for k, (lo, hi) in enumerate(self.chunks[p])]

    def finish_recv(self, p, requests, deadline, describe):
        """Copy each chunk to the device as soon as it has arrived."""
        event = None
        for (lo, hi), request in zip(self.chunks[p], requests):
            P.wait_all([request], deadline, describe)
            e0, e1 = self._elements(p, lo, hi)
            if e1 > e0:
                event = self.backend.copy_to_device_async(self.host[e0:e1], self.flat[e0:e1])
        if event is not None:
            event.synchronize()


def make_frames(backend, flat, segments, chunk_bytes):
    """Return the frame transport for a flat buffer on ``backend``."""
    if backend.is_device_array(flat) and not backend.cuda_aware:
        return StagedFrames(backend, flat, segments, chunk_bytes)
    return DirectFrames(backend, flat, segments)
