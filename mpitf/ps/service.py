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

from ..errors import ConfigurationError, DeadlineError, PeerError
from ..models.clipping import clip_by_global_norm
from ..runtime.backend import get_backend
from ..runtime.exits import EXIT_REQUEUE, CheckpointSignals
from ..runtime.stall import StepClock
from ..runtime.timeline import Timeline
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame
from .at_once import AtOnce
from .consistency import make_policy
from .cuts import Cuts
from .handlers import Handlers
from .losses import Losses
from .pipeline import Pipeline
from .receive_pool import receive_pool
from .replica import Replication
from .senders import Senders
from .shard import Shard
from .sparse_inbox import SparseInbox

_log = logging.getLogger("mpitf")


class Service(Handlers, Cuts, Losses):
    """One ps task serving the workers of a cluster under a consistency policy."""

    def __init__(self, server, config, assignment, backend=None):
        self.server = server
        self.comm = server.comm
        self.config = config  # the TrainingConfig the chief trains by
        self.assignment = assignment  # this ps's PsAssignment: its slices, optimizer, ...
        self.deadline = assignment.deadline
        self.ps_task = server.task_index
        self.chief = assignment.chief_rank
        senders = self.senders = Senders(server.replica_ranks, config.clients, assignment.nodes)
        self.worker_ranks, self.worker_of = senders.ranks, senders.index
        self.num_workers = len(self.worker_ranks)
        self.backend = backend or get_backend()
        self.xp = self.backend.xp
        size = assignment.shard_size
        self.shard = Shard.from_config(config, assignment, self.backend, server)
        wire = self.shard.wire  # what the frames carry (a 16-bit wire: not the parameters)
        self.policy = make_policy(config, self.num_workers, assignment.total_num_replicas,
                                  senders.weights)
        self.pipeline = Pipeline(assignment.slices, size, config.bucket_bytes, wire.itemsize)
        self.tables = None  # embedding tables (ps/sparse.py): rows pulled and pushed by id
        if assignment.sparse:
            if self.backend.name != "numpy":
                raise ConfigurationError("embedding tables need ps tasks on the host for now; "
                                         "run the ps with the numpy backend")
            from .sparse import SparseTables  # its row kernels import numba: tables only

            self.tables = SparseTables(assignment.sparse, self.ps_task, assignment.num_ps,
                                       self.shard.rules.default, config.seed, self.num_workers)
        self.timeline = Timeline(server.rank, server.device, bool(config.timeline))
        self.chunk_bytes = assignment.chunk_bytes
        self.chunked_workers = set()  # workers that stage through host memory, in chunks
        capacity = senders.capacity(self.tables.capacity if self.tables else None)
        capacity = max(capacity or 0, self.shard.rules.rates_bytes) or None  # RATES fit
        frames = self.policy.receive_buffers(self.num_workers, self.pipeline.bucketed)
        self.pool = receive_pool(self.comm, [Frame.allocate(self.backend, size, wire, capacity)
                                             for _ in range(frames)], P.TAG_REQUEST,
                                 self.worker_ranks, bool(config.ps_replication_steps),
                                 server.ulfm)
        self.sparse = SparseInbox(self, size, wire, capacity) if self.tables else None
        self.global_step = 0
        self.initialized = False
        self.pending_pulls = []
        self.done, self.paused = set(), set()
        self.lost = set()  # workers that died (ULFM): done, and their pushes never come
        self.chief_flags = 0  # replies' flags naming the chief's successor (P.CHIEF_SHIFT)
        self.requeue = False
        self.pausing = False
        self.positions = {}
        self.last_seen = {w: time.monotonic() for w in range(self.num_workers)}
        # Stall detection: the gaps between a worker's pushes are its steps; a worker with
        # no push since start-up or a pause (None) gets the whole deadline.
        self.stall = StepClock.for_ps(self.deadline, assignment.adaptive, self.num_workers)
        self.last_push = [None] * self.num_workers
        self.check_every = None if self.deadline is None else min(1.0, self.deadline / 10)
        self.next_check = 0.0
        self.last_message = 0.0  # when the last request arrived (any worker)
        self.counters = dict(global_step=0, pushes_applied=0, stale_dropped=0,
                             nonfinite_skipped=0, staleness_histogram={}, max_staleness=0,
                             max_lead=0, bytes_in=0, bytes_out=0, **senders.counters())
        self.replica = None  # the buddy ring (ps/replica.py), with --ps-replication-steps
        self.is_ward = False  # True: this serves a lost ps's shard from its buddy's copy
        self.buddy = None  # (a ward) the Service of the ps that serves it
        self.at_once = AtOnce.for_service(self)  # one-frame pushes applied as they land
        self._handlers = {P.PUSH: self._on_push, P.RATES: self._on_rates,
                          P.SPARSE_PULL: self._on_sparse, P.SPARSE_PUSH: self._on_sparse,
                          P.SKIP: self._on_skip, P.PULL: self._on_pull,
                          P.PULL_AVERAGE: self._on_pull, P.INIT: self._on_init,
                          P.DONE: self._on_done, P.PAUSED: self._on_paused,
                          P.SAVE: self._on_save, P.COUNTERS: self._on_counters}
        if assignment.restore:
            self._restore(assignment.restore)

    # -- what policies call -------------------------------------------------------------

    @property
    def num_active(self):
        """Return the number of workers that have not finished."""
        return self.num_workers - len(self.done)

    def unblocked_workers(self):
        """Return the workers still training (neither finished nor paused)."""
        return [w for w in range(self.num_workers) if w not in self.done and w not in self.paused]

    def describe_worker(self, worker, operation):
        """Return keyword arguments naming a worker for a PeerError."""
        return self.server.peer(self.worker_ranks[worker], operation)

    def note_staleness(self, staleness):
        """Count a gradient of the given staleness (steps behind the ps) in the histogram."""
        counters = self.counters
        hist = counters["staleness_histogram"]
        hist[staleness] = hist.get(staleness, 0) + 1
        if staleness > counters["max_staleness"]:
            counters["max_staleness"] = staleness

    def note_lead(self, lead):
        """Record how far a worker ran ahead of the slowest (bounded staleness)."""
        self.counters["max_lead"] = max(self.counters["max_lead"], lead)

    def drop(self, worker, staleness, bucket=0):
        """Drop a stale gradient (a bucket of it), count it, and answer with the parameters."""
        if bucket == self.pipeline.last:
            self.counters["stale_dropped"] += 1
            self.note_staleness(staleness)
            if self.tables:
                self.sparse.discard(worker)
        self.reply(worker, bucket=bucket)

    def apply(self, grad, workers, bucket=0):
        """Apply a gradient (or ``workers``' mean) to a bucket's slice, after its readers.

        A push's last bucket completes the step, with the sparse pushes of ``workers``
        (embedding tables; their sum divided by as many), applied once the replies have
        left (:meth:`SparseInbox.flush`, before the next request is read).
        """
        pipe = self.pipeline
        last = bucket == pipe.last
        pipe.finish(self.stall.steady, self.describe_reply, bucket)
        start = time.perf_counter()
        lo, hi = pipe.ranges[bucket]
        if self.config.clip_norm is not None and self.config.mode == "sync":  # one bucket
            if grad.dtype != self.shard.dtype:  # one worker's, in a 16-bit wire dtype
                grad = self.shard.widen(grad, lo, hi)
            clip_by_global_norm((grad,), self.config.clip_norm, self.server.job_comm)
        self.shard.apply(grad, self.global_step, lo, hi)
        if self.tables and last:
            self.sparse.apply(workers, self.global_step)
        if self.timeline.enabled:
            self.timeline.add("apply", start, time.perf_counter(), step=self.global_step,
                              bucket=bucket)
        pipe.steps[bucket] += 1
        if last:
            self.global_step += 1
            self.counters["pushes_applied"] += 1
            self.write_header(hi if pipe.bucketed else None)
        else:
            self.shard.publish(lo, hi)

    def reply(self, worker, frame=None, bucket=None):
        """Send the parameters (or ``frame``, or one bucket's) to ``worker``, not blocking."""
        chunk_bytes = self.chunk_bytes if worker in self.chunked_workers else None
        tag, span, reads = self.pipeline.reply_to(bucket if frame is None else None)
        frame = frame or self.shard.reply
        requests = frame.isend_published(self.comm, self.worker_ranks[worker], tag,
                                         chunk_bytes, span)
        self.pipeline.add(requests, worker, reads)
        self.counters["bytes_out"] += frame.bytes.nbytes if span is None else span[1] - span[0]

    def release(self, index):
        """Give pool frame ``index`` back to the receives (a held gradient was used)."""
        self.pool.release(index)

    def take_learning_rate(self, request):
        """Set the rate a push carries (mpitf.torch's): the next update applies it."""
        lr = H.learning_rate_of(request)
        if lr is not None:
            self.shard.optimizer.set_learning_rate(lr)

    # -- internals -----------------------------------------------------------------------

    def write_header(self, hi=None):
        """Refresh the reply header (none in flight) and publish the payload (up to ``hi``)."""
        c, reply, average = self.counters, self.shard.reply, self.shard.average_frame
        c["global_step"] = step = self.cut_step()
        H.pack_reply(reply.header, step, self.ps_task,
                     (P.FLAG_PAUSE if self.pausing else 0) | self.chief_flags, c["pushes_applied"],
                     c["stale_dropped"], c["max_staleness"], c["max_lead"])
        if reply.unpublished:  # a host frame is as MPI reads it
            reply.publish(0, hi)
        if average is not None:
            average.header[...] = reply.header
            average.publish(0, hi)

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
        self.counters["pushes_received"] += 1
        last = self.last_push[worker]
        if last is not None:
            self.stall.step(now - last)
        self.last_push[worker] = now

    def _timeout(self):
        """Raise naming a worker silent for longer than its allowance (checked every second).

        Workers that finished, paused for a checkpoint or wait on others (sync, ssp) are
        not expected to speak.
        """
        now = time.monotonic()
        self.next_check = now + self.check_every
        for w in range(self.num_workers):
            if w in self.done or w in self.paused or self.policy.is_waiting(w):
                continue
            steady = self.last_push[w] is not None
            allowance = self.stall.steady if steady else self.stall.start_up
            if now - self.last_seen[w] > allowance:
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
        if self.at_once is not None and self.at_once.takes(request):
            return self.at_once.push(frame, index, request, worker)
        now = self.last_seen[worker] = self.last_message = time.monotonic()
        self.senders.note_positions(self.positions, worker, request, frame)
        if request.flags & P.FLAG_CHUNKED:
            self._chunked(worker, source, request, frame)
        handler = self._handlers.get(request.kind)
        if handler is None:
            raise PeerError(f"unknown request kind {request.kind}",
                            **self.describe_worker(worker, "?"))
        return handler(worker, request, frame, index, now)

    def _serve_ward(self, index, source, request):
        replica = self.replica
        if replica is not None and not replica.adopted:  # a worker saw the loss first:
            replica.await_loss(self._take_failures)  # this ps learns of it in a moment
        if replica is None or not replica.adopted:
            raise PeerError("a request for a lost ps's shard, which this ps does not hold",
                            **self._describe_sender(source))
        replica.note_rerouted(request.step)
        return replica.ward._serve(index, source)

    def _chunked(self, worker, source, request, frame):
        """Note a worker that stages; receive the rest of its push or init (chunk 0 came)."""
        self.chunked_workers.add(worker)
        if request.kind in (P.PUSH, P.INIT) and self.chunk_bytes:
            nbytes = H.HEADER_BYTES + request.count * frame.itemsize
            frame.receive_rest(self.comm, source, P.TAG_REQUEST, self.chunk_bytes,
                               self.deadline,
                               lambda i: self.describe_worker(worker, "push (chunked)"),
                               nbytes if request.kind == P.PUSH else None)

    def run(self):
        """Serve until every worker is done; return the process exit code."""
        pool, replica = self.pool, self.replica
        if self.at_once is not None and self.at_once.runs_loop():
            self.at_once.run()  # one sender: the same work, a shorter loop
        while len(self.done) < self.num_workers or (
                replica is not None and replica.adopted and
                len(replica.ward.done) < self.num_workers):
            try:
                index = pool.wait_next(self.check_every, self._timeout, self.deadline,
                                       self._describe_sender,
                                       None if replica is None else replica.watch)
            except MPI.Exception as exc:
                self.lose_failed(exc)
                continue
            if self._serve(index, pool.source):
                pool.release(index)
            if self.sparse is not None:
                self.sparse.flush()  # the step's replies have left: now its sparse apply
            if replica is not None:
                replica.after_step()  # a copy to the buddy every K steps
                replica.poll()  # the ward's copies
            if self.check_every is not None and self.last_message > self.next_check:
                self._timeout()  # busy: without this, one silent worker would go unseen
        self._finish_replies()
        pool.close()
        if self.at_once is not None:
            self.at_once.close()
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
        return EXIT_REQUEUE if self.requeue else 0


def _replication(service, config, assignment):
    """Return the buddy ring's end on this ps (ps/replica.py): the ward's service, idle."""
    server = service.server
    ps_ranks = server.ranks_of("ps")
    server.survive(ps_ranks)  # a ps's death is no error now (its buddy serves its shard)
    ward = Service(server, config, assignment.ward)
    ward.ps_task = (service.ps_task - 1) % assignment.num_ps
    ward.is_ward, ward.buddy = True, service
    ward.pipeline.reply_tag = P.TAG_REPLY_WARD
    return Replication(service, ward, config.ps_replication_steps, ps_ranks)


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
    chief = server.replica_ranks[0]
    config, assignment = P.recv_object(
        server.comm, chief, P.TAG_CONTROL, server.deadline,
        lambda: server.peer(chief, "configuration of the ps"))
    service = Service(server, config, assignment)
    if config.ps_replication_steps and assignment.ward is not None:
        service.replica = _replication(service, config, assignment)
    code = service.run()
    if config.timeline:  # collective with the workers' end of training
        service.timeline.gather_and_write(server.comm, config.timeline)
    return code
