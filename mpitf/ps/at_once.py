"""The ps's path for a push applied as it lands: one frame, async or one gradient a step.

The general path reads a push through the service (``_serve``), its consistency policy
(``on_push``), ``apply`` and ``reply``, and the pipeline's bookkeeping: some twenty Python
calls, which at 4 KiB were about half the round trip. When every push is one frame that
is applied at once and answered at once, :class:`AtOnce` does the same work in one method;
anything else (a stale or early step, a chunked frame, a bucket) goes the general way.

A ps with one sender (:class:`~mpitf.ps.receive_pool.PostedReceives`: one worker, no
rerouting) runs :meth:`AtOnce.run` instead of the service's loop: each request's words
are read once, and a push this path takes goes straight to :meth:`AtOnce.push`; anything
else goes to ``Service._serve`` as before. A host reply goes out by a persistent send of
this path's own. What a 4 KiB round trip pays on the ps is the Python between
a push landing and its reply leaving; the notes after it overlap the worker's own work.
"""

import time

from ..wire import header as H
from ..wire import protocol as P
from .consistency import Async, SyncReplicas
from .receive_pool import PostedReceives

_NOT_HERE = P.FLAG_CHUNKED | P.FLAG_WARD  # a staged sender's chunks; a lost ps's shard


class AtOnce:
    """Apply and answer a one-frame push in one call, as the general path would."""

    __slots__ = ("svc", "sync", "plain", "sends")

    def __init__(self, svc):
        self.svc = svc
        self.sync = type(svc.policy) is SyncReplicas
        # A host reply frame with nothing to publish beside it (a moving average) goes out
        # by a persistent send per worker, restarted each push without the test the frame's
        # own send makes first (every earlier reply has been finished); else the frame's
        # way (isend_published), as does a ward's (a lost ps's shard), which learns its
        # buddy after this.
        shard = svc.shard
        self.plain = not shard.reply.unpublished and shard.average_frame is None
        self.sends = {}  # worker -> its persistent reply send (plain frames)

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

    def runs_loop(self):
        """Return True when the service's loop is :meth:`run`: the ps has one sender."""
        svc = self.svc
        return isinstance(svc.pool, PostedReceives) and svc.replica is None

    def takes(self, request):
        """Return True when ``request`` (a header) is a push this path serves."""
        # The words themselves (kind, flags, bucket), not the header's properties.
        return request[0] == P.PUSH and not request[4] & _NOT_HERE and \
            request[7] & 0xFFFFFFFF <= 1

    def run(self):
        """Serve the one sender until every worker is done (the service's loop, shorter)."""
        svc = self.svc
        pool = svc.pool
        frames, source = pool.frames, pool.source
        wait_args = (svc.check_every, svc._timeout, svc.deadline, svc._describe_sender)
        worker = svc.worker_of[source]
        while len(svc.done) < svc.num_workers:
            index = pool.wait_next(*wait_args)
            frame = frames[index]
            request = H.read_words(frame.fetch_header())  # push reads the words by index
            if self.takes(request):
                free = self.push(frame, index, request, worker)
            else:
                free = svc._serve(index, source)
            if free:
                pool.release(index)
            if svc.check_every is not None and svc.last_message > svc.next_check:
                svc._timeout()  # busy: without this, a silent worker would go unseen

    def push(self, frame, index, request, worker):
        """Apply the push in pool frame ``index`` from ``worker`` and answer it.

        ``request``: the header's words, named (:class:`~mpitf.wire.header.RequestHeader`)
        or not (:func:`~mpitf.wire.header.read_words`); they are read by index. Returns
        True when the frame may be posted again (the policy's answer for a push of another
        step, which it drops or refuses). What the reply does not carry (the worker's data
        position, its step time, byte counts) is noted after it has left: the worker waits
        for nothing else.
        """
        svc = self.svc
        pipe, counters = svc.pipeline, svc.counters
        step = request[1]
        if self.sync:
            if step != pipe.steps[0]:  # stale (dropped) or early (refused): the policy's
                self._note(frame, request, worker)
                return svc.policy.on_push(svc, worker, step, frame, index)
        else:
            svc.note_staleness(svc.global_step - step)  # the reply carries the largest
        if frame.staged:
            frame.received(request[3])
        if request[4] & P.FLAG_LEARNING_RATE:
            svc.take_learning_rate(request)
        if pipe.whole:  # a reply still reading the parameters (it had not left at once)
            pipe.finish(svc.stall.steady, svc.describe_reply)  # before they change
        grad = frame.payload  # the shard's size, but for a ward's (a buddy's pool frame):
        if len(grad) != svc.shard.size:  # a view made only then, not one every push
            grad = grad[:svc.shard.size]
        svc.shard.apply_whole(grad, svc.global_step)
        pipe.steps[0] += 1
        svc.global_step += 1
        counters["pushes_applied"] += 1
        self._reply(worker)
        if self.sync:
            svc.note_staleness(0)  # the largest stays as it was
        self._note(frame, request, worker)
        return True

    def _reply(self, worker):
        """Send ``worker`` the parameters just updated, behind a fresh reply header."""
        svc = self.svc
        pipe, reply, rank = svc.pipeline, svc.shard.reply, svc.worker_ranks[worker]
        svc.write_header()
        if self.plain and svc.buddy is None and worker not in svc.chunked_workers:
            send = self.sends.get(worker)
            if send is None:
                send = self.sends[worker] = P.frame_op(svc.comm.Send_init, reply.bytes, rank,
                                                       pipe.reply_tag)
            send.Start()  # no test first, as the frame's own send makes: push finished them
            pipe.sent(send, worker)
        else:
            chunk_bytes = svc.chunk_bytes if worker in svc.chunked_workers else None
            for request in reply.isend_published(svc.comm, rank, pipe.reply_tag, chunk_bytes):
                pipe.sent(request, worker)
        svc.counters["bytes_out"] += reply.bytes.nbytes

    def _note(self, frame, request, worker):
        """Note a push's arrival: its worker seen, its data position, one step, its bytes."""
        svc = self.svc
        now = svc.last_seen[worker] = svc.last_message = time.monotonic()
        svc.positions[svc.senders.replica_of[worker]] = H.split_position(request[5])
        svc.stepped(worker, now)
        svc.counters["bytes_in"] += H.HEADER_BYTES + request[3] * frame.itemsize

    def close(self):
        """Free the persistent reply sends (every reply has been finished)."""
        for send in self.sends.values():
            send.Free()
        self.sends.clear()
