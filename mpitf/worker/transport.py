"""How a worker's gradients reach the ps tasks: one strategy, chosen when the client is built.

As ChainerMN picks a communicator, :func:`transport_for` picks one class, and each
strategy overrides only what differs from :class:`FlatTransport`:

- :class:`FlatTransport`: one frame per ps, sent to every ps at once (``Isend``), the
  reply landing in place (``Irecv``).
- :class:`BucketedTransport`: a ps's frame cut into buckets that leave as backward
  finishes them (:mod:`mpitf.worker.buckets`); ``push_pull`` pushes them all.
- :class:`NodeTransport`: the replicas of a node sum their gradients in a shared window
  and the leader alone talks to the ps (:mod:`mpitf.worker.node`).

Whichever it is, a push returns a round trip to wait on (``wait()``, ``done()``):
:class:`~mpitf.worker.handles.PushPullHandle`, a :class:`BucketedPush` or a
:class:`~mpitf.worker.handles.NodeHandle`; how its requests complete (whole frames,
chunks, re-routing) is the link's, :meth:`~mpitf.worker.handles.PushPullHandle.over`.
The 16-bit wire is no strategy: the wire stage (:mod:`mpitf.worker.wire_frames`) converts
before a frame leaves and after it lands, whichever strategy moves it.
"""

from typing import NamedTuple

import numpy as np

from ..errors import ConfigurationError
from ..runtime.backend import numpy_backend
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame
from .buckets import BucketedPush
from .handles import NodeHandle, PushPullHandle


class Frames(NamedTuple):
    """The frames a worker's transport moves (over the wire stage's buffers)."""

    grads: list  # one per ps (per bucket with buckets), in the gradient layout's order
    requests: list  # per ps: a small host frame for header-only requests (pull, done, ...)
    segments: list  # per ps: (header, payload start, end) of the model's float32 layout
    chunk_bytes: object  # chunk size when frames are staged (None: whole)


def transport_for(node, bucketed):
    """Return the transport class for a client: node-aggregated, bucketed or flat.

    ``node`` is a :class:`~mpitf.worker.node.NodeGroup` or None (a node pushes one frame
    per ps on the host: ``TrainingConfig.check_job`` refused the rest); ``bucketed`` says
    whether ``bucket_bytes`` cut some shard.
    """
    if node is not None:
        return NodeTransport
    return BucketedTransport if bucketed else FlatTransport


