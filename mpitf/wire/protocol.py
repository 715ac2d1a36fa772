"""The wire protocol between workers and parameter servers, in one place.

Every message on the data path is one *frame*: a 64-byte header of eight int64 words
followed by the payload, in one contiguous buffer. A worker's flat parameter and gradient
buffers are laid out ps by ps with a header slot in front of each ps's part, so a push or
a pull sends or receives one contiguous view with no copy and one MPI call (two messages,
header then payload, would double the per-message cost that dominates small models).

What each header word holds, per kind, is in :mod:`mpitf.wire.header`, the one module
that packs and reads them; this one holds the kinds, tags and flags, the one MPI call
that moves a frame, and the waits.

Ordering: MPI does not let two messages between one pair of ranks on one tag overtake each
other, so a worker's pushes reach each ps in the order sent and no sequence numbers are
needed beyond the step.
"""

import time

from mpi4py import MPI

from ..errors import DeadlineError
from ..runtime import spin

# Tags. Requests and replies use separate tags so a worker's outstanding reply receive can
# never match another worker's request.
TAG_REQUEST = 11  # worker -> ps frames
TAG_REPLY = 12  # ps -> worker frames
TAG_CONTROL = 13  # pickled control objects (config, save, counters): rare, so objects are fine
TAG_SPARSE_REPLY = 14  # ps -> worker rows of an embedding table (answers SPARSE_PULL)
TAG_TRAINING_END = 15  # chief -> evaluator: training ended; the last committed checkpoint
TAG_PROGRESS = 17  # never sent: a worker probes it to drive MPI while backward computes
TAG_REPLY_WARD = 18  # ps -> worker: a reply for the shard a buddy serves for a lost ps
TAG_REPLICA = 19  # ps -> its buddy ps: a copy of its shard (--ps-replication-steps)
TAG_REPLICA_END = 20  # ps -> its buddy ps: no copy follows (the end of training)
TAG_SPARSE_REPLY_WARD = 21  # ps -> worker: rows of a lost ps's tables, which its buddy serves
TAG_REPLY_BUCKET = 16  # ps -> worker: a bucket's parameters without a header (buckets in
#   push order; the last one, which starts the shard, comes as a frame on TAG_REPLY)
CHUNK_TAG_OFFSET = 100  # continuation chunks of a staged frame: TAG_REQUEST/TAG_REPLY + 100
DEFAULT_CHUNK_BYTES = 4 << 20  # chunk size of frames staged through pinned host memory

# Request kinds (worker -> ps).
PUSH = 1  # payload: gradient; reply: parameters after the ps handled it
PULL = 2  # no payload; reply: current parameters
PULL_AVERAGE = 3  # no payload; reply: the moving average of the parameters
INIT = 4  # payload: initial parameters (chief only); no reply
DONE = 5  # no payload; the worker has finished; no reply
PAUSED = 6  # no payload; the worker saw a pause flag and waits for the chief
SAVE = 7  # no payload; the chief asks for a checkpoint cut
COUNTERS = 8  # no payload; the ps answers with a pickled dict of counters on TAG_CONTROL
SKIP = 9  # no payload; the worker dropped a NaN/Inf gradient: count it, reply parameters
SPARSE_PULL = 10  # payload: ids per table (wire/sparse.py); reply: their rows (SPARSE_REPLY)
SPARSE_PUSH = 11  # payload: ids and row gradients per table; no reply (the PUSH after it has)
RATES = 12  # payload: a float64 learning rate per optimizer group, then perhaps the clip
#   norm (ps/clip.py); no reply (before a PUSH)
HEAL = 13  # no payload; the chief asks for lost ranks to be replaced (--heal, runtime/heal.py)
# Reply kinds (ps -> worker).
REPLY = 21
SPARSE_REPLY = 22  # on TAG_SPARSE_REPLY: the rows a SPARSE_PULL asked for

# Flags (the header's ``flags`` word).
FLAG_PAUSE = 1  # stop after this step and wait for the chief (a checkpoint is being cut)
FLAG_HEAL = 2  # (in replies) stop after this step: the job replaces its lost ranks
FLAG_REQUEUE = 8  # (in done) the job ends on a signal: exit with the requeue code
FLAG_CHUNKED = 16  # (in requests) this worker stages through host memory: frames in chunks
FLAG_LEARNING_RATE = 32  # (in push) the header's last word is the learning rate to apply
FLAG_WARD = 64  # (in requests) for the shard of a lost ps, which its buddy now serves
FLAG_CLIPPED = 128  # (in replies) the last word is the float64 bits of the norm the ps
#   clipped the step's mean gradient by (sync mode, whose max_lead is 0)
FLAG_DELTA = 256  # (in save) a delta checkpoint: each ps writes the table rows changed
#   since the last checkpoint (ckpt/deltas.py)
CHIEF_SHIFT = 32  # (in replies) flags >> 32, once the chief died (ULFM): 1 + the replica
#   index that has its duties now (0: the chief lives)

