"""The parameter-server event loop: serve whichever worker's message arrives first.

The ps keeps a small, fixed pool of receive frames that take messages from any worker
(:mod:`mpitf.ps.receive_pool`); a message waits in MPI's queues (or at its sender) until a
frame is free, so memory does not grow with the number of workers. Replies are sent from
the shard's own parameter frame; before the parameters change, outstanding replies are
completed (MPI forbids touching a buffer that is being sent).
"""

import logging
import time

from mpi4py import MPI

from ..config import shard_bucket_bytes
from ..errors import ConfigurationError, DeadlineError, PeerError
from ..runtime.backend import get_backend
from ..runtime.exits import EXIT_REQUEUE, CheckpointSignals
from ..runtime.stall import StepClock
from ..runtime.timeline import Timeline
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame
from .at_once import AtOnce
from .clip import StepClip
from .consistency import make_policy
from .cuts import Cuts
from .handlers import Handlers
from .heals import Heals
from .losses import Losses
from .pipeline import Pipeline
from .receive_pool import receive_pool
from .replica import Replication
from .senders import Senders
from .shard import Shard
from .sparse_inbox import SparseInbox
from .state import ServiceState

_log = logging.getLogger("mpitf")


class Service(Handlers, Cuts, Losses, Heals):
    """One ps task serving the workers of a cluster under a consistency policy.

    ``buddy``: this is a ward, the idle copy of the shard of the ps before ``buddy`` (a
    :class:`Service`), which ``buddy`` serves from its own pool once that ps is lost
    (:meth:`adopt`; see :mod:`mpitf.ps.replica`).
    """

    def __init__(self, server, config, assignment, backend=None, buddy=None):
        self.server = server
        self.comm = server.comm
        self.config = config  # the TrainingConfig the chief trains by
        self.assignment = assignment  # this ps's PsAssignment: its slices, optimizer, ...
        self.deadline = assignment.deadline
        self.is_ward = buddy is not None  # True: this serves a lost ps's shard from a copy
        self.buddy = buddy  # (a ward) the Service of the ps that serves it
        self.ps_task = server.task_index if buddy is None else \
            (buddy.ps_task - 1) % assignment.num_ps
        senders = self.senders = Senders(server.replica_ranks, config.clients, assignment.nodes)
        self.worker_ranks, self.worker_of = senders.ranks, senders.index
        self.num_workers = len(self.worker_ranks)
        self.state = ServiceState(self.num_workers, assignment.chief_rank, senders.counters())
        self.backend = backend or get_backend()
        self.xp = self.backend.xp
        size = assignment.shard_size
        self.shard = Shard.from_config(config, assignment, self.backend, server)
        wire = self.shard.wire  # what the frames carry (a 16-bit wire: not the parameters)
        self.policy = make_policy(config, self.num_workers, assignment.total_num_replicas,
                                  senders.weights)
        self.pipeline = Pipeline(assignment.slices, size,
                                 shard_bucket_bytes(config, size * wire.itemsize), wire.itemsize)
        if buddy is not None:  # its replies go to workers re-routed to the buddy
            self.pipeline.reply_tag = P.TAG_REPLY_WARD
        self.tables = None  # embedding tables (ps/sparse.py): rows pulled and pushed by id
        self.delta_cut = False  # the cut asked for is a delta checkpoint (ps/cuts.py)
        if assignment.sparse:
            if self.backend.name != "numpy":
                raise ConfigurationError("embedding tables need ps tasks on the host for now; "
                                         "run the ps with the numpy backend")
            from .sparse import SparseTables  # its row kernels import numba: tables only

            self.tables = SparseTables(assignment.sparse, self.ps_task, assignment.num_ps,
                                       self.shard.rules.default, config.seed, self.num_workers)
        self.timeline = Timeline(server.rank, server.device, bool(config.timeline))
        self.chunk_bytes = assignment.chunk_bytes
        capacity = senders.capacity(self.tables.capacity if self.tables else None)
        capacity = max(capacity or 0, self.shard.rules.rates_bytes) or None  # RATES fit
        pool_size = size  # a lost ward's pushes land in its buddy's frames too (FLAG_WARD)
        if buddy is not None:  # its sparse inbox's spares join the buddy's pool
            pool_size = max(size, buddy.assignment.shard_size)
        elif config.ps_replication_steps and assignment.ward is not None:
            pool_size = max(size, assignment.ward.shard_size)
        frames = self.policy.receive_buffers(self.num_workers, self.pipeline.bucketed)
        self.pool = buddy.pool if buddy is not None else receive_pool(  # a ward's: FLAG_WARD
            self.comm, [Frame.allocate(self.backend, pool_size, wire, capacity)
                        for _ in range(frames)], P.TAG_REQUEST, self.worker_ranks,
            bool(config.ps_replication_steps), server.ulfm,
            self._grown_frame if self.tables else None)
        self.sparse = SparseInbox(self, pool_size, wire, capacity) if self.tables else None
        self.frames_grown = 0  # receive frames made larger for a request (tables)
        # Stall detection: the gaps between a worker's pushes are its steps; a worker with
        # no push since start-up or a pause (state.last_push None) gets the whole deadline.
        self.stall = StepClock.for_ps(self.deadline, assignment.adaptive, self.num_workers)
        self.check_every = None if self.deadline is None else min(1.0, self.deadline / 10)
        # What the policy decides about an apply: the update rule (the optimizer's, or an
        # average put in place), whether the ps clips (sync: the session's clip_norm, or
        # the workers' clip_grad_norm_, see ps/clip.py), and the one-frame update that
        # needs nothing beside it (no buckets, tables, clipping or timeline; one rule).
        policy = self.policy
        self.update = self.shard.apply if policy.applies_gradients else self.shard.assign
        self.clip = StepClip(None, server.job_comm, self.pipeline.count)
        self._whole_update = self.shard.apply_whole if (
            policy.applies_gradients and not self.pipeline.bucketed and self.tables is None
            and not self.timeline.enabled) else None
        self.set_clip_norm(config.clip_norm if policy.mode.clips_on_ps else None)
        # A host reply frame with nothing to publish beside it (a moving average) goes out
        # by a persistent send per worker (see apply_and_reply); not a ward's (a lost ps's
        # shard), whose replies go to whoever is re-routed to it.
        self.plain_replies = not self.shard.reply.unpublished and buddy is None and \
            self.shard.average_frame is None and not self.pipeline.bucketed
        self.sends = {}  # worker -> its persistent reply send (plain_replies)
        # The state whose step replies and checkpoint cuts name: a served copy's is its
        # buddy's under async (the pushes in flight when the ps died count on the buddy's
        # own shard or on the copy, not always on both, so the two counts drift by a step
        # or two); where the policy's steps stay together (sync, local SGD), its own.
        self.cut_state = buddy.state if buddy is not None and \
            not policy.mode.steps_together else self.state
        self.at_once = AtOnce.for_service(self)  # one-frame pushes applied as they land
        self.serve = self._serve if self.at_once is None else self.at_once.serve
        self._handlers = {P.PUSH: self._on_push, P.RATES: self._on_rates,
                          P.SPARSE_PULL: self._on_sparse, P.SPARSE_PUSH: self._on_sparse,
                          P.SKIP: self._on_skip, P.PULL: self._on_pull,
                          P.PULL_AVERAGE: self._on_pull, P.INIT: self._on_init,
                          P.DONE: self._on_done, P.PAUSED: self._on_paused,
                          P.SAVE: self._on_save, P.COUNTERS: self._on_counters,
                          P.HEAL: self._on_heal}
        if assignment.restore:
            self._restore(self.state, assignment.restore)
        # The buddy ring (ps/replica.py), with --ps-replication-steps: this ps's copies to
        # its buddy, and the ward that serves the previous ps's shard once that ps is lost.
        self.replica = self._replication() if buddy is None and \
            config.ps_replication_steps and assignment.ward is not None else None

    # -- what policies call -------------------------------------------------------------

    def describe_worker(self, worker, operation):
        """Return keyword arguments naming a worker for a PeerError."""
        return self.server.peer(self.worker_ranks[worker], operation)

    def drop(self, worker, staleness, bucket=0):
        """Drop a stale gradient (a bucket of it), count it, and answer with the parameters."""
        if bucket == self.pipeline.last:
            self.state.counters["stale_dropped"] += 1
            self.state.note_staleness(staleness)
            if self.tables:
                self.sparse.discard(worker)
        self.reply(worker, bucket=bucket)

    def apply_and_reply(self, grad, workers, bucket=0, steps=1, reply=True, released=False):
        """Apply ``grad`` (or ``workers``' mean) to a bucket's slice; answer each of ``workers``.

        The one way a push changes the shard and is answered, on every path. The update
        runs once the replies reading the slice have left; the last bucket advances the
        step by ``steps``. ``reply`` False: the policy answers later (ssp holds a worker).
        A clipped step's buckets wait for its last one (ps/clip.py), then come back here
        ``released``, in order. A whole host reply to a worker that does not stage goes
        out by a persistent send of its own, restarted without a test first.
        """
        if self.holds_buckets and not released:
            return self._hold_for_clip(grad, workers, bucket, steps, reply)
        pipe, state = self.pipeline, self.state
        if pipe.bucketed or pipe.whole:  # replies still reading what changes now
            pipe.finish(self.stall.steady, self.describe_reply, bucket)
        step = state.global_step
        last = bucket == pipe.last
        if self.whole_update is not None:  # one frame and nothing beside the update (4 KiB)
            size = self.shard.size
            if len(grad) != size:  # a ward's push lands in its buddy's larger pool frame:
                grad = grad[:size]  # a view made only then, not one every push
            self.whole_update(grad, step)
            hi = None
        else:
            lo, hi = self._update(grad, workers, bucket, step, last)
        pipe.steps[bucket] += steps
        if last:
            state.global_step = step + steps
            state.counters["pushes_applied"] += 1
            self.write_header(hi if pipe.bucketed else None)
        else:
            self.shard.publish(lo, hi)
        if not reply:
            return
        if not (self.plain_replies and last):
            for w in workers:
                self.reply(w, bucket=bucket)
            return
        comm, frame, sends, counters = self.comm, self.shard.reply, self.sends, state.counters
        for w in workers:
            send = sends.get(w)
            if send is None:
                if w in state.chunked_workers:
                    self.reply(w, bucket=bucket)
                    continue
                send = sends[w] = P.frame_op(comm.Send_init, frame.bytes, self.worker_ranks[w],
                                             pipe.reply_tag)
            send.Start()
            pipe.sent(send, w)
            counters["bytes_out"] += frame.bytes.nbytes

    def _hold_for_clip(self, grad, workers, bucket, steps, reply):
        """Hold a clipped step's bucket; at its last, apply and answer every bucket in order."""
        if self.clip.hold(self, grad, workers, bucket, steps):
            for held in self.clip.release(self):
                self.apply_and_reply(*held, reply=reply, released=True)

    def _update(self, grad, workers, bucket, step, last):
        """Run the update rule on ``bucket``'s slice (not the one-frame update); return it.

        Clipped here where the mode says the ps clips; a push's last bucket applies the
        sparse pushes of ``workers`` too (embedding tables; their sum divided by as many),
        once the replies have left (:meth:`SparseInbox.flush`, before the next request).
        """
        start = time.perf_counter()
        lo, hi = self.pipeline.ranges[bucket]
        if self.clip.max_norm is not None and not self.pipeline.bucketed:  # the whole mean
            if grad.dtype != self.shard.dtype:  # one worker's, in a 16-bit wire dtype
                grad = self.shard.widen(grad, lo, hi)
            self.clip.clip((grad,))
        self.update(grad, step, lo, hi)
        if self.tables and last:
            self.sparse.apply(workers, step)
        if self.timeline.enabled:
            self.timeline.add("apply", start, time.perf_counter(), step=step, bucket=bucket)
        return lo, hi

    def reply(self, worker, frame=None, bucket=None):
        """Send the parameters (or ``frame``, or one bucket's) to ``worker``, not blocking."""
        chunk_bytes = self.chunk_bytes if worker in self.state.chunked_workers else None
        tag, span, reads = self.pipeline.reply_to(bucket if frame is None else None)
        frame = frame or self.shard.reply
        requests = frame.isend_published(self.comm, self.worker_ranks[worker], tag,
                                         chunk_bytes, span)
        self.pipeline.add(requests, worker, reads)
        self.state.counters["bytes_out"] += \
            frame.bytes.nbytes if span is None else span[1] - span[0]

    def release(self, index):
        """Give pool frame ``index`` back to the receives (a held gradient was used)."""
        self.pool.release(index)

    def set_clip_norm(self, max_norm):
        """Clip each step's mean to ``max_norm`` from the next step on (None: no clipping).

        A clipped step is not the one-frame update; with buckets its buckets are held
        until the last is in (``holds_buckets``: :meth:`apply_and_reply` asks it first).
        """
        self.clip.max_norm = max_norm
        if max_norm is None:
            self.clip.last_norm = None
        self.whole_update = self._whole_update if max_norm is None else None
        self.holds_buckets = max_norm is not None and self.pipeline.bucketed

    def take_learning_rate(self, request):
        """Set the rate a push carries (mpitf.torch's): the next update applies it."""
        lr = H.learning_rate_of(request)
        if lr is not None:
            self.shard.optimizer.set_learning_rate(lr)

    def adopt(self):
        """(A ward) serve the lost ps's shard from now, restored from its copy.

        It goes on at the buddy's step (the steps since its copy are lost): sync steps and
        checkpoint cuts stay aligned across the ps. It knows the workers as the buddy does.
        """
        state, theirs = self.state, self.buddy.state
        state.global_step = state.counters["global_step"] = theirs.global_step
        self.shard.restored()
        self.pipeline.at_step(theirs.global_step)
        state.initialized = True
        state.done |= theirs.done
        state.lost |= theirs.lost
        state.chief, state.chief_flags = theirs.chief, theirs.chief_flags
        self.write_header()

    # -- internals -----------------------------------------------------------------------

    def _replication(self):
        """Return the buddy ring's end on this ps (ps/replica.py), with its ward idle."""
        server = self.server
        ps_ranks = server.ranks_of("ps")
        server.survive(ps_ranks)  # a ps's death is no error now (its buddy serves its shard)
        ward = Service(server, self.config, self.assignment.ward, buddy=self)
        return Replication(self, ward, self.config.ps_replication_steps, ps_ranks)

    def write_header(self, hi=None):
        """Refresh the reply header (none in flight) and publish the payload (up to ``hi``)."""
        state, reply, average = self.state, self.shard.reply, self.shard.average_frame
        c = state.counters
        c["global_step"] = step = self.cut_state.global_step
        H.pack_reply(reply.header, step, self.ps_task,
                     (P.FLAG_PAUSE if state.pausing else 0) |
                     (P.FLAG_HEAL if state.healing else 0) | state.chief_flags,
                     c["pushes_applied"], c["stale_dropped"], c["max_staleness"], c["max_lead"],
                     P.REPLY, self.clip.last_norm)
        if reply.unpublished:  # a host frame is as MPI reads it
            reply.publish(0, hi)
        if average is not None:
            average.header[...] = reply.header
            average.publish(0, hi)

    def _grown_frame(self, nbytes):
        """Return a receive frame for a request of ``nbytes`` (sparse: the batch grew)."""
        if not self.frames_grown:
            _log.info("ps task %d: a request of %d bytes, more than its receive frames "
                      "held: they grow to fit (each once)", self.ps_task, nbytes)
        self.frames_grown += 1
        return Frame.allocate(self.backend, self.shard.size, self.shard.wire, nbytes)

    def _describe_sender(self, rank):
        worker = self.worker_of.get(rank)
        if worker is None:
            return self.server.peer(rank, "request")
        return self.describe_worker(worker, "push")

    def describe_reply(self, worker):
        return self.describe_worker(worker, "reply (the worker stopped receiving)")

    def _finish_replies(self):
        self.pipeline.finish(self.stall.steady, self.describe_reply)

    def stepped(self, worker, now):
        """Count a push, and the gap since ``worker``'s previous push as one of its steps."""
        state = self.state
        state.counters["pushes_received"] += 1
        last = state.last_push[worker]
        if last is not None:
            self.stall.step(now - last)
        state.last_push[worker] = now

    def _timeout(self):
        """Raise naming a worker silent for longer than its allowance (checked every second).

        Workers that finished, paused for a checkpoint or wait on others (sync, ssp) are
        not expected to speak.
        """
        now, state = time.monotonic(), self.state
        state.next_check = now + self.check_every
        for w in range(self.num_workers):
            if w in state.done or w in state.paused or self.policy.is_waiting(w):
                continue
            steady = state.last_push[w] is not None
            allowance = self.stall.steady if steady else self.stall.start_up
            if now - state.last_seen[w] > allowance:
                how = (f"; its steps took up to {self.stall.slowest:.3g} s"
                       if steady and self.stall.adaptive else "")
                raise DeadlineError(f"no message for {allowance:.3g} s from a worker while "
                                    f"/job:ps/task:{self.ps_task} waited for its push{how}",
                                    **self.describe_worker(w, "push"))

    def _serve(self, index, source):
        """Serve the request in pool frame ``index``; return True when the frame is free."""
        frame = self.pool.frames[index]
        request = H.unpack_request(frame.fetch_header())
        if request.flags & P.FLAG_WARD and not self.is_ward:  # a lost ps's shard: its copy
            return self._serve_ward(index, source, request)
        worker = self.worker_of.get(source)
        if worker is None:
            raise PeerError(f"request from rank {source}, which is not a worker")
        state = self.state
        now = state.last_seen[worker] = state.last_message = time.monotonic()
        self.senders.note_positions(state.positions, worker, request, frame)
        if request.flags & P.FLAG_CHUNKED:
            self._chunked(worker, source, request, frame)
        handler = self._handlers.get(request.kind)
        if handler is None:
            raise PeerError(f"unknown request kind {request.kind}",
                            **self.describe_worker(worker, "?"))
        return handler(state, worker, request, frame, index, now)

    def _serve_ward(self, index, source, request):
        replica = self.replica
        if replica is not None and not replica.adopted:  # a worker saw the loss first:
            # this ps learns of it in a moment
            replica.await_loss(lambda exc: self._take_failures(self.state, exc))
        if replica is None or not replica.adopted:
            raise PeerError("a request for a lost ps's shard, which this ps does not hold",
                            **self._describe_sender(source))
        replica.note_rerouted(request.step)
        return replica.ward.serve(index, source)

    def _chunked(self, worker, source, request, frame):
        """Note a worker that stages; receive the rest of its push or init (chunk 0 came)."""
        self.state.chunked_workers.add(worker)
        if request.kind in (P.PUSH, P.INIT) and self.chunk_bytes:
            nbytes = H.HEADER_BYTES + request.count * frame.itemsize
            frame.receive_rest(self.comm, source, P.TAG_REQUEST, self.chunk_bytes,
                               self.deadline,
                               lambda i: self.describe_worker(worker, "push (chunked)"),
                               nbytes if request.kind == P.PUSH else None)

    def run(self):
        """Serve until every worker is done; return the process exit code.

        The one loop over the receive pool, whatever the pool: each request goes to
        :attr:`serve` (the one-frame path's reader where it has one, else :meth:`_serve`).
        """
        pool, replica, sparse, serve = self.pool, self.replica, self.sparse, self.serve
        state = self.state
        waits = (self.check_every, self._timeout, self.deadline, self._describe_sender,
                 None if replica is None else replica.watch)  # made once, not per request
        while len(state.done) < self.num_workers or (
                replica is not None and replica.adopted and
                len(replica.ward.state.done) < self.num_workers):
            try:
                index = pool.wait_next(*waits)
            except MPI.Exception as exc:
                self.lose_failed(state, exc)
                continue
            if serve(index, pool.source):
                pool.release(index)
            if sparse is not None:
                sparse.flush()  # the step's replies have left: now its sparse apply
            if replica is not None:
                replica.after_step()  # a copy to the buddy every K steps
                replica.poll()  # the ward's copies
            if self.check_every is not None and state.last_message > state.next_check:
                self._timeout()  # busy: without this, one silent worker would go unseen
        self._finish_replies()
        pool.close()
        for send in self.sends.values():  # every reply has been finished
            send.Free()
        self.sends.clear()
        if replica is not None:
            replica.close()
            replica.ward._finish_replies()
            replica.ward.shard.close()
        if self.sparse:
            self.sparse.close()
            for name, stats in self.tables.stats().items():  # the tables that grow
                if "admitted" in stats:
                    _log.info("ps task %d, table %r: %s", self.ps_task, name,
                              ", ".join(f"{k} {v}" for k, v in stats.items()))
        self.shard.close()
        return EXIT_REQUEUE if state.requeue else 0


def serve(server):
    """Receive the configuration from the chief and serve until every worker is done.

    The chief sends a (:class:`~mpitf.config.TrainingConfig`,
    :class:`~mpitf.config.PsAssignment`) pair to each ps.
    """
    if not server.replica_ranks:
        raise ConfigurationError(
            "a ps serves the chief and worker tasks, but the cluster has none: add a "
            "'worker' (or 'chief') job to the spec")
    # A checkpoint signal is the chief's to act on; the ps must only survive it.
    CheckpointSignals().install()
    chief = server.replica_ranks[server.chief_index]
    config, assignment = P.recv_object(
        server.comm, chief, P.TAG_CONTROL, server.deadline,
        lambda: server.peer(chief, "configuration of the ps"))
    service = Service(server, config, assignment)
    if server.replacement is not None:  # spawned for a lost ps (--heal): its buddy's shard
        service.take_shard(Service.receive_shard(server))
    code = service.run()
    if config.timeline:  # collective with the workers' end of training
        service.timeline.gather_and_write(server.comm, config.timeline)
    return code
