"""What a worker waits on: a round trip to the ps tasks in flight, and what they answered.

:class:`PushPullHandle` holds a push's or pull's requests to every ps; :class:`NodeHandle`
wraps it for node-local aggregation (see :mod:`mpitf.worker.node`); both end in a
:class:`Reply` that :class:`Replies` reads from the ps headers.
"""

from functools import reduce
from operator import or_
from typing import NamedTuple

from mpi4py import MPI

from ..errors import PeerError
from ..wire import header as H
from ..wire import protocol as P

_new = tuple.__new__  # a Reply straight from its six values (no argument parsing)


class Reply(NamedTuple):
    """What the ps tasks answered to one push or pull, over every ps.

    ``global_step`` is the smallest ps step; ``dropped`` and ``applied`` add up the stale
    gradients dropped and the gradients applied; ``max_staleness`` is the largest
    staleness (global step minus the gradient's step) and ``max_lead`` the largest lead of
    a worker over the slowest one (bounded staleness only; 0 in other modes).
    """

    global_step: int
    flags: int
    dropped: int
    applied: int
    max_staleness: int
    max_lead: int

    @property
    def pause(self):
        """Return True when a ps asked this worker to pause for a checkpoint."""
        return bool(self.flags & P.FLAG_PAUSE)

    @property
    def heal(self):
        """Return True when a ps asked this worker to pause for a heal (``--heal``)."""
        return bool(self.flags & P.FLAG_HEAL)

    @property
    def chief(self):
        """Return the replica index that has the chief's duties since the chief died, or None."""
        return (self.flags >> P.CHIEF_SHIFT) - 1 if self.flags >> P.CHIEF_SHIFT else None


class Replies:
    """Where the ps tasks' replies land, and how a landed round of them is read.

    Args:
        link: the :class:`~mpitf.worker.link.PsLink` (its ``steps`` are updated here).
        frames: per ps, the parameter frame its reply lands in.
        stage: the wire stage (:mod:`mpitf.worker.wire_frames`) that widens replies.
        views: the model's parameter views (partitioned variables are gathered here).
    """

    def __init__(self, link, frames, stage, views):
        self.link, self.frames, self.stage, self.views = link, frames, stage, views
        self.nbytes = sum(frame.bytes.nbytes for frame in frames)
        self.clipped_norm = None  # the norm the ps clipped the last step's mean by (sync)

    def finish(self, widen=True):
        """Read the reply headers, gather partitioned variables, raise on refused gradients.

        ``widen``: a 16-bit wire's replies are widened here (False: per bucket, done).
        """
        if widen and self.stage.converts:
            self.stage.widen_params()
        steps, frames = self.link.steps, self.frames
        # Per ps: kind, step, ps, pushes_applied, flags, stale_dropped, max_staleness, max_lead
        # (wire/header.py), read as plain tuples: at 4 KiB names cost more than the rest.
        if len(frames) == 1:  # one ps: its words are the reply, with no lists to make
            _, step, _, applied, flags, dropped, staleness, lead = words = \
                H.read_words(frames[0].fetch_header())
            self._check(words, 0)
            steps[0] = step
        else:
            every = [H.read_words(frame.fetch_header()) for frame in frames]
            for p, words in enumerate(every):
                self._check(words, p)
                steps[p] = words[1]
            _, step, _, applied, flags, dropped, staleness, lead = zip(*every)
            step, flags, dropped, applied, staleness, leads = \
                min(step), reduce(or_, flags), sum(dropped), sum(applied), max(staleness), lead
            lead = leads[0] if flags & P.FLAG_CLIPPED else max(leads)  # the ps agree on a norm
        if flags & P.FLAG_CLIPPED:
            self.clipped_norm, lead = H.norm_of(lead), 0
        if self.views.split:
            self.views.gather()
        return _new(Reply, (step, flags, dropped, applied, staleness, lead))

    def _check(self, words, p):
        """Raise unless ps ``p``'s words are a reply's."""
        if words[0] != P.REPLY:
            raise PeerError(f"unexpected message kind {words[0]} from a ps",
                            **self.link.describe(p))


