"""The ps's side of a heal (``--heal``): pause every worker, replace the lost ranks, go on.

:class:`Heals` is mixed into :class:`~mpitf.ps.service.Service`. The chief asks for a heal
(``HEAL``) once it sees a rank die; each ps flags its replies as for a checkpoint cut
(``FLAG_HEAL``), and once every worker paused or was lost it tells the chief whether it
can heal (no worker has finished yet), waits for the chief's word and takes part in the
heal (:meth:`~mpitf.runtime.server.Server.heal`). A replaced worker is a worker again:
sync steps wait for its gradient from its first push.
"""

import logging
import time

from ..errors import DeadlineError
from ..runtime.heal import NoFreeSlot
from ..wire import protocol as P

_log = logging.getLogger("mpitf")


class Heals:
    """The Service's part in a heal (see the module docstring)."""

    def _on_heal(self, state, worker, request, frame, index, now):
        # The flag goes out with the next applied step's replies, not before: a stale push
        # answered now would pause its worker a step before the others, and in sync mode
        # the ps would then hold the others' next push for it.
        state.last_push[worker] = None
        state.healing = True
        self._check_quiescent(state)
        return True

    def heal(self, state):
        """Every worker paused or was lost: heal with the job if the chief says so."""
        self._finish_replies()
        if self.sparse is not None:
            self.sparse.flush()
        if self.replica is not None:
            self.replica.settle()  # no copy may be in flight: the communicator changes
        report = dict(ps_task=self.ps_task, finished=sorted(state.done - state.lost),
                      paused=sorted(state.paused))
        if self._ask_chief(state, report):
            self._take_part(state)
        ward = self.replica.ward if self.replica is not None else None
        for service in (self, ward) if ward is not None else (self,):
            service.state.healing = False  # the ward's too, flagged by re-routed requests
            service.state.paused.clear()
            service.write_header()

    def _ask_chief(self, state, report):
        """Send ``report`` to the chief; return its word (True: heal), taking copies meanwhile."""
        comm, chief = self.comm, state.chief
        comm.send(report, dest=chief, tag=P.TAG_CONTROL)
        limit = None if self.deadline is None else time.monotonic() + self.deadline
        while not comm.Iprobe(chief, P.TAG_CONTROL):
            if self.replica is not None:
                self.replica.poll()  # a buddy may still wait for its last copy to leave
            if limit is not None and time.monotonic() > limit:
                raise DeadlineError(f"no word within {self.deadline:g} s on the heal",
                                    **self.server.peer(chief, "heal"))
            time.sleep(0.0005)
        return comm.recv(source=chief, tag=P.TAG_CONTROL)["heal"]

    def _take_part(self, state):
        """Heal with the job; a replaced worker trains again from now."""
        facts = dict(positions=dict(state.positions), step=state.global_step)
        try:
            healed = self.server.heal(facts)
        except NoFreeSlot as exc:
            _log.warning("no process could be spawned to replace the lost ranks (%s): give "
                         "the job free slots (mpitf run oversubscribes); it goes on without "
                         "them", exc)
            return
        for send in self.sends.values():  # persistent reply sends, on the old communicator
            send.Free()
        self.sends.clear()
        lost, replica = healed["lost"], self.replica
        if replica is not None:
            replica.after_heal(lost)
        replaced = {self.worker_of[rank] for rank in lost if rank in self.worker_of}
        for rank in lost:
            worker = self.worker_of.get(rank)
            if worker is not None:
                self._revive(state, rank, worker, healed["seconds"])
            elif replica is not None and replica.adopted and rank == replica.ward_rank:
                self._hand_over(rank, healed["seconds"], replaced)

    def _hand_over(self, rank, seconds, replaced):
        """Send the ward's shard, which this ps served, to its replacement (at ``rank``).

        The workers ``replaced`` in the same heal train again: not lost to the new ps.
        """
        replica = self.replica
        lost_at = replica.lost_at.pop(replica.ward_task)
        start = time.monotonic()
        state = replica.ward.state
        arrays, tables = replica.hand_over()
        shard = dict(arrays=arrays, tables=tables, global_step=state.global_step,
                     done=state.done - replaced, lost=state.lost - replaced, chief=state.chief,
                     chief_flags=state.chief_flags, positions=dict(state.positions),
                     counters=dict(state.counters))
        self.comm.send(shard, dest=rank, tag=P.TAG_CONTROL)  # after the chief's configuration
        now = time.monotonic()
        size = (sum(a.nbytes for a in arrays) + (0 if tables is None else tables.nbytes)) / 2**20
        peer = self.server.peer(rank, "")
        _log.warning("replaced rank %d (/job:ps/task:%d) by a spawned process on %s at step %d, "
                     "%.2f s after its loss (the heal %.2f s, its shard of %.3g MiB handed over "
                     "by /job:ps/task:%d in %.2f s): it serves its shard again and its copies "
                     "resume", rank, peer["task"], peer["host"], shard["global_step"],
                     now - lost_at, seconds, size, self.ps_task, now - start)

    @staticmethod
    def receive_shard(server):
        """A replacement ps: return the shard (and state) of the buddy that served it."""
        ps_ranks = server.ranks_of("ps")
        buddy = ps_ranks[(server.task_index + 1) % len(ps_ranks)]
        return server.comm.recv(source=buddy, tag=P.TAG_CONTROL)

    def take_shard(self, shard):
        """A replacement ps: serve from ``shard`` (its buddy's), where the lost ps left off."""
        from . import table_copy
        from .copies import state_arrays

        state = self.state
        for mine, theirs in zip(state_arrays(self.shard), shard["arrays"]):
            mine[...] = theirs
        if shard.get("tables") is not None:
            table_copy.read(self.tables, shard["tables"])
        self.shard.restored()
        state.global_step = shard["global_step"]
        state.counters.update(shard["counters"])
        self.pipeline.at_step(state.global_step)
        state.initialized = True
        state.done, state.lost = shard["done"], shard["lost"]
        state.chief, state.chief_flags = shard["chief"], shard["chief_flags"]
        state.positions = shard["positions"]
        self.write_header()
        _log.warning("/job:ps/task:%d replaces the lost task from step %d", self.ps_task,
                     state.global_step)

    def _revive(self, state, rank, worker, seconds):
        """Count ``worker`` (at ``rank``, replaced) as training again; say so and what it cost."""
        now = time.monotonic()
        state.lost.discard(worker)
        state.done.discard(worker)
        state.last_push[worker] = None
        state.last_seen[worker] = now
        since = now - state.lost_at.pop(worker, now)
        r = getattr(self.policy, "replicas_to_aggregate", None)
        back = "its pushes count again" if r is None else (
            f"sync steps aggregate {min(r, state.num_active)} gradients again "
            f"(replicas_to_aggregate {r})")
        peer = self.server.peer(rank, "")
        _log.warning("replaced rank %d (/job:%s/task:%d) by a spawned process on %s at step "
                     "%d, %.2f s after its loss (the heal %.2f s): %s; %d of %d workers train",
                     rank, peer["job"], peer["task"], peer["host"], state.global_step, since,
                     seconds, back, state.num_active, self.num_workers)
