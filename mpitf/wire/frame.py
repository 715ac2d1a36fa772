"""A frame as MPI moves it, on either side: header and payload in one buffer, staged or not.

Every message of the data path is a frame (header words in :mod:`mpitf.wire.header`): a
worker's flat buffer holds one per ps, a ps holds its reply frames and a pool of receive
frames. Where MPI can read the memory (host, or a device with CUDA-aware MPI) a frame goes
as it is; where it cannot, through a pinned host mirror of the same layout
(:class:`MPIBuffer`). A side that stages sends and receives its frames in chunks, so that
the device-host copy of one chunk overlaps the transfer of another; chunks after the first
travel on their own tag (:func:`chunk_tag`), so a ps's receives from any worker never
match them, and the ps receives the rest of a staging worker's push, and answers it, in chunks.
"""

import numpy as np

from ..runtime import heal
from . import protocol as P
from .header import HEADER_WORDS
from .layout import frame_segments


def chunk_ranges(nbytes, chunk_bytes):
    """Return the byte ranges a frame of ``nbytes`` is sent in (one range if unchunked)."""
    if not chunk_bytes or nbytes <= chunk_bytes:
        return [(0, nbytes)]
    return [(lo, min(lo + chunk_bytes, nbytes)) for lo in range(0, nbytes, chunk_bytes)]


def chunk_tag(tag, k):
    """Return the tag of chunk ``k`` of a frame sent on ``tag``."""
    return tag if k == 0 else tag + P.CHUNK_TAG_OFFSET


class MPIBuffer:
    """An array as MPI sees it: the array itself, or a pinned host mirror of it.

    ``mpi`` is what to hand to MPI. Host memory, and device memory when MPI is CUDA-aware,
    go as they are (the copies below do nothing); other device memory goes through a
    page-locked host array of the same shape, allocated once.
    """

    def __init__(self, backend, array):
        self.backend = backend
        self.array = array
        self.staged = backend.is_device_array(array) and not backend.cuda_aware
        if self.staged:
            self.mpi = backend.pinned_empty(array.size, array.dtype).reshape(array.shape)
        else:
            self.mpi = array

    def to_mpi(self, key=...):
        """Copy ``array[key]`` to where MPI reads it; return when it is there."""
        if self.staged:
            self.backend.to_host(self.array[key], out=self.mpi[key])

    def from_mpi(self, key=...):
        """Copy ``array[key]`` from where MPI wrote it; return when it is there."""
        if self.staged:
            self.backend.to_device(self.mpi[key], out=self.array[key])

    def to_mpi_async(self, lo, hi):
        """Start copying elements ``[lo, hi)`` of a staged 1-D array out; return an event."""
        return self.backend.copy_to_host_async(self.array[lo:hi], self.mpi[lo:hi])

    def from_mpi_async(self, lo, hi):
        """Start copying elements ``[lo, hi)`` of a staged 1-D array in; return an event."""
        return self.backend.copy_to_device_async(self.mpi[lo:hi], self.array[lo:hi])


