"""A buddy replica of each ps shard (``--ps-replication-steps K``, under ULFM).

Ps task p's buddy is task (p + 1) mod P. Every K applies a ps copies its shard (parameters,
optimizer slots, moving average) and its global step into one send buffer, made once, and
sends it to its buddy (``Isend`` on ``TAG_REPLICA``; the next copy waits for the last to
leave). The buddy takes each copy by a matched probe into one of two buffers, alternately,
so a copy cut short by its sender's death never overwrites the last whole one.

When a ps dies its buddy *adopts* the copy: a second :class:`~mpitf.ps.service.Service`
(the ward's, built at start-up from the ward's assignment) takes the copy and serves the
requests that carry ``FLAG_WARD``, replying on ``TAG_REPLY_WARD``; the workers re-route the
dead ps's frame there (:mod:`mpitf.worker.handles`). The updates applied after the copy
(at most K - 1 steps) are lost, and the log says how many.
"""

import logging
import time

from mpi4py import MPI

from ..errors import DeadlineError, PeerError
from ..runtime import ulfm
from ..wire import protocol as P
from . import table_copy
from .copies import Image, state_arrays

_log = logging.getLogger("mpitf")


class Replication:
    """One ps's side of the buddy ring: the copies it sends, and the ward's it keeps.

    Args:
        svc: this ps's Service.
        ward: the Service of the ps whose shard this one keeps (not serving until adopted).
        steps: K, the applies between two copies.
        ps_ranks: every ps's rank, in task order.
    """

    def __init__(self, svc, ward, steps, ps_ranks):
        self.svc, self.ward, self.steps = svc, ward, steps
        num_ps, me = len(ps_ranks), svc.ps_task
        self.buddy_task, self.ward_task = (me + 1) % num_ps, (me - 1) % num_ps
        self.buddy_rank, self.ward_rank = ps_ranks[self.buddy_task], ps_ranks[self.ward_task]
        self.ps_ranks = set(ps_ranks)
        self.mine = state_arrays(svc.shard)
        self.out = Image(self.mine, svc.tables)
        self.sending = None  # the copy in flight to the buddy
        self.sent_step = None  # the step of the last copy sent
        self.buddy_alive = True
        self.theirs = state_arrays(ward.shard)
        self.images = [Image(self.theirs), Image(self.theirs)]  # tables: given at adoption
        self.current = None  # the image holding the ward's last whole copy
        self.adopted = False
        self.copy_step = None  # the adopted copy's step
        self.pending_log = None  # the loss's log line, once a re-routed request says its cost
        self.lost_ps = set()
        self.lost_at = {}  # ps task -> when its loss was taken (a heal says how long it took)
        self.status = MPI.Status()
        self.next_watch = 0.0
        self.known_failed = 0  # the failed ranks MPI reported, all taken

    # -- sending ----------------------------------------------------------------------------

    def after_step(self):
        """Send a copy to the buddy if K steps were applied since the last (or none yet)."""
        svc = self.svc
        if not (self.buddy_alive and svc.state.initialized):
            return
        if self.sent_step is not None and svc.state.global_step - self.sent_step < self.steps:
            return
        try:
            if self.sending is not None:
                self._wait(self.sending)
                self.sending = None
        except MPI.Exception as exc:
            if not ulfm.is_failure(exc):
                raise
            self.buddy_alive = False  # the pool sees the loss too, and says it
            return
        if not self.buddy_alive:  # it died while the last copy was under way: none follows
            return
        svc.pipeline.finish(svc.stall.steady, svc.describe_reply)  # replies read the params
        used = self.out.take(self.mine, svc.state.global_step)
        self.sending = svc.comm.Isend([self.out.buffer[:used], MPI.BYTE], self.buddy_rank,
                                      P.TAG_REPLICA)
        self.sent_step = svc.state.global_step

    def settle(self):
        """Before a heal (ps/heals.py): the copy in flight reaches the buddy, replies leave."""
        if self.sending is not None and self.buddy_alive:
            self._wait(self.sending)
        self.sending = None
        if self.adopted:
            self.ward._finish_replies()
            if self.ward.sparse is not None:
                self.ward.sparse.flush()

    def after_heal(self, lost):
        """The job healed: a replaced buddy gets copies again (the next apply sends one)."""
        self.known_failed = 0  # the new communicator has no failed rank
        if self.buddy_rank in lost:
            self.buddy_alive = True
            self.sent_step = None
            self.lost_ps.discard(self.buddy_task)

    def hand_over(self):
        """Return copies of the ward's arrays and tables for its replacement; serve them no more.

        The tables come as one buffer (:func:`~mpitf.ps.table_copy.snapshot`), or None.
        """
        ward = self.ward
        if ward.sparse is not None:
            ward.sparse.flush()  # its last step's rows
        arrays = [a.copy() for a in self.theirs]
        tables = None if ward.tables is None else table_copy.snapshot(ward.tables)
        self.adopted = False
        self.current = None  # its copies are of a shard that moved on
        self.lost_ps.discard(self.ward_task)
        self.pending_log = None
        return arrays, tables

    # -- receiving ---------------------------------------------------------------------------

    def poll(self):
        """Take the ward's copies that have arrived (the newest wins)."""
        if self.adopted or self.ward_task in self.lost_ps:
            return
        try:
            self._take_copies()
        except MPI.Exception as exc:
            self.svc.lose_failed(self.svc.state, exc)

    def watch(self):
        """Between the pool's probes: take the ward's copies; a death MPI knows of (5 ms).

        The ward may wait for its last copy to leave before it answers anyone, so copies
        are taken while this ps is idle too.

        Open MPI's ``ANY_SOURCE`` probe neither fails nor matches while a death is not
        acknowledged, and a probe of the dead rank need not fail either (seen when ps 0
        died: ps 1 never saw the re-routed requests), so the failed group is read.
        """
        self.poll()
        now = time.monotonic()
        if now < self.next_watch:
            return
        self.next_watch = now + 0.005
        group = self.svc.comm.Get_failed()
        known = group.Get_size()
        group.Free()
        if known > self.known_failed:
            self.known_failed = known
            self.svc._take_failures(self.svc.state, None)

    def _take_copies(self):
        comm = self.svc.comm
        while True:
            message = comm.Improbe(self.ward_rank, P.TAG_REPLICA, self.status)
            if message is None:
                return
            slot = 0 if self.current is None else 1 - self.current
            image = self.images[slot]
            image.fit(self.status.Get_count(MPI.BYTE))  # the tables grew: so does the image
            message.Recv([image.buffer, MPI.BYTE])
            self.current = slot

    # -- a lost ps ---------------------------------------------------------------------------

    def on_lost(self, rank):
        """A ps died: adopt its shard if it is the ward; stop sending if it is the buddy."""
        svc = self.svc
        task = svc.server.roles[rank][1]
        if task in self.lost_ps:
            return
        self.lost_ps.add(task)
        self.lost_at[task] = time.monotonic()
        if rank == self.buddy_rank:
            self.buddy_alive = False
        if rank != self.ward_rank:
            return
        try:
            self._take_copies()  # a last whole copy may wait in MPI's queue
        except MPI.Exception as exc:
            if not ulfm.is_failure(exc):
                raise
        if self.current is None:
            raise PeerError(f"died before its first copy reached its buddy "
                            f"/job:ps/task:{svc.ps_task}: its shard is lost",
                            **svc.server.peer(rank, "training"))
        self.copy_step = self.images[self.current].give(self.theirs, self.ward.tables)
        self.ward.adopt()
        self.adopted = True
        peer = svc.server.peer(rank, "")
        self.pending_log = (rank, peer["host"])  # said once a re-routed request names the cost

    def await_loss(self, take_failures):
        """Wait until MPI reports the ward's death here, and adopt its copy.

        A request for the ward's shard may come before this ps learnt that the ward died;
        the wait lasts up to the deadline (else 60 s).
        """
        limit = time.monotonic() + (self.svc.deadline or 60.0)
        while not self.adopted and time.monotonic() < limit:
            try:  # a probe of the ward drives MPI's progress; it fails once the death is known
                self.svc.comm.Iprobe(self.ward_rank, P.TAG_REPLICA_END)
            except MPI.Exception as exc:
                if not ulfm.is_failure(exc):
                    raise
            take_failures(None)
            if not self.adopted:
                time.sleep(0.001)

    def note_rerouted(self, step):
        """Log the loss, with its cost: a re-routed request carries the dead ps's last step."""
        if self.pending_log is None:
            return
        rank, host = self.pending_log
        self.pending_log = None
        lost = "its steps lost: unknown (no worker asked for them)" if step is None else \
            f"{max(0, step - self.copy_step)} of its steps lost"
        _log.warning("lost ps rank %d (/job:ps/task:%d on %s) at step %s: /job:ps/task:%d "
                     "serves its shard from its copy of step %d; %s (a copy every %d steps)",
                     rank, self.ward_task, host, "?" if step is None else step,
                     self.svc.ps_task, self.copy_step, lost, self.steps)

    def _wait(self, request):
        """Wait for a send to the buddy, taking the ward's copies meanwhile.

        The ward may wait on this ps in the same way: two sends of a whole shard each need
        their receiver.
        """
        svc = self.svc
        start = time.monotonic()
        while not request.Test():
            self.poll()
            try:  # fails once the buddy's death is known (a send to it may never end)
                svc.comm.Iprobe(self.buddy_rank, P.TAG_REPLICA_END)
            except MPI.Exception as exc:
                svc.lose_failed(svc.state, exc)
            if not self.buddy_alive:  # the buddy died (the poll heard of it): give it up
                return
            if svc.deadline is not None and time.monotonic() - start > svc.deadline:
                raise DeadlineError(f"a copy of the shard not received within "
                                    f"{svc.deadline:g} s",
                                    **svc.server.peer(self.buddy_rank, "replica"))
            time.sleep(0.0002)

    # -- the end -----------------------------------------------------------------------------

    def close(self):
        """End the ring: tell the buddy no copy follows; take the ward's last ones; wait."""
        svc = self.svc
        comm = svc.comm
        self.note_rerouted(None)
        try:
            if self.sending is not None:
                self._wait(self.sending)
            end = None
            if self.buddy_alive:
                end = comm.Isend([self.out.buffer[:0], MPI.BYTE], self.buddy_rank,
                                 P.TAG_REPLICA_END)
            if not self.adopted and self.ward_task not in self.lost_ps:
                while not comm.Iprobe(self.ward_rank, P.TAG_REPLICA_END):
                    self.poll()  # the ward's last copies, which it waits to see leave
                    if self.adopted:
                        break
                    time.sleep(0.0005)
                else:
                    comm.Recv([self.out.buffer[:0], MPI.BYTE], self.ward_rank,
                              P.TAG_REPLICA_END)
            if end is not None:
                self._wait(end)
        except MPI.Exception as exc:
            if not ulfm.is_failure(exc):
                raise
