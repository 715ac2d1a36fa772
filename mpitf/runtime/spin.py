"""How a waiting rank paces its polls: spin about as long as its messages take, then sleep.

MPI moves a message only while a rank is inside an MPI call, so a rank that polls often
gets its message sooner; but a rank that polls in a loop holds a core, and where ranks
outnumber cores (a ps beside its workers, one ps per node by default) that core is a
worker's. With 1 ps + 2 workers on 2 cores, the 20 ms of spinning every wait used to
start with made a sync step 1.5x slower than torch DDP on the same cores.

A wait that ends within a couple of milliseconds is a message's own latency (a round trip
of a small model, a bucket, a copy by MPI); a longer one waits for another rank's
computation, which no amount of spinning hastens. :class:`SpinPolicy` learns the first
kind from the rank's own waits and spins about twice that before it sleeps. A wait that
knows it moves many bytes (a round trip of megabytes, which MPI copies only while the
receiver polls) spins at least as long as copying them takes.
"""

import os
import time

from ..checks import number_from_environment
from ..errors import CollectiveError, ConfigurationError


class SpinPolicy:
    """Spin for about twice the recent latency of this rank's messages, then sleep.

    ``latency`` is a moving average of the waits that ended within ``cap`` seconds (the
    longer ones waited for computation, and say nothing about messages). A wait spins
    (``sched_yield``, which hands the core to any other runnable process) for
    ``2 * latency``, at least ``FLOOR`` (one sleep's wake-up costs about 50-60 µs of timer
    slack, so a shorter spin cannot pay for itself) and at most ``cap``; for its first
    ``latency`` (at most ``FLOOR``) it polls without even yielding, as MPI's own waits
    do: a 4 KiB round trip took 0.7 µs less (11.3 against 12.0 µs here). After that it
    sleeps between polls, ``1/RATIO`` of the time it has waited, up to ``MAX_SLEEP``: a
    message that lands while it sleeps is late by about ``1/RATIO`` of the wait, and a
    rank with nothing to do wakes ``1/MAX_SLEEP`` times a second (1-2 % of a core
    here). A wait for ``nbytes`` in flight spins at least ``nbytes / MOVE_RATE`` (at most
    ``MAX_MOVE``): longer than the cap, yet message time, not another rank's computation
    (16 MiB each way took 7-8 % longer sleeping than spinning). ``fixed`` (seconds, from
    ``$MPITF_SPIN_MS``) spins that long every wait instead, for MPI builds that move large
    messages only while both ranks poll (no CMA).
    """

    __slots__ = ("latency", "cap", "fixed")

    FLOOR = 50e-6
    CAP = 1e-3
    RATIO = 50
    MAX_SLEEP = 2e-3
    MOVE_RATE = 4e9  # bytes/s: half the 10 GB/s raw MPI moves here (an SGD apply in between)
    MAX_MOVE = 50e-3

    def __init__(self, fixed=None, cap=CAP):
        self.latency = self.FLOOR / 2
        self.cap = cap
        self.fixed = fixed

    @classmethod
    def from_environment(cls, environ=None):
        """Return the policy ``$MPITF_SPIN_MS`` asks for (adaptive when unset or empty)."""
        ms = number_from_environment("MPITF_SPIN_MS", "milliseconds", environ=environ)
        return cls(fixed=None if ms is None else ms / 1e3)

    def budget(self, nbytes=0):
        """Return the seconds a wait for ``nbytes`` in flight spins before it sleeps."""
        if self.fixed is not None:
            return self.fixed
        spin = min(self.cap, max(self.FLOOR, 2 * self.latency))
        return max(spin, min(self.MAX_MOVE, nbytes / self.MOVE_RATE)) if nbytes else spin

    def pause(self, elapsed, budget):
        """Yield or sleep before the next poll of a wait ``elapsed`` seconds old."""
        if elapsed < budget:
            if elapsed < self.latency and elapsed < self.FLOOR:
                return  # the message is due any moment: poll again at once
            os.sched_yield()  # time.sleep(0) would sleep ~50 us (timer slack)
        else:
            time.sleep(min(self.MAX_SLEEP, elapsed / self.RATIO))

    def ended(self, elapsed):
        """Learn from a wait that ended after ``elapsed`` seconds."""
        if elapsed < self.cap:
            self.latency += (elapsed - self.latency) / 4


POLICY = SpinPolicy()  # this process's (only its main thread waits): adaptive until a Server
#   starts and reads $MPITF_SPIN_MS (use_environment), where a bad value ends the job by name


def use_environment(environ=None):
    """Make the policy ``$MPITF_SPIN_MS`` asks for this process's (a Server does, starting).

    A bad value is a :class:`~mpitf.errors.CollectiveError`: every rank reads the same
    variable, so one says it and all exit.
    """
    global POLICY
    try:
        POLICY = SpinPolicy.from_environment(environ)
    except ConfigurationError as exc:
        raise CollectiveError(exc) from None
