"""What a ps does when a rank dies under ULFM: a worker's loss, the chief's, a ps's.

:class:`Losses` is mixed into :class:`~mpitf.ps.service.Service`: a receive that fails
because a rank died is acknowledged here, and each dead rank is gone on without: a worker
counts as done (the policy says what its loss costs), the chief's duties pass on, and a
lost ps's shard is served by its buddy (:mod:`mpitf.ps.replica`) where there is one.
"""

import logging
import time

from ..errors import PeerError
from ..runtime import ulfm
from ..wire import protocol as P

_log = logging.getLogger("mpitf")


class Losses:
    """The Service's handling of dead ranks (see the module docstring)."""

    def lose_failed(self, state, exc):
        """Go on without the workers that died (ULFM), or re-raise ``exc``.

        Under ULFM a receive from any worker fails once a worker has died; the failure is
        acknowledged, the dead workers count as done, and the policy says what their loss
        costs (async: their future pushes; sync: fewer gradients per step; deterministic:
        the job). A dead rank that is no worker (another ps, an evaluator) ends the job.
        """
        if not (self.server.ulfm and ulfm.is_failure(exc)):
            raise exc
        self._take_failures(state, exc)

    def _take_failures(self, state, exc):
        """Acknowledge the failed ranks and go on without each (see :meth:`lose_failed`)."""
        replica = self.replica
        for rank in ulfm.failed_ranks(self.comm):
            if replica is not None and rank in replica.ps_ranks:
                replica.on_lost(rank)  # the ward's: its copy is served from now on
                continue
            worker = self.worker_of.get(rank)
            if worker is None or (rank == state.chief and (self.config.clients or
                                                          self.senders.nodes)):
                raise PeerError("died; only a training replica's loss is survived",
                                **self.server.peer(rank, "training")) from exc
            if replica is not None and replica.adopted:
                replica.ward.lose_worker(replica.ward.state, rank, worker)
            self.lose_worker(state, rank, worker)

    def lose_worker(self, state, rank, worker):
        """Count the dead ``worker`` (at ``rank``) as done; say what its loss costs."""
        if worker not in state.lost:
            step = state.global_step
            cost = self.policy.on_worker_lost(self, worker)  # deterministic: raises
            state.lost.add(worker)
            state.lost_at[worker] = time.monotonic()
            state.done.add(worker)
            state.paused.discard(worker)
            if rank == state.chief:
                cost += self._hand_on_chief(state)
            peer = self.server.peer(rank, "")
            _log.warning("lost rank %d (/job:%s/task:%d on %s) at step %d: %s; %d of %d "
                         "workers go on", rank, peer["job"], peer["task"], peer["host"], step,
                         cost, state.num_active, self.num_workers)
            self.policy.on_worker_gone(self, worker)
            self._check_quiescent(state)

    def _hand_on_chief(self, state):
        """The chief died: its duties go to the lowest surviving replica; say which.

        Every reply from now on names it (``P.CHIEF_SHIFT``), and its checkpoint cuts are
        reported to it. Each ps decides alike: the replicas are the workers, in order.
        """
        alive = [w for w in range(self.num_workers) if w not in state.lost]
        if not alive:
            return ""
        state.chief = self.worker_ranks[alive[0]]
        state.chief_flags = (alive[0] + 1) << P.CHIEF_SHIFT
        self.server.chief_index = alive[0]  # a replacement (--heal) learns it from rank 0
        self._finish_replies()  # the header is rewritten: none may be in flight
        self.write_header()
        peer = self.server.peer(state.chief, "")
        return (f"; the chief's duties (logging, checkpoints, the summary) go to rank "
                f"{state.chief} (/job:{peer['job']}/task:{peer['task']})")
