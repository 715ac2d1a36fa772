"""The ps's path for a push applied as it lands: one frame, async or one gradient a step.

The general path reads a push through the service (``_serve``), its consistency policy
(``on_push``), ``apply`` and ``reply``, and the pipeline's bookkeeping: some twenty Python
calls, which at 4 KiB were about half the round trip. When every push is one frame that
is applied at once and answered at once, :class:`AtOnce` does the same work in one method;
anything else (a stale or early step, a chunked frame, a bucket) goes the general way.
"""

import time

from ..wire import header as H
from ..wire import protocol as P
from .consistency import Async, SyncReplicas


class AtOnce:
    """Apply and answer a one-frame push in one call, as the general path would."""

    __slots__ = ("svc", "sync")

    def __init__(self, svc):
        self.svc = svc
        self.sync = type(svc.policy) is SyncReplicas

    @classmethod
    def for_service(cls, svc):
        """Return an AtOnce for ``svc`` if its pushes are applied as they land, else None.

        So they are with async, or sync with one gradient a step (one worker, no backup
        workers beside it), on one frame, without embedding tables, clipping on the ps or
        a timeline.
        """
        policy = svc.policy
        sync = type(policy) is SyncReplicas and policy.replicas_to_aggregate == 1 and \
            policy.weights is None  # not DeterministicSync, which holds what it receives
        if (sync or type(policy) is Async) and not svc.pipeline.bucketed and \
                svc.tables is None and not svc.timeline.enabled and \
                (svc.config.clip_norm is None or svc.config.mode != "sync"):
            return cls(svc)
        return None

    def takes(self, request):
        """Return True when ``request`` (a header) is a push this path serves."""
        # The words themselves (kind, flags, bucket), not the header's properties.
        return request[0] == P.PUSH and not request[4] & P.FLAG_CHUNKED and \
            request[7] & 0xFFFFFFFF <= 1

    def push(self, frame, index, request, worker):
        """Apply the push in pool frame ``index`` from ``worker`` and answer it.

        Returns True when the frame may be posted again (the policy's answer for a push
        of another step, which it drops or refuses). What the reply does not carry (the
        worker's data position, its step time, byte counts) is noted after it has left:
        the worker waits for nothing else.
        """
        svc = self.svc
        pipe, counters = svc.pipeline, svc.counters
        step, flags = request[1], request[4]
        if self.sync:
            if step != pipe.steps[0]:  # stale (dropped) or early (refused): the policy's
                self._note(frame, request, worker)
                return svc.policy.on_push(svc, worker, step, frame, index)
        else:
            svc.note_staleness(svc.global_step - step)  # the reply carries the largest
        if frame.staged:
            frame.received(request[3])
        if flags & P.FLAG_LEARNING_RATE:
            svc.take_learning_rate(request)
        if pipe.whole:  # a reply still reading the parameters (settle found it under way)
            pipe.finish(svc.stall.steady, svc.describe_reply)  # before they change
        grad = frame.payload  # the shard's size, but for a ward's (a buddy's pool frame):
        if len(grad) != svc.shard.size:  # a view made only then, not one every push
            grad = grad[:svc.shard.size]
        svc.shard.apply(grad, svc.global_step)
        pipe.steps[0] += 1
        svc.global_step += 1
        counters["pushes_applied"] += 1
        svc.write_header()
        reply = svc.shard.reply
        chunk_bytes = svc.chunk_bytes if worker in svc.chunked_workers else None
        pipe.add(reply.isend_published(svc.comm, svc.worker_ranks[worker], pipe.reply_tag,
                                       chunk_bytes), worker, pipe.WHOLE)
        counters["bytes_out"] += reply.bytes.nbytes
        pipe.settle()
        if self.sync:
            svc.note_staleness(0)  # the largest stays as it was
        self._note(frame, request, worker)
        return True

    def _note(self, frame, request, worker):
        """Note a push's arrival: its worker seen, its data position, one step, its bytes."""
        svc = self.svc
        now = svc.last_seen[worker] = svc.last_message = time.monotonic()
        svc.positions[svc.senders.replica_of[worker]] = H.split_position(request[5])
        svc.stepped(worker, now)
        svc.counters["bytes_in"] += H.HEADER_BYTES + request[3] * frame.itemsize
