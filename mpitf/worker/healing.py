"""A training session's part in a loss under ULFM: the chief's duties, a heal (``--heal``).

A lost chief's duties pass to the replica a ps names (:func:`succeed_chief`). With
``--heal`` (see :mod:`mpitf.runtime.heal`) the chief asks every ps for a heal once MPI
reports a rank dead (:meth:`Healing.due`, before a push, as it asks for a checkpoint); a
reply flagged ``FLAG_HEAL`` pauses every worker after its step
(:meth:`Healing.pause_and_heal`); the chief hears from every ps, decides, and all take
part in :meth:`~mpitf.runtime.server.Server.heal`. A replacement worker goes on from the
lost worker's data position (:meth:`Healing.take_over`).
"""

import logging

from ..ckpt import cut
from ..runtime import heal, ulfm
from ..wire import protocol as P
from .hooks import CheckpointSaverHook, LoggingHook
from .profile import ProfileHook

_log = logging.getLogger("mpitf")


class Healing:
    """What a session does for ``--heal`` (see the module docstring)."""

    def __init__(self, session):
        self.session = session
        self.failures_seen = 0  # chief: the ranks known dead when it last asked to heal
        self.asked = False  # chief: a heal was asked for and has not happened yet

    def due(self):
        """Chief: ask every ps for a heal if a rank died since the last; True while one is due.

        A checkpoint cut waits while a heal is due.
        """
        sess = self.session
        if not self.asked:
            failed = ulfm.count_failed(sess.server.comm)
            if failed <= self.failures_seen:
                return False
            self.failures_seen = failed
            self.asked = True
            sess.client.send_control(P.HEAL)
        return True

    def pause_and_heal(self):
        """Pause for a heal (a ps's reply asked): the chief decides, every rank takes part.

        The chief hears from every ps whether a worker has finished (then it is too late:
        the job ends without the lost ranks) and sends each its word; the other workers
        wait for it as for a checkpoint's release.
        """
        sess = self.session
        server = sess.server
        sess.stall.pause()
        sess.client.deadline = sess.stall.allowance
        sess.client.paused()
        if server.is_chief:
            go = self._decide()
        else:
            go = P.recv_object(server.comm, sess.releaser, P.TAG_CONTROL, server.deadline,
                               lambda: server.peer(sess.releaser, "heal"))["heal"]
        if go:
            try:
                healed = server.heal()
            except heal.NoFreeSlot:
                pass  # every ps says so
            else:
                sess.client.rejoined(healed["lost"])
                self.failures_seen = 0  # the new communicator has no failed rank
        self.asked = False

    def _decide(self):
        """Chief: collect every ps's report; heal unless a worker has finished; say so to all."""
        sess = self.session
        server = sess.server
        comm = server.comm
        serving = sorted(set(sess.client.link.ranks))  # a lost ps's buddy reports once
        reports = [P.recv_object(comm, rank, P.TAG_CONTROL, server.deadline,
                                 lambda rank=rank: server.peer(rank, "heal"))
                   for rank in serving]
        finished = sorted({w for r in reports for w in r["finished"]})
        go = not finished
        if not go:
            print(f"step {sess.global_step}: no heal, as {len(finished)} worker(s) finished "
                  "already; the job ends without the lost ranks", flush=True)
        for rank in serving:
            comm.send({"heal": go}, dest=rank, tag=P.TAG_CONTROL)
        cut.release(comm, reports, sess.push_ranks, server.rank, {"heal": go})
        return go

    def take_over(self, facts):
        """A replacement: go on from the lost worker's data position, as the ps knew it."""
        sess = self.session
        server = sess.server
        index = server.replica_index
        known = [f["positions"][index] for f in facts if f and index in f["positions"]]
        epoch, cursor = known[0] if known else (0, 0)
        if sess.dataset is not None:
            sess.dataset.restore({"epoch": int(epoch), "cursor": int(cursor)})
        _log.warning("/job:%s/task:%d replaces the lost task from step %d, its data at epoch "
                     "%d, example %d", server.job_name, server.task_index, sess.global_step,
                     epoch, cursor)


def succeed_chief(sess, index):
    """The chief died (ULFM): replica ``index`` has its duties now; take them if it is us.

    The hooks only the chief runs (logging, profile, checkpoints) start here, from this
    step; the other replicas wait for a checkpoint's release from it.
    """
    server = sess.server
    server.chief_index = index
    if sess.node is None:
        sess.releaser = sess.client_ranks[index]
    if not server.is_chief:
        return
    print(f"step {sess.global_step}: the chief was lost; /job:{server.job_name}/"
          f"task:{server.task_index} takes over its duties", flush=True)
    sess.saver = CheckpointSaverHook.from_config(sess.config)
    duties = [hook for hook in (LoggingHook.from_config(sess.config, sess.log_stream),
                                ProfileHook.from_config(sess.config), sess.saver) if hook]
    for hook in duties:
        hook.begin(sess)
    sess.hooks += duties
