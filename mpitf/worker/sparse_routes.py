"""A worker's sparse messages when a ps is lost and its buddy serves its shard.

With ``--ps-replication-steps`` a ps's tables are copied to its buddy with its dense shard
(:mod:`mpitf.ps.table_copy`). A sparse pull to a ps lost under ULFM is sent again, marked
``FLAG_WARD``, to the buddy, whose answer comes on ``TAG_SPARSE_REPLY_WARD``
(:func:`wait_each`); a sparse push in flight when the dense push finds the ps lost is sent
again to the buddy before the dense push is (:meth:`~mpitf.worker.link.PsLink.reroute`
runs the embeddings' hook first), so the buddy applies both under one decision.
"""

from mpi4py import MPI

from ..runtime import ulfm
from ..wire import protocol as P


def wait_each(link, receives, sends, operation, resend=None):
    """Wait ps by ps for ``receives`` (or None) and ``sends``; re-route a lost ps's.

    ``resend(p)`` posts ps ``p``'s receive and send again at its new rank and returns
    them; without it (a push's sends) a lost ps's send is dropped: the hook the link runs
    as it re-routes has sent it again, or the dense push, answered, shows it arrived.
    """
    for p in range(len(sends)):
        while True:
            mine = [sends[p]] if receives is None else [receives[p], sends[p]]
            try:
                P.wait_all(mine, link.deadline, lambda i, p=p: link.describe(p, operation))
                break
            except MPI.Exception as exc:
                # re-routed now, or before (the failed request went to the lost rank); a
                # lost buddy raises (reroute)
                if not link.reroute(p, exc) and (link.ranks[p] == link.home[p] or
                                                 not ulfm.is_failure(exc)):
                    raise
                if resend is None:
                    break
                receives[p], sends[p] = resend(p)
