"""A bucketed push: gradients leave in buckets as backward finishes them, replies per bucket.

Each ps's part of the gradient buffer is cut into buckets (:func:`mpitf.wire.layout.
bucket_ranges`), each a frame with its own header, pushed in the order backward produces
them (the last layers first). The ps applies each as it lands and answers it at once: a
bucket's parameters come back on ``TAG_REPLY_BUCKET`` without a header, except the last
one pushed, which starts the shard and comes back as a frame behind the reply header.
Everything here (frames, persistent requests, counters) is made once; a step reuses it.
"""

import os
import threading
import time

import numpy as np
from mpi4py import MPI

from ..checks import number_from_environment
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame
from .handles import PushPullHandle

# How often a progress thread probes while buckets travel to a ps on another node.
REMOTE_PROGRESS_US = 500
# Across nodes, how many of a worker's buckets may travel unanswered, over all its ps (at
# least one per ps).
REMOTE_IN_FLIGHT = 2


def progress_seconds(link, environ=os.environ):
    """Return how often a thread drives MPI while buckets travel (0: no thread).

    A sent bucket, and its reply, move only while a rank is inside MPI. Over TCP to a ps on
    another node nothing else moves them while backward computes, so a thread probes every
    REMOTE_PROGRESS_US (across a 1 Gbit/s link: 42 % of the round trip hidden without it,
    88 % with it; benchmarks/README.md). On one node the receiver copies each message
    itself through shared memory and the thread only takes a core (slower steps on 2
    cores). ``$MPITF_PROGRESS_US`` sets it either way (0: never).
    """
    given = number_from_environment("MPITF_PROGRESS_US", "microseconds", environ=environ)
    if given is not None:
        return given / 1e6
    here = link.host_of(link.comm.Get_rank())
    remote = any(link.host_of(rank) != here for rank in link.ranks)
    return REMOTE_PROGRESS_US / 1e6 if remote else 0.0


