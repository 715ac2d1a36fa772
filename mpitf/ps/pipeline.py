"""A ps's buckets and its replies in flight, by range: apply bucket k while k-1 travels.

A worker cuts its gradient for this ps into buckets (:func:`mpitf.wire.layout.
bucket_ranges`, the same cut on both sides) and pushes them last layers first. The ps
keeps receives posted ahead, applies each bucket to its slice of the shard as it lands and
answers it at once. MPI forbids changing memory a send still reads, so before a bucket's
slice changes only the replies that read that slice are waited for; the others keep going
while the next bucket is received and applied. The last bucket of a push starts the shard
and travels behind the reply header, so a step's header goes out with its last bucket.
"""

from mpi4py import MPI

from ..runtime import ulfm
from ..wire import header as H
from ..wire import protocol as P
from ..wire.layout import bucket_ranges


class Pipeline:
    """The buckets of one shard and the replies in flight (with the range each reads).

    Args:
        slices: the shard's variable slices (``offset``, ``size``).
        size: the shard's elements.
        bucket_bytes: the bucket size the workers cut with (0: one bucket).
        itemsize: bytes per element.
    """

    WHOLE = (-1, None)  # a reply that reads the header and every element
    reply_tag = P.TAG_REPLY  # whole replies' tag (a buddy's adopted shard: TAG_REPLY_WARD)

    def __init__(self, slices, size, bucket_bytes, itemsize):
        self.ranges = bucket_ranges(slices, size, bucket_bytes, itemsize)
        self.count = len(self.ranges)
        self.last = self.count - 1  # pushed last: starts the shard, carries the header
        self.bucketed = self.count > 1
        self.steps = [0] * self.count  # per bucket: how often it was applied
        hdr = H.HEADER_BYTES
        self.spans = [(hdr + lo * itemsize, hdr + hi * itemsize) for lo, hi in self.ranges]
        self.spans[self.last] = (0, self.spans[self.last][1])
        # Replies in flight, by what they read: each bucket's own, and the whole frame's
        # (a pull's) apart; finishing a bucket waits for its list and the whole frame's
        # only, so a step costs the same per bucket however many buckets there are.
        self._bucket_of = {self.reads_of(k): k for k in range(self.count)}
        self.in_flight = [[] for _ in range(self.count)]  # per bucket: (request, worker)
        self.whole = []  # (request, worker) of replies that read everything
        self.newest = None  # the reply posted last (progress() tests it)

    def at_step(self, step):
        """Set every bucket to ``step`` (initial values, a restore)."""
        self.steps = [step] * self.count

    def reads_of(self, bucket):
        """Return the element range a reply of ``bucket`` reads (-1: the header too)."""
        lo, hi = self.ranges[bucket]
        return (-1, hi) if bucket == self.last else (lo, hi)

    def reply_to(self, bucket):
        """Return ``(tag, byte span or None, reads)`` of a reply of ``bucket``.

        None (a pull, or no buckets): the whole frame on ``TAG_REPLY``, reading everything.
        """
        if bucket is None or not self.bucketed:
            return self.reply_tag, None, self.WHOLE
        tag = P.TAG_REPLY if bucket == self.last else P.TAG_REPLY_BUCKET
        return tag, self.spans[bucket], self.reads_of(bucket)

    def add(self, requests, worker, reads):
        """Keep ``requests`` (a reply to ``worker`` reading ``reads``) until finished."""
        k = self._bucket_of.get(reads) if self.bucketed else None
        target = self.whole if k is None else self.in_flight[k]
        for request in requests:
            target.append((request, worker))
        if requests:
            self.newest = requests[-1]

    def sent(self, request, worker):
        """Keep a whole-frame reply just started, unless it has left at once (a small one).

        Tested once, right after its start, so that the next push, which must finish every
        reply before it changes the parameters, finds nothing left to wait for.
        """
        self.newest = request
        try:
            if request.Test():
                return
        except MPI.Exception as exc:  # a reply to a worker that died (ULFM): it is done
            if not ulfm.is_failure(exc):
                raise
            return
        self.whole.append((request, worker))

    def progress(self):
        """Let MPI move the replies in flight (before work that makes no MPI call).

        A posted send may wait for its sender's next MPI call: measured, a 68-byte reply
        left only when the ps polled again. Testing the newest reply runs MPI's progress
        for all.
        """
        if self.newest is not None:
            self.newest.Test()

    def finish(self, deadline, describe, bucket=None):
        """Wait for the replies that read ``bucket``'s slice or the header (None: all)."""
        if not self.bucketed:  # every reply reads the whole frame
            pending = self.whole
        elif bucket is None:
            pending = self.whole
            for k, replies in enumerate(self.in_flight):
                if replies:
                    pending += replies
                    self.in_flight[k] = []
        else:
            pending, self.in_flight[bucket] = self.in_flight[bucket] + self.whole, []
        if pending:
            self.whole = []
            requests = [r for r, _ in pending]
            try:
                if MPI.Request.Testall(requests):  # the usual case: they have left
                    return
                P.wait_all(requests, deadline, lambda i: describe(pending[i][1]))
            except MPI.Exception as exc:
                if not ulfm.is_failure(exc):
                    raise
                # a reply to a worker that died (ULFM): wait for the others' one by one
                for i, request in enumerate(requests):
                    try:
                        P.wait_all([request], deadline, lambda _, i=i: describe(pending[i][1]))
                    except MPI.Exception as each:
                        if not ulfm.is_failure(each):
                            raise