KIND_NAMES = {PUSH: "push", PULL: "pull", PULL_AVERAGE: "pull of the average", INIT: "init",
              DONE: "done", PAUSED: "paused", SAVE: "save", COUNTERS: "counters", SKIP: "skip",
              SPARSE_PULL: "sparse pull", SPARSE_PUSH: "sparse push", RATES: "rates", HEAL: "heal",
              REPLY: "reply",
              SPARSE_REPLY: "sparse reply"}


def frame_op(mpi_call, frame, peer, tag):
    """Send or receive one frame (header then payload, one buffer) with the MPI call given.

    ``mpi_call`` is a bound method such as ``comm.Isend``, ``comm.Irecv``, ``comm.Send`` or
    ``comm.Recv``; ``frame`` is a byte view over header and payload.
    """
    return mpi_call([frame, MPI.BYTE], peer, tag)


# Polling: MPI moves a message only while this rank is inside an MPI call, so a waiting
# rank polls: it spins for about as long as its messages take, then sleeps between polls
# (runtime/spin.py says why and how long, and holds the process's policy).


class _Poll:
    """Pace one polling wait, enforce its deadline, and tell the policy how long it took."""

    __slots__ = ("start", "deadline", "budget")

    def __init__(self, deadline, nbytes=0):
        self.start = time.monotonic()
        self.deadline = deadline
        self.budget = spin.POLICY.budget(nbytes)

    def pause(self):
        """Yield or sleep before the next poll; return True once the deadline has passed."""
        elapsed = time.monotonic() - self.start
        spin.POLICY.pause(elapsed, self.budget)
        return self.deadline is not None and elapsed > self.deadline

    def restart(self):
        """Start the clock again (after a deadline callback chose to keep waiting)."""
        self.start = time.monotonic()

    def ended(self):
        """Report the wait's length to the policy (it has completed)."""
        spin.POLICY.ended(time.monotonic() - self.start)


def wait_all(requests, deadline, describe, between=None, nbytes=0):
    """Wait for all requests with a deadline in seconds (None: none).

    ``between()``, if given, is called between two polls (work that must go on meanwhile);
    ``nbytes``: the bytes the requests move (see :class:`~mpitf.runtime.spin.SpinPolicy`).
    """
    if MPI.Request.Testall(requests):
        return
    poll = _Poll(deadline, nbytes)  # even with no deadline: MPI's Waitall would spin in MPI
    while not MPI.Request.Testall(requests):
        if between is not None:
            between()
        if poll.pause():
            # Test, not a null check: a persistent request stays non-null once complete.
            pending = [i for i, r in enumerate(requests) if not r.Test()]
            info = describe(pending[0]) if pending else {}
            raise DeadlineError(f"no answer within {deadline:g} s", **info)
    poll.ended()


def wait_until(ready, poll_every, on_quiet, between=None):
    """Poll ``ready()`` until it returns something true; return that.

    Every ``poll_every`` seconds (None: never) of polling ``on_quiet()`` is called (it may
    raise); ``between()``, if given, between two polls.
    """
    poll = _Poll(poll_every)
    while True:
        found = ready()
        if found:
            poll.ended()
            return found
        if between is not None:
            between()
        if poll.pause():
            on_quiet()
            poll.restart()


def wait_message(comm, tag, poll_every, on_quiet, status, between=None):
    """Return the next message on ``tag`` from any rank, matched (``MPI_Improbe``).

    ``poll_every``, ``on_quiet`` and ``between`` as for :func:`wait_until`.
    """
    return wait_until(lambda: comm.Improbe(MPI.ANY_SOURCE, tag, status), poll_every,
                      on_quiet, between)


def recv_object(comm, source, tag, deadline, describe):
    """Receive a pickled control object, raising DeadlineError after ``deadline`` seconds."""
    poll = _Poll(deadline)
    status = MPI.Status()
    while not comm.Iprobe(source, tag, status):
        if poll.pause():
            raise DeadlineError(f"no answer within {deadline:g} s", **describe())
    poll.ended()
    return comm.recv(source=status.Get_source(), tag=tag)