def push_window(link, environ=os.environ):
    """Return how many buckets to one ps may travel unanswered (0: no limit).

    A sync ps answers bucket k once every worker's bucket k is in. Over shaped links the
    workers' streams into one ps are not fair (TCP incast): one worker's whole push landed
    while another's first buckets waited, and the answers bunched at the end of the
    step, after the pushes instead of during them (4 workers on 1 ps at 200 Mbit/s: 1.7 x
    the link's time). With few buckets unanswered, a worker ahead waits for its replies and
    leaves the ps's link to the others, so bucket k's answer goes out while bucket k + 1
    arrives. REMOTE_IN_FLIGHT over all ps keeps one ps's link busy (2 with one ps); with
    several ps, one each already keeps the worker's link busy, and a second only queues
    at the ps's switch port (8 + 8 ps, 16 MiB, 200 Mbit/s, one run each: 763 ms with one,
    873 with two;
    benchmarks/README.md, "Scaling over links"). On one node nothing queues on a link: no
    limit. ``$MPITF_PUSH_WINDOW`` sets it either way (0: none).
    """
    given = number_from_environment("MPITF_PUSH_WINDOW", "buckets", environ=environ)
    if given is not None:
        return int(given)
    if link.chunked:
        return 0
    here = link.host_of(link.comm.Get_rank())
    if all(link.host_of(rank) == here for rank in link.ranks):
        return 0
    return max(1, REMOTE_IN_FLIGHT // len(link.ranks))


def buckets_for_links(config, server):
    """Return ``config`` knowing whether its ps tasks and workers span nodes.

    Where they do, every worker pushes to some ps over a link, and a default bucket size
    (``--bucket-bytes`` not given) becomes the link's (:func:`mpitf.config.
    default_bucket_bytes`). Every rank decides from the same gathered host names, so ps and
    workers cut their buckets alike.
    """
    hosts = {server.host_of(rank) for rank in server.ranks_of("ps") + server.replica_ranks}
    across = len(hosts) > 1
    return config if across == config.across_nodes else config.replace(across_nodes=across)


class BucketedPush:
    """One step's bucketed push and per-bucket pull, reused step after step.

    ``frames`` lists ``(ps, bucket)`` in push order, interleaving the ps (bucket 0 of
    every ps, then bucket 1, ...); each ps's buckets leave in their order, which is the
    order the ps applies and answers them.

    Args:
        link: the :class:`~mpitf.worker.link.PsLink` to the ps tasks.
        buckets: per ps, its buckets' element ranges in push order.
        slices: the placement's slices (which bucket holds which variable).
        stage: the wire stage (:mod:`mpitf.worker.wire_frames`): its layouts place the
            frames; it narrows each bucket as it leaves and widens each as it lands.
        grad_frames: the gradient frames, one per bucket in the gradient layout's order.
        replies: the :class:`~mpitf.worker.handles.Replies` (the parameter frames, and
            the reading of the last replies).
        grad_views: the model's gradient views (partitioned variables scatter from them).
        rates: the :class:`~mpitf.worker.rates.GroupRates` each push sends.
        backend: the array backend (synchronised before a bucket leaves).
        chunk_bytes: chunk size when frames are staged.
        timeline: a :class:`~mpitf.runtime.timeline.Timeline` (per-bucket events), or None.
    """

    def __init__(self, link, buckets, slices, stage, grad_frames, replies, grad_views, rates,
                 backend, chunk_bytes=None, timeline=None):
        self.link, self.buckets, self.stage, self.replies = link, buckets, stage, replies
        self.grad_views, self.rates, self.backend = grad_views, rates, backend
        self.timeline = timeline
        self.handle_class = PushPullHandle.kind_for(link)  # a reply: whole or in chunks
        nmax = max(len(b) for b in buckets)
        self.order = [(p, k) for k in range(nmax) for p in range(len(buckets))
                      if k < len(buckets[p])]
        self.index = index = {pk: i for i, pk in enumerate(self.order)}
        # gradient frames (one per bucket, in the gradient layout's memory order)
        self.grad = [None] * len(self.order)
        for (p, k, _), frame in zip(stage.grad_layout.frames, grad_frames):
            self.grad[index[(p, k)]] = frame
        # reply frames over the parameter buffer: the last bucket behind the ps's header
        buffer = replies.frames[0].buffer
        self.reply, self.tags = [], []
        for p, k in self.order:
            a, b, _ = stage.layout.segments[p]
            lo, hi = buckets[p][k]
            last = k == len(buckets[p]) - 1
            segment = (a, b, b + hi) if last else (b + lo, b + lo, b + hi)
            self.reply.append(Frame(buffer, segment, chunk_bytes))
            self.tags.append(P.TAG_REPLY if last else P.TAG_REPLY_BUCKET)
        # per variable, the buckets it lies in (several: one cut between buckets); per
        # bucket, how many of its slices are left
        self.of_variable = {}
        slices_left = np.zeros(len(self.order), np.int64)
        for s in slices:
            for k, (lo, hi) in enumerate(buckets[s.ps_task]):
                if lo <= s.offset < hi or s.offset < lo < s.offset + s.size:
                    i = index[(s.ps_task, k)]
                    slices_left[i] += 1
                    self.of_variable.setdefault(s.name, []).append(i)
        self.template = slices_left
        self.left = slices_left.copy()
        self.split = {name for name, _ in grad_views.split}
        self.next = [0] * len(buckets)  # per ps, its next bucket to push
        self.sent = [0] * len(buckets)  # per ps, its buckets sent (at most next)
        self.answered = [0] * len(buckets)  # per ps, its buckets answered (at most sent)
        self.window = push_window(link)
        self._lock = threading.Lock()  # the progress thread sends too, within the window
        self.receives = [None] * len(self.order)
        self.sends = []
        self.arrived = [False] * len(self.order)
        self.reply_value = None
        # A thread that drives MPI while backward computes, made once, woken per step.
        self.progress_seconds = progress_seconds(link)
        self._busy = threading.Event()
        self._progress = None

    def _drive(self, comm):
        # MPI moves a large message only while a rank is inside an MPI call: probe (on a
        # tag nothing uses) while the main thread computes, so sent buckets keep moving.
        while True:
            self._busy.wait()
            time.sleep(self.progress_seconds)
            if self.window:
                self._send_window(busy_only=True)  # its tests drive MPI as a probe does
            elif self._busy.is_set():
                comm.Iprobe(MPI.ANY_SOURCE, P.TAG_PROGRESS)

    def begin(self, data_position):
        """Pack every bucket's header and post every reply's receive; return self."""
        link, buckets = self.link, self.buckets
        epoch, cursor = data_position
        self.rates.send(link)  # before any bucket leaves
        rate = self.rates.learning_rate
        for i, (p, k) in enumerate(self.order):
            lo, hi = buckets[p][k]
            H.pack_push(self.grad[i].header, link.steps[p], link.worker, hi - lo, link.flags,
                        epoch, cursor, rate, k, len(buckets[p]))
            self.receives[i] = self.reply[i].irecv(link.comm, link.ranks[p], self.tags[i])
            self.arrived[i] = False
        np.copyto(self.left, self.template)
        self.next = [0] * len(buckets)
        self.sent = [0] * len(buckets)
        self.answered = [0] * len(buckets)
        self.sends = []
        self.reply_value = None
        return self

    def final(self, names):
        """Mark the gradients of ``names`` final; push every bucket that now is, in order."""
        for name in names:
            if name in self.split:
                self.grad_views.scatter((name,))
            for i in self.of_variable.get(name, ()):
                self.left[i] -= 1
        self._push(lambda i: self.left[i] <= 0)
        return self

    def push_rest(self):
        """Push every bucket not pushed yet; return self (wait on it)."""
        if self.split:
            self.grad_views.scatter()
        self._push(lambda i: True)
        return self

    def _push(self, ready):
        link = self.link
        start = time.perf_counter()
        go = []
        for p, n in enumerate(self.buckets):
            while self.next[p] < len(n) and ready(self.index[(p, self.next[p])]):
                go.append(self.index[(p, self.next[p])])
                self.next[p] += 1
        if not go:
            return
        for i in go:
            self.stage.narrow_grad(*self.order[i])
            self.grad[i].commit()
        self.backend.synchronize()  # MPI must see the finished gradient
        self._send_window(start)
        if self.progress_seconds and not self._busy.is_set():
            if self._progress is None:
                if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                    return
                self._progress = threading.Thread(target=self._drive, args=(link.comm,),
                                                  daemon=True, name="mpitf-progress")
                self._progress.start()
            self._busy.set()

    def _send_window(self, start=None, busy_only=False):
        """Send each ps's ready buckets, as many as its window of unanswered ones allows.

        ``busy_only``: (the progress thread) only while the main thread computes; the
        main thread, once it waits, tests the replies itself.
        """
        link, tl, window = self.link, self.timeline, self.window
        with self._lock:
            if busy_only and not self._busy.is_set():
                return
            for p in range(len(self.buckets)):
                if window:  # count the replies that came, in the order the ps answers
                    while self.answered[p] < self.sent[p]:
                        i = self.index[(p, self.answered[p])]
                        if not (self.arrived[i] or _test_all(self.receives[i])):
                            break
                        self.answered[p] += 1
                while self.sent[p] < self.next[p] and (
                        not window or self.sent[p] - self.answered[p] < window):
                    k = self.sent[p]
                    i = self.index[(p, k)]
                    self.sends.extend(self.grad[i].isend(link.comm, link.ranks[p],
                                                         P.TAG_REQUEST))
                    self.sent[p] = k + 1
                    if tl is not None and tl.enabled:
                        tl.add("push", time.perf_counter() if start is None else start,
                               time.perf_counter(), bucket=k, ps=p, step=link.steps[p])

    def _describe(self, i, operation="push_pull (bucketed)"):
        return self.link.describe(self.order[i][0], operation)

    def _wait_bucket(self, i, between=None):
        if self.arrived[i]:
            return
        link, tl = self.link, self.timeline
        start = time.perf_counter()
        if self.window:  # the buckets behind this one leave as their replies come
            between = self._sender(between)
        self.handle_class.wait_reply(self.reply[i], self.receives[i], link.deadline,
                                     lambda _, i=i: self._describe(i), between)
        self.stage.widen_params(*self.order[i])
        self.arrived[i] = True
        if tl is not None and tl.enabled:
            p = self.order[i][0]
            tl.add("pull", start, time.perf_counter(), bucket=self.order[i][1], ps=p,
                   step=link.steps[p])

    def _sender(self, between):
        """Return a ``between`` that sends within the window first, then calls ``between``."""
        if between is None:
            return self._send_window

        def both():
            self._send_window()
            between()
        return both

    def _main_thread_waits(self):
        """Stop the progress thread's work (it may be inside a test of a reply now)."""
        self._busy.clear()
        with self._lock:  # a test it had begun has ended; it starts none now
            pass

    def wait_params(self, name):
        """Wait for the buckets holding variable ``name`` (the rest may still travel)."""
        self._main_thread_waits()
        for i in self.of_variable.get(name, ()):
            self._wait_bucket(i)

    def done(self):
        """Return True when every bucket was pushed and answered (without blocking)."""
        if self.window and self.reply_value is None:
            self._send_window()
        return self.reply_value is not None or (
            all(self.sent[p] == len(b) for p, b in enumerate(self.buckets)) and
            all(self.arrived[i] or _test_all(self.receives[i]) for i in range(len(self.order)))
            and _test_all(self.sends))

    def wait(self, between=None):
        """Push what is left, wait for every bucket's reply; return the :class:`Reply`.

        ``between()``, if given, is called between polls while a reply is awaited (work
        the worker would otherwise wait through).
        """
        if self.reply_value is None:
            self.push_rest()
            self._main_thread_waits()
            for i in range(len(self.order)):
                self._wait_bucket(i, between)
            P.wait_all(self.sends, self.link.deadline, lambda _: self._describe(0))
            self.reply_value = self.replies.finish(widen=False)
        return self.reply_value


def _test_all(requests):
    """Return True when every request in ``requests`` has completed."""
    return MPI.Request.Testall(requests)