class FlatTransport:
    """One frame per ps: a push goes to every ps at once, and each reply lands in place.

    Args:
        link: the :class:`~mpitf.worker.link.PsLink` to the ps tasks.
        frames: the :class:`Frames` it sends.
        replies: the :class:`~mpitf.worker.handles.Replies` (parameter frames, reading).
        stage: the wire stage (:mod:`mpitf.worker.wire_frames`).
        grad_views: the model's gradient views (partitioned variables scatter from them).
        rates: the :class:`~mpitf.worker.rates.GroupRates` each push sends.
        backend: the array backend (synchronised before a frame leaves).
        timeline: a :class:`~mpitf.runtime.timeline.Timeline`, or None.
        node: the :class:`~mpitf.worker.node.NodeGroup` (:class:`NodeTransport` only).
        buckets, slices: the buckets and the placement's slices (bucketed only).
    """

    bucketed = False
    bucketed_push = None  # the BucketedPush of a bucketed transport
    nodes = None  # every node's replica indices, for the ps (node aggregation only)

    def __init__(self, link, frames, replies, stage, grad_views, rates, backend,
                 timeline=None, node=None, buckets=None, slices=None):
        self.link, self.frames, self.replies, self.stage = link, frames, replies, stage
        self.grad_views, self.rates, self.backend = grad_views, rates, backend
        self.timeline = timeline
        self.position_frames = None  # requests with int64 words after the header
        self.round = None  # a push's persistent handle, once made (see send_push)
        self.counts = [c - b for _, b, c in frames.segments]  # per ps: a push's elements
        self.on_gpu = backend.is_gpu  # a host push has no stream to synchronise
        self.device_frames = [f for f in frames.grads if f.unpublished]  # headers to copy

    @staticmethod
    def allocate(node, backend, params_size, grads_size, dtype):
        """Return the model's (parameter, gradient) buffers: zeroed on ``backend``."""
        return backend.zeros(params_size, dtype), backend.zeros(grads_size, dtype)

    # -- the data path -------------------------------------------------------------------

    def push_pull(self, data_position):
        """Push the gradient to every ps, pull the parameters back; return the handle."""
        self.pack_push(data_position)
        return self.send_push()

    def start_push(self, data_position):
        """Begin a bucketed push (see :class:`BucketedTransport`); here an error."""
        raise ConfigurationError("start_push needs buckets: give the client a "
                                 "bucket_bytes smaller than a ps's shard")

    def pack_push(self, data_position):
        """Make the gradient frames ready to leave: scatter, narrow, headers, synchronise."""
        if self.grad_views.split:
            self.grad_views.scatter()
        if self.stage.converts:
            self.stage.narrow_grads()
        link, counts, rate = self.link, self.counts, self.rates.learning_rate
        epoch, cursor = data_position
        steps, flags, ward_flags = link.steps, link.flags, link.ward_flags
        for p, frame in enumerate(self.frames.grads):
            H.pack_push(frame.header, steps[p], link.worker, counts[p], flags | ward_flags[p],
                        epoch, cursor, rate)
        for frame in self.device_frames:  # a host frame's header is the one MPI reads
            frame.commit()
        if self.on_gpu:
            self.backend.synchronize()  # MPI must see the finished gradient

    def send_push(self):
        """Send the packed gradient frames and post the replies; return the handle."""
        link, grads, params = self.link, self.frames.grads, self.replies.frames
        if self.rates.travels:
            self.rates.send(link)
        if self.round is not None:  # the same persistent requests as every step
            return self.round.start()
        receives, sends = [], []
        for p, rank in enumerate(link.ranks):
            receives.append(params[p].irecv(link.comm, rank, link.reply_tags[p]))
            sends.extend(grads[p].isend(link.comm, rank, P.TAG_REQUEST))
        handle = PushPullHandle.over(link, receives, sends, "push_pull", self.replies,
                                     self._resend_push if link.replicated else None)
        if not (link.chunked or link.replicated):  # whole frames to fixed ranks: keep them
            self.round = handle.persist()
        return handle

    def request(self, kind, want_reply, flags=0, operation="pull", payload=None):
        """Send a header-only request (or one with int64 ``payload`` words) to every ps.

        Returns the :class:`~mpitf.worker.handles.Reply` when ``want_reply``; else waits
        until the requests have left.
        """
        link, frames = self.link, self.frames.requests
        if payload is not None:  # int64 words after the header (a node's data positions)
            if self.position_frames is None:
                self.position_frames = [Frame.allocate(numpy_backend(), len(payload), np.int64)
                                        for _ in link.ranks]
            frames = self.position_frames
        receives, sends = [], []
        for p, rank in enumerate(link.ranks):
            H.pack_control(frames[p].header, kind, link.steps[p], link.worker,
                           flags | link.flags | link.ward_flags[p],
                           0 if payload is None else len(payload))
            if payload is not None:
                frames[p].payload[...] = payload
            if want_reply:
                receives.append(self.replies.frames[p].irecv(link.comm, rank,
                                                             link.reply_tags[p]))
            sends.extend(frames[p].isend(link.comm, rank, P.TAG_REQUEST))
        resend = None
        if link.replicated:
            def resend(p, reply):
                return self._resend(frames[p], p, reply)
        handle = PushPullHandle.over(link, receives, sends, operation, self.replies,
                                     resend)
        return handle.wait() if want_reply else handle.wait_sends()

    def _resend_push(self, p, reply):
        """Send ps ``p``'s push again, to the buddy it was re-routed to (a lost ps)."""
        return self._resend(self.frames.grads[p], p, reply)

    def _resend(self, frame, p, reply):
        """Send ``frame`` again to ps ``p``'s (new) rank, marked for it; post its reply."""
        link = self.link
        H.mark_ward(frame.header)
        frame.commit()
        receive = self.replies.frames[p].irecv(link.comm, link.ranks[p],
                                               link.reply_tags[p]) if reply else None
        send, = frame.isend(link.comm, link.ranks[p], P.TAG_REQUEST)
        return receive, send

    # -- control -------------------------------------------------------------------------

    def control(self, kind, flags=0):
        """Send a header-only request (done, paused, save, counters) to every ps."""
        self.request(kind, False, flags, operation=P.KIND_NAMES.get(kind, "control"))

    def paused(self):
        """Tell every ps this worker paused for a checkpoint."""
        self.control(P.PAUSED)

    def done(self, flags=0):
        """Tell every ps this worker has finished."""
        self.control(P.DONE, flags)

    def started(self, pull):
        """Return the :class:`~mpitf.worker.handles.Reply` of the first ``pull()``."""
        return pull()


