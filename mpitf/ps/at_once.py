"""The ps's path for a push applied as it lands: one frame, async or one gradient a step.

The general path reads a push through the service (``_serve``), its consistency policy
(``on_push``), ``apply`` and ``reply``, and the pipeline's bookkeeping: some twenty Python
calls, which at 4 KiB were about half the round trip. When every push is one frame that
is applied at once and answered at once, :class:`AtOnce` does the same work in one method;
anything else (a stale or early step, a chunked frame, a bucket) goes the general way.
"""

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
        return request.kind == P.PUSH and not request.flags & P.FLAG_CHUNKED and \
            request.bucket_count == 1

    def push(self, frame, index, request, worker, now):
        """Apply the push in pool frame ``index`` from ``worker`` and answer it.

        Returns True when the frame may be posted again (the policy's answer for a push
        of another step, which it drops or refuses).
        """
        svc = self.svc
        pipe, counters, step = svc.pipeline, svc.counters, request.step
        svc.positions[svc.senders.replica_of[worker]] = (request.epoch, request.cursor)
        svc.stepped(worker, now)
        count = request.count
        frame.received(count)
        counters["bytes_in"] += H.HEADER_BYTES + count * frame.itemsize
        svc.take_learning_rate(request)
        if self.sync:
            if step != pipe.steps[0]:  # stale (dropped) or early (refused): the policy's
                return svc.policy.on_push(svc, worker, step, frame, index)
            svc.note_staleness(0)
        else:
            svc.note_staleness(svc.global_step - step)
        pipe.finish(svc.stall.steady, svc.describe_reply)  # before the parameters change
        lo, hi = pipe.ranges[0]
        svc.shard.apply(frame.payload[:hi - lo], svc.global_step)
        pipe.steps[0] += 1
        svc.global_step += 1
        counters["pushes_applied"] += 1
        svc.write_header()
        reply = svc.shard.reply
        chunk_bytes = svc.chunk_bytes if worker in svc.chunked_workers else None
        pipe.add(reply.isend_published(svc.comm, svc.worker_ranks[worker], pipe.reply_tag,
                                       chunk_bytes), worker, pipe.WHOLE)
        counters["bytes_out"] += reply.bytes.nbytes
        return True
