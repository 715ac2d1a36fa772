"""The ps's sparse requests: answer a pull of rows, keep a push in the frame it came in.

A sparse push is not copied aside: the pool frame it arrived in is lent to the tables
until the policy applies (or drops) its worker's push, and a spare frame, made at start-up,
takes its place in the pool. A worker has at most one
sparse push waiting, so one spare per worker is enough.

The apply itself waits until the step's replies have left (:meth:`SparseInbox.flush`,
called by the event loop before it reads the next message): a worker's next batch is
deduplicated while this ps updates the rows, and every request still sees them updated.
"""

import time

from ..wire import protocol as P
from ..wire.frame import Frame
from .pipeline import Pipeline


class SparseInbox:
    """The sparse side of one ps's event loop (``service``: its :class:`Service`).

    Args:
        service: the ps's service (its pool, receives, tables, pipeline and counters).
        size, dtype, capacity: the pool frames' shape (the spares are the same).
    """

    def __init__(self, service, size, dtype, capacity):
        self.service, self.tables = service, service.tables
        self.spares = [Frame.allocate(service.backend, size, dtype, capacity)
                       for _ in range(service.num_workers)]
        self.lent = [None] * service.num_workers  # worker -> the frame of its sparse push
        self.deferred = None  # (workers, step) of the apply to run at the next flush
        # a lost ps's rows, served by its buddy (a ward), go back on a tag of their own
        self.reply_tag = P.TAG_SPARSE_REPLY_WARD if service.is_ward else P.TAG_SPARSE_REPLY

    def handle(self, worker, kind, index):
        """Answer a pull, or keep a push for the policy's apply; return True (frame free)."""
        self.flush()
        s, tables = self.service, self.tables
        message = s.pool[index].bytes
        describe = s.describe_worker(worker, P.KIND_NAMES[kind])
        s.state.counters["sparse_pushes" if kind == P.SPARSE_PUSH else "sparse_pulls"] += 1
        if kind == P.SPARSE_PUSH:
            s.state.counters["bytes_in"] += tables.stash(worker, message, describe)
            self._lend(worker, index)
            return True
        s.state.counters["bytes_in"] += \
            tables.layout.ids_end(tables.layout.counts(message).tolist())
        view = tables.pull(worker, message, s.state.global_step, describe)
        s.pipeline.add([P.frame_op(s.comm.Isend, view, s.worker_ranks[worker],
                                   self.reply_tag)], worker, Pipeline.WHOLE)
        s.state.counters["bytes_out"] += view.nbytes
        return True

    def apply(self, workers, step):
        """Apply the sparse pushes of ``workers`` (their mean) at the next :meth:`flush`."""
        self.flush()
        self.deferred = (tuple(workers), step)

    def flush(self):
        """Run the apply kept by :meth:`apply` (if any) and take back its workers' frames.

        The event loop calls it after a request's replies were posted, and anything that
        reads or saves the tables calls it first.
        """
        if self.deferred is None:
            return
        workers, step = self.deferred
        self.deferred = None
        timeline = self.service.timeline
        self.service.pipeline.progress()  # else the replies wait for this rank's next MPI call
        start = time.perf_counter()
        self.tables.apply(workers, len(workers), step)
        for w in workers:
            self._give_back(w)
        if timeline.enabled:
            timeline.add("apply", start, time.perf_counter(), step=step, tables=True)

    def discard(self, worker):
        """Forget ``worker``'s sparse push (its dense push was dropped as stale)."""
        self.flush()
        self.tables.discard(worker)
        self._give_back(worker)

    def close(self):
        """Run the last apply."""
        self.flush()

    def _lend(self, worker, index):
        """Lend pool frame ``index`` to ``worker``'s push; a spare takes its place."""
        s = self.service
        self._give_back(worker)
        self.lent[worker] = s.pool.swap(index, self.spares.pop())

    def _give_back(self, worker):
        if self.lent[worker] is not None:
            self.spares.append(self.lent[worker])
            self.lent[worker] = None
