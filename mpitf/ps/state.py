"""A ps's state in one object: its step, counters, who is alive, paused or done, positions.

The service (:mod:`mpitf.ps.service`) makes one :class:`ServiceState` and hands it to
whatever reads or changes it: the request handlers (:mod:`mpitf.ps.handlers`) and the
checkpoint cuts (:mod:`mpitf.ps.cuts`) and losses (:mod:`mpitf.ps.losses`) take it as
their first argument; the policies and the one-frame path reach it as ``svc.state``.
Everything else on the service is made once (its shard, pool, pipeline, policy).
"""

import time


class ServiceState:
    """What one ps knows of its run (see the module docstring).

    Attributes:
        global_step: the steps applied (local SGD: local steps averaged).
        initialized: the parameters are set (the chief's INIT, or a restore).
        pending_pulls: ``(worker, kind)`` of pulls that came before the parameters.
        done, paused, lost: workers that finished, paused for a cut, or died (ULFM: done
            too, their pushes never come).
        chief, chief_flags: the chief's rank, and the replies' flags naming its successor
            (``P.CHIEF_SHIFT``) once it died.
        requeue: a worker ended asking to be requeued (a signal's cut).
        pausing: a cut was asked for: replies say pause until every worker paused.
        healing: the chief asked for the lost ranks' replacement (``--heal``): replies
            say pause until every worker paused, then the job heals (ps/heals.py).
        lost_at: worker -> when its loss was taken (the heal says how long it took).
        positions: replica -> (epoch, cursor) of its last applied push (the cut's).
        last_seen, last_message: when each worker, and any, was last heard.
        last_push: when each worker last pushed (None: not since start-up or a pause).
        next_check: when the silence check is due next.
        counters: what the reply headers and ``COUNTERS`` carry (global_step,
            pushes_applied, stale_dropped, ..., bytes_in, bytes_out, the sparse pulls and
            pushes received (one each per worker's step, for all its tables), the fan-in's).
        chunked_workers: the workers that stage through host memory, in chunks.
    """

    __slots__ = ("global_step", "initialized", "pending_pulls", "done", "paused", "lost",
                 "chief", "chief_flags", "requeue", "pausing", "healing", "lost_at",
                 "positions", "last_seen", "last_message", "last_push", "next_check",
                 "counters", "chunked_workers", "num_workers")

    def __init__(self, num_workers, chief, fan_in_counters):
        self.num_workers = num_workers
        self.global_step = 0
        self.initialized = False
        self.pending_pulls = []
        self.done, self.paused, self.lost = set(), set(), set()
        self.chief, self.chief_flags = chief, 0
        self.requeue = self.pausing = self.healing = False
        self.lost_at = {}
        self.positions = {}
        self.last_seen = {w: time.monotonic() for w in range(num_workers)}
        self.last_message = 0.0
        self.last_push = [None] * num_workers
        self.next_check = 0.0
        self.counters = dict(global_step=0, pushes_applied=0, stale_dropped=0,
                             nonfinite_skipped=0, staleness_histogram={}, max_staleness=0,
                             max_lead=0, bytes_in=0, bytes_out=0, sparse_pulls=0,
                             sparse_pushes=0, **fan_in_counters)
        self.chunked_workers = set()

    @property
    def num_active(self):
        """Return the number of workers that have not finished."""
        return self.num_workers - len(self.done)

    def unblocked_workers(self):
        """Return the workers still training (neither finished nor paused)."""
        return [w for w in range(self.num_workers) if w not in self.done and w not in self.paused]

    def note_staleness(self, staleness):
        """Count a gradient of the given staleness (steps behind the ps) in the histogram."""
        counters = self.counters
        hist = counters["staleness_histogram"]
        hist[staleness] = hist.get(staleness, 0) + 1
        if staleness > counters["max_staleness"]:
            counters["max_staleness"] = staleness

    def note_lead(self, lead):
        """Record how far a worker ran ahead of the slowest (bounded staleness)."""
        self.counters["max_lead"] = max(self.counters["max_lead"], lead)
