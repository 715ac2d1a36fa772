"""``PsLink``: what every part of a worker that talks to the ps tasks shares about them.

The client builds one link and hands it to the parts that send requests or wait for
answers (:mod:`.transport`, :mod:`.buckets`, :mod:`.handles`, :mod:`.rates`,
:mod:`.embedding`), so none of them reads the client: the communicator, the ps ranks in
ps task order, this worker's index, the flags every request carries, the step each ps
last answered with, the deadline of every wait, and how to name a ps in an error.
"""

from dataclasses import dataclass

from ..wire import protocol as P


@dataclass(eq=False, slots=True)
class PsLink:
    """A worker's link to its ps tasks.

    Two fields change while training, the rest are fixed when the client is built:
    ``deadline`` (seconds to wait for a ps, None: forever; the session lowers it as steps
    run) and the items of ``steps`` (per ps, the global step of its last reply, which
    the next request carries).

    Args:
        comm: the communicator mpitf traffic goes over.
        ranks: the ps ranks in ``comm``, in ps task order.
        worker: this worker's index (its replica index; the chief is 0).
        flags: flags every request carries (``FLAG_CHUNKED`` when frames are staged).
        steps: per ps, the step of its last reply.
        deadline: seconds to wait for a ps, or None.
        host_of: ``host_of(rank)`` names the host a rank runs on.
    """

    comm: object
    ranks: list
    worker: int
    flags: int
    steps: list
    deadline: float
    host_of: object

    @property
    def chunked(self):
        """Return True when frames travel in chunks (staged through host memory)."""
        return bool(self.flags & P.FLAG_CHUNKED)

    def describe(self, p, operation=None):
        """Return keyword arguments naming ps ``p`` (and ``operation``) for a PeerError."""
        rank = self.ranks[p]
        return dict(rank=rank, job="ps", task=p, host=self.host_of(rank), operation=operation)
