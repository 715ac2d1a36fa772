"""The ps's receive frames: a fixed pool, filled from any worker in the order messages come.

A ps does not know which worker speaks next, so it receives from ``ANY_SOURCE`` into one
of a few frames; a message waits in MPI (or at its sender) until a frame is free, so the
ps's memory does not grow with the number of workers.

Each message is taken by a *matched probe* (``MPI_Improbe``, then ``MPI_Imrecv`` into a
free frame) rather than by receives posted ahead with ``ANY_SOURCE``. MPI promises that
both see every message, but MPICH 5.0 with its default UCX netmod does not match a posted
``ANY_SOURCE`` receive against a small (eager) message from another node that arrived
before the receive was posted: the message waits forever while ``MPI_Iprobe`` sees it
(``tests/jobs/test_multinode.py`` shows it on two network namespaces; OFI, and shared memory
within a node, match it). A matched probe works with every MPI we run, takes messages in
the order they came (what the bucketed pipeline needs), and binds a frame only to a
message that has arrived, so no frame is ever cancelled or left posted.

A ps with one sender (one worker, nothing else that may speak to it) knows where the next
message comes from: :class:`PostedReceives` posts each free frame's receive from that rank
ahead, as a raw MPI round trip does, and the message lands in its frame as it arrives
instead of waiting in MPI's queue for a probe and a copy (2.5 µs of a 4 KiB round trip
here). The matching bug above is ``ANY_SOURCE``'s only.
"""

from collections import deque

from mpi4py import MPI

from ..wire import protocol as P


def receive_pool(comm, frames, tag, senders, rerouted=False, ulfm=False):
    """Return the pool for ``frames``: receives posted from the one sender, or probes.

    Probes where another rank may speak too: ``senders`` (the ranks that push) are more
    than one, a lost buddy's workers may be ``rerouted`` here (replication), or a dead
    worker's requests must be told apart (``ulfm``).
    """
    if len(senders) != 1 or rerouted or ulfm:
        return ReceivePool(comm, frames, tag)
    return PostedReceives(comm, frames, tag, senders[0])


class ReceivePool:
    """Frames that take requests from any worker on one tag, one at a time.

    ``wait_next`` returns the index of the frame that holds the next message; the frame
    stays the caller's until ``release(index)`` (a held gradient keeps its frame);
    ``swap(index, frame)`` lends the frame away and puts another in its place.
    """

    def __init__(self, comm, frames, tag):
        self.comm, self.tag = comm, tag
        self.frames = list(frames)
        self.free = list(range(len(self.frames)))[::-1]  # a stack: the warmest frame first
        self.status = MPI.Status()

    def __getitem__(self, index):
        return self.frames[index]

    def __len__(self):
        return len(self.frames)

    @property
    def source(self):
        """Return the rank that sent the message :meth:`wait_next` returned last."""
        return self.status.Get_source()

    def wait_next(self, poll_every, on_quiet, deadline, describe, between=None):
        """Receive the next message into a free frame; return the frame's index.

        Every ``poll_every`` seconds without a message ``on_quiet()`` is called (it may
        raise), and ``between()`` between two probes; ``deadline``/``describe`` bound the
        transfer of a message once it started.
        """
        if not self.free:
            raise RuntimeError("every receive frame is held: a policy kept more frames "
                               "than it asked for")
        message = P.wait_message(self.comm, self.tag, poll_every, on_quiet, self.status,
                                 between)
        index = self.free.pop()
        try:
            frame = self.frames[index].bytes
            request = message.Irecv([frame, MPI.BYTE])
            if not request.Test():  # a small message has landed already
                P.wait_all([request], deadline, lambda _: describe(self.source),
                           nbytes=frame.nbytes)
        except MPI.Exception:
            self.free.append(index)  # its sender died (ULFM): the frame is free again
            raise
        return index

    def release(self, index):
        """Give frame ``index`` back: the next message may land in it."""
        self.free.append(index)

    def swap(self, index, frame):
        """Put ``frame`` in slot ``index`` and return the frame that was there (lent away).

        The slot stays the caller's until :meth:`release`, as before the swap.
        """
        lent, self.frames[index] = self.frames[index], frame
        return lent

    def close(self):
        """Nothing to undo: no frame is ever left posted."""


class PostedReceives(ReceivePool):
    """Frames that take the requests of the one rank that sends any, posted ahead.

    Each free frame has its receive from ``sender`` posted (a persistent request, made
    once per frame), in the order they are released; messages from one rank on one tag
    come in the order sent, so the oldest posted frame holds the next one.
    """

    def __init__(self, comm, frames, tag, sender):
        super().__init__(comm, frames, tag)
        self.sender = sender
        self.persistent = {}  # id(frame) -> the persistent receive into it
        self.posted = deque()  # (index, request) in the order posted
        while self.free:
            self.release(self.free.pop())

    @property
    def source(self):
        return self.sender

    def wait_next(self, poll_every, on_quiet, deadline, describe, between=None):
        """Return the index of the frame that holds the next message (see the base)."""
        if not self.posted:
            raise RuntimeError("every receive frame is held: a policy kept more frames "
                               "than it asked for")
        index, request = self.posted[0]
        if not request.Test():
            P.wait_until(request.Test, poll_every, on_quiet, between)
        self.posted.popleft()
        return index

    def release(self, index):
        """Give frame ``index`` back: its receive is posted at once."""
        frame = self.frames[index].bytes
        request = self.persistent.get(id(frame))
        if request is None:
            request = self.persistent[id(frame)] = self.comm.Recv_init(
                [frame, MPI.BYTE], self.sender, self.tag)
        request.Start()
        self.posted.append((index, request))

    def close(self):
        """Cancel the receives still posted (the sender has finished) and free them all."""
        for _, request in self.posted:
            request.Cancel()
            request.Wait()
        self.posted.clear()
        for request in self.persistent.values():
            request.Free()
        self.persistent.clear()
