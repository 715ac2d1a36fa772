"""The ps's reader of a push applied as it lands: one frame, async or one gradient a step.

The general path reads a request through the service (``_serve``), its handler and its
consistency policy: some twenty Python calls, which at 4 KiB were about half the round
trip. When every push is one frame that its policy applies and answers at once,
:meth:`AtOnce.serve` reads each request's words once, asks the policy to admit a push
and calls the service's one :meth:`~mpitf.ps.service.Service.apply_and_reply`, as the
policy would; anything else (a chunked frame, a lost ps's shard, any other request) goes
to ``Service._serve``. What the reply does not carry (the worker's data position, its
step time, byte counts) is noted after it has left: the worker waits for nothing else.
"""

import time

from ..wire import header as H
from ..wire import protocol as P

_NOT_HERE = P.FLAG_CHUNKED | P.FLAG_WARD  # a staged sender's chunks; a lost ps's shard


class AtOnce:
    """Read a request's words once; admit, apply and answer a one-frame push in one call."""

    __slots__ = ("svc", "frames", "alone")

    def __init__(self, svc):
        self.svc = svc
        self.frames = svc.pool.frames
        self.alone = {w: (w,) for w in range(svc.num_workers)}  # apply's workers, made once

    @classmethod
    def for_service(cls, svc):
        """Return an AtOnce for ``svc`` if its pushes are applied as they land, else None.

        So they are when the policy applies each push alone and at once (async, or sync
        with one gradient a step) and the apply is the one-frame update: no buckets,
        embedding tables, clipping on the ps or timeline.
        """
        if svc.whole_update is not None and svc.policy.applies_at_once():
            return cls(svc)
        return None

    def serve(self, index, source):
        """Serve the request in pool frame ``index`` (the service's ``serve``); return True.

        A one-frame push (its words read once, by index) the policy admits is applied and
        answered by :meth:`~mpitf.ps.service.Service.apply_and_reply`; one it does not (a
        stale push, dropped and answered) changes nothing, its learning rate included, as
        on the general path. Anything else goes to ``Service._serve``.
        """
        frame = self.frames[index]
        request = H.read_words(frame.fetch_header())
        svc = self.svc
        # The words themselves (kind, flags, bucket), not the header's properties.
        worker = svc.worker_of.get(source)
        if request[0] != P.PUSH or request[4] & _NOT_HERE or request[7] & 0xFFFFFFFF > 1 or \
                worker is None:
            return svc._serve(index, source)
        if svc.policy.admit(svc, worker, request[1]):
            if frame.staged:
                frame.received(request[3])
            if request[4] & P.FLAG_LEARNING_RATE:
                svc.take_learning_rate(request)
            svc.apply_and_reply(frame.payload, self.alone[worker])
        state = svc.state
        now = state.last_seen[worker] = state.last_message = time.monotonic()
        state.positions[svc.senders.replica_of[worker]] = H.split_position(request[5])
        svc.stepped(worker, now)
        state.counters["bytes_in"] += H.HEADER_BYTES + request[3] * frame.itemsize
        return True