class Frame:
    """One frame: a header readable on the host, and a payload on the backend's device.

    ``bytes`` is what MPI sends and receives (the frame itself or its pinned mirror);
    ``header`` is a host int64 array (pack and read it with :mod:`mpitf.wire.header`);
    ``payload`` is where arithmetic happens. In device memory that MPI reads directly the
    header is a host copy, written into the frame by :meth:`commit` and read back by
    :meth:`fetch_header` (one small copy instead of eight device writes).

    Two ways out: :meth:`isend` sends what was just computed (the worker: a staged frame
    goes chunk by chunk, each copied out while the one before travels); :meth:`publish`
    then :meth:`isend_published` send one state many times (the ps: its reply frame goes
    to every worker from one copy). Two ways in: :meth:`irecv` and
    :meth:`receive_chunks` (the worker, from a known ps), and :meth:`receive_rest`,
    :meth:`received` (the ps, after :mod:`mpitf.ps.receive_pool` took the first chunk).

    Args:
        buffer: the :class:`MPIBuffer` of the flat array the frame lies in.
        segment: ``(start of header, start of payload, end)`` in elements of that array.
        chunk_bytes: chunk size of this side's frames when it stages (None: whole).
        capacity: the most bytes a message received into it may have (None: the frame's
            own size); a ps whose pool also takes sparse messages receives into more.
    """

    def __init__(self, buffer, segment, chunk_bytes=None, capacity=None):
        a, b, c = segment
        self.backend = buffer.backend
        self.buffer = buffer
        self.segment = segment
        self.itemsize = buffer.array.dtype.itemsize
        self.staged = buffer.staged
        end = c if capacity is None else max(c, a + -(-capacity // self.itemsize))
        self.bytes = buffer.mpi[a:end].view(np.uint8)
        self.payload = buffer.array[b:c]
        # A device frame, or a staged one, must be published before it is sent.
        self.unpublished = self.staged or self.backend.is_device_array(buffer.mpi)
        if self.backend.is_device_array(buffer.mpi):
            self._device_header = buffer.array[a:b].view(np.int64)
            self.header = np.zeros(HEADER_WORDS, np.int64)
        else:
            self._device_header = None
            self.header = buffer.mpi[a:b].view(np.int64)
            self.header[...] = 0  # a staged mirror starts uninitialised
        self.chunks = chunk_ranges(self.bytes.nbytes, chunk_bytes if self.staged else None)
        self._sends = {}  # (peer, tag) -> a persistent send of the whole frame, made once
        self._receives = {}  # (peer, tag) -> a persistent receive of the whole frame
        self._generation = heal.generation  # the requests are made on this heal's comm
        self._chunks_for = {}  # chunk_bytes -> byte ranges, for isend_published

    @classmethod
    def allocate(cls, backend, size, dtype, capacity=None):
        """Return a frame over a new zeroed buffer: a header slot and ``size`` elements.

        ``capacity``: receive messages of up to this many bytes (header included) into it.
        """
        (segment,) = frame_segments([size], dtype)
        total = segment[2]
        if capacity is not None:
            total = max(total, -(-capacity // np.dtype(dtype).itemsize))
        return cls(MPIBuffer(backend, backend.zeros(total, dtype)), segment, capacity=capacity)

    # -- out ---------------------------------------------------------------------------

    def commit(self):
        """Write the header, as packed on the host, into a device frame MPI reads directly."""
        if self._device_header is not None:
            self.backend.to_device(self.header, out=self._device_header)

    def isend(self, comm, peer, tag):
        """Start sending what the frame holds now; return its requests.

        The caller has committed the header and synchronised the stream. A direct frame
        restarts a persistent request (the same frame goes to the same peer every step); a
        staged one is copied to the host chunk by chunk, each sent as soon as it is there.
        """
        if not self.staged:
            return [self._restart(self._sends, comm.Send_init, peer, tag)]
        events = [self.buffer.to_mpi_async(*self._elements(lo, hi)) for lo, hi in self.chunks]
        requests = []
        for k, ((lo, hi), event) in enumerate(zip(self.chunks, events)):
            event.synchronize()
            requests.append(P.frame_op(comm.Isend, self.bytes[lo:hi], peer, chunk_tag(tag, k)))
        return requests

    def publish(self, lo=0, hi=None):
        """Make the header and payload elements ``[lo, hi)`` (default: all) visible to MPI."""
        if self._device_header is not None:
            self.commit()
            self.backend.synchronize()
        elif self.staged:
            b = self.segment[1]
            self.buffer.to_mpi(slice(b + lo, self.segment[2] if hi is None else b + hi))

    def isend_published(self, comm, peer, tag, chunk_bytes=None, span=None):
        """Start sending the frame as last published, whole or in chunks; return the requests.

        ``chunk_bytes`` is the peer's chunk size when the peer stages, else None. ``span``
        (a byte range of the frame) sends that part only: a bucket's parameters, or the
        header with the bucket behind it.
        """
        if not chunk_bytes:
            if span is None:  # the whole frame, to the same peers step after step
                return [self._restart(self._sends, comm.Send_init, peer, tag,
                                      fallback=comm.Isend)]
            return [P.frame_op(comm.Isend, self.bytes[span[0]:span[1]], peer, tag)]
        data = self.bytes if span is None else self.bytes[span[0]:span[1]]
        key = (chunk_bytes, span)
        ranges = self._chunks_for.get(key)
        if ranges is None:
            ranges = self._chunks_for[key] = chunk_ranges(data.nbytes, chunk_bytes)
        return [P.frame_op(comm.Isend, data[lo:hi], peer, chunk_tag(tag, k))
                for k, (lo, hi) in enumerate(ranges)]

    # -- in ----------------------------------------------------------------------------

    def irecv(self, comm, peer, tag):
        """Post the receive of the frame from ``peer``; return its requests."""
        if not self.staged:
            return [self._restart(self._receives, comm.Recv_init, peer, tag)]
        return [P.frame_op(comm.Irecv, self.bytes[lo:hi], peer, chunk_tag(tag, k))
                for k, (lo, hi) in enumerate(self.chunks)]

    def receive_chunks(self, requests, deadline, describe):
        """Wait for a staged frame's chunks, copying each to the device as soon as it lands."""
        event = None
        for (lo, hi), request in zip(self.chunks, requests):
            P.wait_all([request], deadline, describe)
            e0, e1 = self._elements(lo, hi)
            if e1 > e0:
                event = self.buffer.from_mpi_async(e0, e1)
        if event is not None:
            event.synchronize()

    def receive_rest(self, comm, source, tag, chunk_bytes, deadline, describe, nbytes=None):
        """Receive chunks 1.. of a frame ``source`` stages in chunks (chunk 0 has arrived).

        ``nbytes``: the message's size, header included (default: the whole frame).
        """
        ranges = chunk_ranges(self.bytes.nbytes if nbytes is None else nbytes, chunk_bytes)
        requests = [P.frame_op(comm.Irecv, self.bytes[lo:hi], source, chunk_tag(tag, k))
                    for k, (lo, hi) in enumerate(ranges) if k]
        P.wait_all(requests, deadline, describe)

    def fetch_header(self):
        """Return the received header on the host (one small copy from a device frame)."""
        if self._device_header is not None:
            self.backend.to_host(self._device_header, out=self.header)
        return self.header

    def received(self, count=None):
        """Make a received frame readable on the device (a staged payload is copied).

        ``count``: the payload elements the message had (default: the whole payload).
        """
        if self.staged:
            b = self.segment[1]
            self.buffer.from_mpi(slice(b, self.segment[2] if count is None else b + count))

    # -- internals ---------------------------------------------------------------------

    def _restart(self, persistent, init, peer, tag, fallback=None):
        """Start the persistent request of the whole frame to or from ``peer`` on ``tag``.

        Made once (``init``: ``comm.Send_init`` or ``Recv_init``), restarted every step,
        which costs a fraction of a new ``Isend``'s set-up. ``fallback`` (``comm.Isend``):
        the last one may still be under way (a ps may answer a worker twice before it
        tests the first reply); then that call sends instead, as MPI forbids restarting it.
        """
        if self._generation != heal.generation:  # made on a communicator a heal replaced
            self._forget()
        key = (peer, tag)
        request = persistent.get(key)
        if request is None:
            request = persistent[key] = P.frame_op(init, self.bytes, peer, tag)
        elif fallback is not None and not request.Test():
            return P.frame_op(fallback, self.bytes, peer, tag)
        request.Start()
        return request

    def _forget(self):
        """Drop the persistent requests (inactive: every one was waited for) of an old heal."""
        for persistent in (self._sends, self._receives):
            for request in persistent.values():
                request.Free()
            persistent.clear()
        self._generation = heal.generation

    def _elements(self, lo, hi):
        """Return the payload elements that bytes ``[lo, hi)`` of the frame cover."""
        a, b, _ = self.segment
        return max(a + lo // self.itemsize, b), a + hi // self.itemsize


def frames_over(backend, flat, segments, chunk_bytes=None):
    """Return one :class:`Frame` per segment of the flat array ``flat``, staged together."""
    buffer = MPIBuffer(backend, flat)
    return [Frame(buffer, segment, chunk_bytes) for segment in segments]