class BucketedTransport(FlatTransport):
    """Buckets that leave as backward finishes them; ``push_pull`` pushes them all."""

    bucketed = True

    def __init__(self, link, frames, replies, stage, grad_views, rates, backend,
                 timeline=None, node=None, buckets=None, slices=None):
        super().__init__(link, frames, replies, stage, grad_views, rates, backend, timeline)
        self.bucketed_push = BucketedPush(link, buckets, slices, stage, frames.grads, replies,
                                          grad_views, rates, backend, frames.chunk_bytes,
                                          timeline)

    def push_pull(self, data_position):
        """Push every bucket, last layers first; return the :class:`BucketedPush`."""
        return self.start_push(data_position).push_rest()

    def start_push(self, data_position):
        """Post every reply's receive; return the :class:`BucketedPush` (push as ready)."""
        return self.bucketed_push.begin(data_position)


class NodeTransport(FlatTransport):
    """A node's replicas push as one: they sum into the leader's slot; the leader talks.

    The buffers are the node's shared window. The others' requests are refused (they
    share the leader's buffers); they say nothing when they pause or finish, and read
    the leader's replies from the shared parameters.
    """

    def __init__(self, link, frames, replies, stage, grad_views, rates, backend,
                 timeline=None, node=None, buckets=None, slices=None):
        super().__init__(link, frames, replies, stage, grad_views, rates, backend, timeline)
        self.node = node
        self.nodes = node.nodes
        node.sync(node.deadline, "node start-up")  # every member has mapped the window

    @staticmethod
    def allocate(node, backend, params_size, grads_size, dtype):
        """Return the node's shared parameters and this member's gradient slot."""
        return node.allocate(params_size, grads_size, dtype)

    def push_pull(self, data_position):
        """Sum the node's gradients; the leader pushes them; every member gets the reply."""
        self.pack_push(data_position)
        node = self.node
        node.reduce(self.frames.segments, self.link.deadline, self.timeline)
        inner = self.send_push() if node.leader else None
        return NodeHandle(node, self.link, inner, self.replies, self.timeline)

    def request(self, kind, want_reply, flags=0, operation="pull", payload=None):
        """Send a request to every ps: the leader only (see :meth:`FlatTransport.request`)."""
        if not self.node.leader:
            raise ConfigurationError(
                f"{operation} from a replica that is not its node's leader: with "
                "aggregate_per_node only the leader talks to the ps (the others share "
                "its buffers)")
        return super().request(kind, want_reply, flags, operation, payload)

    def paused(self):
        """The leader tells every ps the node paused, with each member's data position."""
        self.node.fresh = True  # the step after a checkpoint may start late
        self._tell(P.PAUSED, 0)

    def done(self, flags=0):
        """The leader tells every ps the node has finished; every member frees the window."""
        try:
            self._tell(P.DONE, flags)
        finally:
            self.node.close()

    def _tell(self, kind, flags):
        if self.node.leader:
            self.request(kind, False, flags, operation=P.KIND_NAMES[kind],
                         payload=self.node.positions(self.frames.segments))

    def started(self, pull):
        """The leader pulls into the shared buffer; every member reads the reply."""
        inner = pull() if self.node.leader else None
        return NodeHandle(self.node, self.link, inner, self.replies, self.timeline).wait()
