"""``PsLink``: what every part of a worker that talks to the ps tasks shares about them.

The client builds one link and hands it to the parts that send requests or wait for
answers (:mod:`.transport`, :mod:`.buckets`, :mod:`.handles`, :mod:`.rates`,
:mod:`.embedding`), so none of them reads the client: the communicator, the ps ranks in
ps task order, this worker's index, the flags every request carries, the step each ps
last answered with, the deadline of every wait, and how to name a ps in an error.
"""

import logging
from dataclasses import dataclass, field

from ..errors import PeerError
from ..runtime import ulfm
from ..wire import protocol as P

_log = logging.getLogger("mpitf")


@dataclass(eq=False, slots=True)
class PsLink:
    """A worker's link to its ps tasks.

    Two fields change while training (and, once a ps is lost with ``replicated`` on, the
    items of ``ranks``, ``ward_flags`` and ``reply_tags``: its frame goes to its buddy),
    the rest are fixed when the client is built:
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
        replicated: each ps's shard has a copy on its buddy, ps (p + 1) mod P
            (``--ps-replication-steps``): a lost ps's frame is re-routed there.
    """

    comm: object
    ranks: list
    worker: int
    flags: int
    steps: list
    deadline: float
    host_of: object
    replicated: bool = False
    home: list = field(default=None)  # the ps ranks as started
    ward_flags: list = field(default=None)  # per ps: FLAG_WARD once its buddy serves it
    reply_tags: list = field(default=None)  # per ps: the tag its replies come on
    on_reroute: list = field(default_factory=list)  # callables of p, run as p is re-routed

    def __post_init__(self):
        self.home = list(self.ranks)
        self.ward_flags = [0] * len(self.ranks)
        self.reply_tags = [P.TAG_REPLY] * len(self.ranks)

    def reroute(self, p, exc):
        """Send ps ``p``'s frame to its buddy if ``exc`` says ``p`` died; return True if so.

        Under ULFM with ``replicated`` on: the failure is acknowledged, and from now on
        ``p``'s requests carry ``FLAG_WARD`` and go to its buddy, which answers on
        ``TAG_REPLY_WARD``. Raises a PeerError when the buddy is lost too.
        """
        if not (self.replicated and ulfm.is_failure(exc)):
            return False
        failed = set(ulfm.failed_ranks(self.comm))
        if self.ranks[p] not in failed:
            return False
        n = len(self.home)
        buddy = (p + 1) % n
        if self.ranks[p] != self.home[p] or self.home[buddy] in failed:
            raise PeerError(f"ps task {p} and its buddy /job:ps/task:{buddy}, which held the "
                            f"copy of its shard, are both lost: shard {p} is lost",
                            **self.describe(p)) from exc
        self.ranks[p] = self.home[buddy]
        self.ward_flags[p] = P.FLAG_WARD
        self.reply_tags[p] = P.TAG_REPLY_WARD
        for rerouted in self.on_reroute:  # before the caller sends its request again
            rerouted(p)
        if self.worker == 0:
            _log.warning("ps task %d (rank %d) was lost at step %d: its shard is served by "
                         "/job:ps/task:%d from its copy", p, self.home[p], self.steps[p], buddy)
        return True

    def home_again(self, ranks):
        """The ps at ``ranks`` were replaced (``--heal``): each serves its own shard again."""
        for p, home in enumerate(self.home):
            if home in ranks:
                self.ranks[p] = home
                self.ward_flags[p] = 0
                self.reply_tags[p] = P.TAG_REPLY

    def sparse_tag(self, p):
        """Return the tag ps ``p``'s sparse replies come on (its buddy's own, once lost)."""
        return P.TAG_SPARSE_REPLY_WARD if self.ward_flags[p] else P.TAG_SPARSE_REPLY

    @property
    def chunked(self):
        """Return True when frames travel in chunks (staged through host memory)."""
        return bool(self.flags & P.FLAG_CHUNKED)

    def describe(self, p, operation=None):
        """Return keyword arguments naming ps ``p`` (and ``operation``) for a PeerError."""
        rank = self.ranks[p]
        return dict(rank=rank, job="ps", task=p, host=self.host_of(rank), operation=operation)
