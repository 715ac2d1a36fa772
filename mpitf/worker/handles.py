"""What a worker waits on: a round trip to the ps tasks in flight, and what they answered.

:class:`PushPullHandle` holds a push's or pull's requests to every ps; :class:`NodeHandle`
wraps it for node-local aggregation (see :mod:`mpitf.worker.node`); both end in a
:class:`Reply` read from the ps headers.
"""

from mpi4py import MPI

from ..wire import protocol as P


class Reply:
    """What the ps tasks answered to one push or pull, over every ps.

    ``global_step`` is the smallest ps step; ``dropped`` and ``applied`` add up the stale
    gradients dropped and the gradients applied; ``max_staleness`` is the largest
    staleness (global step minus the gradient's step) and ``max_lead`` the largest lead of
    a worker over the slowest one (bounded staleness only; 0 in other modes).
    """

    __slots__ = ("global_step", "flags", "dropped", "applied", "max_staleness", "max_lead")

    def __init__(self, global_step, flags, dropped, applied, max_staleness, max_lead):
        self.global_step = global_step
        self.flags = flags
        self.dropped = dropped
        self.applied = applied
        self.max_staleness = max_staleness
        self.max_lead = max_lead

    @property
    def pause(self):
        """Return True when a ps asked this worker to pause for a checkpoint."""
        return bool(self.flags & P.FLAG_PAUSE)


class PushPullHandle:
    """Requests in flight that keep their buffers alive; :meth:`wait` completes them.

    Waiting returns a :class:`Reply` built from the ps headers (or None when nothing was
    asked back). Every wait carries the client's deadline and names the silent ps.
    """

    def __init__(self, client, receives, sends, operation):
        self.client = client
        self.receives = receives  # per ps: the requests of its reply frame
        self.sends = sends
        self.operation = operation
        self.reply = None

    def _describe(self, p):
        return dict(self.client._describe_ps(p), operation=self.operation)

    def done(self):
        """Return True when the round trip has completed (without blocking)."""
        if self.reply is not None:
            return True
        return all(MPI.Request.Testall(r) for r in self.receives) and \
            MPI.Request.Testall(self.sends)

    def wait_sends(self):
        """Wait until every request has left this rank."""
        n = max(1, len(self.sends) // max(1, len(self.client.ps_ranks)))
        P.wait_all(self.sends, self.client.deadline, lambda i: self._describe(i // n))

    def wait(self):
        """Block until every ps answered; raise on a deadline or a refused gradient."""
        if self.reply is None:
            if not self.client.chunked:  # one wait for everything: replies land in place
                # One receive and one send per ps, in ps order: request i is ps i % P's.
                requests = [r for rs in self.receives for r in rs] + self.sends
                nps = len(self.client.ps_ranks)
                P.wait_all(requests, self.client.deadline, lambda i: self._describe(i % nps))
            else:
                frames = self.client.param_frames
                for p, requests in enumerate(self.receives):
                    frames[p].receive_chunks(requests, self.client.deadline,
                                             lambda i, p=p: self._describe(p))
                self.wait_sends()
            self.reply = self.client._finish()
        return self.reply


class NodeHandle:
    """A node member's round trip: the leader's (``inner``, done or in flight), then the share.

    Waiting returns the :class:`Reply` every member reads from the shared reply headers.
    """

    def __init__(self, client, inner):
        self.client = client
        self.inner = inner  # the leader's PushPullHandle or Reply; None on the others
        self.reply = None

    def wait(self):
        """Block until the leader's reply is in the node's buffer; return it."""
        if self.reply is None:
            client, inner = self.client, self.inner
            reply = inner.wait() if hasattr(inner, "receives") else inner
            client.node.share(client.deadline, client.timeline)
            self.reply = reply if reply is not None else client._finish()
        return self.reply