class PushPullHandle:
    """Requests in flight that keep their buffers alive; :meth:`wait` completes them.

    Waiting returns a :class:`Reply` read by ``replies`` (None when nothing was asked
    back: a handle of sends alone). Every wait carries the link's deadline and names the
    silent ps. How the requests complete is the link's, one class each, chosen once by
    :meth:`over`: this one, whole frames to ps ranks that stay (one wait over every
    request; persistent requests made once, :meth:`persist`, restarted by :meth:`start`
    every push), :class:`ChunkedHandle` (frames staged through host memory) or
    :class:`ReroutingHandle` (a lost ps's frame asked again at its buddy). Each also says
    how one reply (a bucket's) completes: :meth:`wait_reply`.
    """

    __slots__ = ("link", "receives", "sends", "operation", "replies", "reply", "resend",
                 "requests")

    def __init__(self, link, receives, sends, operation, replies=None, resend=None):
        self.link = link
        self.receives = receives  # per ps: the requests of its reply frame
        self.sends = sends
        self.requests = None  # persistent: receives, then sends, flat (see persist)
        self.operation = operation
        self.replies = replies
        self.reply = None
        self.resend = resend  # resend(p): post ps p's receive and send again (re-routed)

    @staticmethod
    def kind_for(link):
        """Return the handle class of requests over ``link``: re-routable, chunked or whole."""
        if link.replicated:
            return ReroutingHandle
        return ChunkedHandle if link.chunked else PushPullHandle

    @classmethod
    def over(cls, link, receives, sends, operation, replies=None, resend=None):
        """Return a handle of the class ``link`` asks for (see :meth:`kind_for`)."""
        return cls.kind_for(link)(link, receives, sends, operation, replies, resend)

    def describe(self, p):
        """Return keyword arguments naming ps ``p`` and this handle's operation."""
        return self.link.describe(p, self.operation)

    def persist(self):
        """Keep these (persistent) requests for every later push; return self."""
        self.requests = [r for rs in self.receives for r in rs] + self.sends
        return self

    def start(self):
        """Start every persistent request again (receives first); return self, to be waited."""
        MPI.Prequest.Startall(self.requests)
        self.reply = None
        return self

    def done(self):
        """Return True when the round trip has completed (without blocking)."""
        if self.reply is not None:
            return True
        return all(MPI.Request.Testall(r) for r in self.receives) and \
            MPI.Request.Testall(self.sends)

    def wait(self):
        """Block until every ps answered; raise on a deadline or a refused gradient."""
        if self.reply is None:  # one wait for everything, in place (the 4 KiB path: inline)
            # One receive and one send per ps, in ps order: request i is ps i % P's.
            requests = self.requests or [r for rs in self.receives for r in rs] + self.sends
            if not MPI.Request.Testall(requests):
                link = self.link
                nps = len(link.ranks)
                P.wait_all(requests, link.deadline, lambda i: self.describe(i % nps),
                           nbytes=2 * self.replies.nbytes)  # the push and its reply
            self.reply = self.replies.finish()
        return self.reply

    def wait_sends(self):
        """Wait until every request has left this rank."""
        link, sends = self.link, self.sends
        n = max(1, len(sends) // max(1, len(link.ranks)))
        P.wait_all(sends, link.deadline, lambda i: self.describe(i // n))

    @staticmethod
    def wait_reply(frame, requests, deadline, describe, between=None):
        """Wait for the reply ``requests`` receive into ``frame`` (``between``: see wait_all)."""
        P.wait_all(requests, deadline, describe, between,
                   nbytes=2 * frame.bytes.nbytes)  # the push and its reply


class ChunkedHandle(PushPullHandle):
    """Frames staged through host memory: each reply is received chunk by chunk."""

    __slots__ = ()

    def wait(self):
        """Receive each ps's reply in chunks, wait for the sends; return the Reply."""
        if self.reply is None:
            link, frames = self.link, self.replies.frames
            for p, requests in enumerate(self.receives):
                frames[p].receive_chunks(requests, link.deadline,
                                         lambda i, p=p: self.describe(p))
            self.wait_sends()
            self.reply = self.replies.finish()
        return self.reply

    @staticmethod
    def wait_reply(frame, requests, deadline, describe, between=None):
        """Receive the reply ``requests`` began into ``frame``, chunk by chunk."""
        frame.receive_chunks(requests, deadline, describe)


class ReroutingHandle(PushPullHandle):
    """A ps's shard copied to its buddy (replication): a lost ps is asked again there.

    Waits ps by ps (one frame each); the request in flight to a ps lost under ULFM is
    sent again, whole, to its buddy, which holds the copy of its shard (ps/replica.py).
    """

    __slots__ = ()

    def wait(self):
        """Wait ps by ps, re-routing a lost ps's request; return the Reply."""
        if self.reply is None:
            self.wait_sends()
            self.reply = self.replies.finish()
        return self.reply

    def wait_sends(self):
        """Wait ps by ps (receives too, if any), re-routing a lost ps's request."""
        link, receives, sends = self.link, self.receives, self.sends
        for p in range(len(link.ranks)):
            while True:
                try:
                    mine = (list(receives[p]) if receives else []) + [sends[p]]
                    P.wait_all(mine, link.deadline, lambda i, p=p: self.describe(p))
                    break
                except MPI.Exception as exc:
                    if self.resend is None or not link.reroute(p, exc):
                        raise
                    receive, sends[p] = self.resend(p, bool(receives))
                    if receives:
                        receives[p] = receive


class NodeHandle:
    """A node member's round trip: the leader's (``inner``, done or in flight), then the share.

    Waiting returns the :class:`Reply` every member reads from the shared reply headers.
    """

    def __init__(self, node, link, inner, replies, timeline=None):
        self.node, self.link, self.replies, self.timeline = node, link, replies, timeline
        self.inner = inner  # the leader's PushPullHandle or Reply; None on the others
        self.reply = None

    def wait(self):
        """Block until the leader's reply is in the node's buffer; return it."""
        if self.reply is None:
            inner = self.inner
            reply = inner.wait() if isinstance(inner, PushPullHandle) else inner
            self.node.share(self.link.deadline, self.timeline)
            self.reply = reply if reply is not None else self.replies.finish()
        return self.reply
