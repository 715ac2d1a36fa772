"""Consistency modes: small policies that decide what the ps does with each pushed gradient.

The service loop is the same for every mode; a policy only answers "a push arrived" and
"a worker left", calling back into the service to apply, reply, drop or hold. Who pushes
(:class:`Senders`) is every replica, the in-graph clients, or one leader per node: with
node-local aggregation (``PsAssignment.nodes``, see mpitf/worker/node.py) a leader pushes
its node's summed gradients, so each push counts as that many replicas (``weights``), and
the leader's paused and done requests carry each replica's data position.
"""

import numpy as np

from ..config import check_int
from ..errors import ConfigurationError, PeerError
from ..wire import header as H
from ..wire import protocol as P
from ..wire.convert import add_widened, widen_into


class SyncReplicas:
    """Aggregate gradients of the current step; apply their mean once enough have arrived.

    The counterpart of ``tf.train.SyncReplicasOptimizer``: a gradient computed on an older
    step is dropped (its sender still gets fresh parameters), and with
    ``total_num_replicas > replicas_to_aggregate`` the slowest workers are not waited for.
    ``deterministic`` sums in worker order, so runs are bit-for-bit equal; it holds one
    receive buffer per worker to do so and needs every worker in every step. ``weights``
    (node-local aggregation) is the replicas each worker's push sums: the mean divides by
    their total, not by the pushes.
    """

    name = "sync"

    def __init__(self, replicas_to_aggregate, total_num_replicas, deterministic=False,
                 weights=None):
        if not 1 <= replicas_to_aggregate <= total_num_replicas:
            raise ConfigurationError(
                f"replicas_to_aggregate must be between 1 and total_num_replicas "
                f"({total_num_replicas}), got {replicas_to_aggregate}")
        if deterministic and replicas_to_aggregate != total_num_replicas:
            raise ConfigurationError(
                "deterministic sync needs replicas_to_aggregate == total_num_replicas: with "
                "backup workers, which gradients make a step depends on timing")
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_num_replicas = total_num_replicas
        self.deterministic = deterministic
        self.weights = weights
        # per bucket (one without buckets): the workers whose gradient is in the
        # accumulator, in arrival order; deterministic: worker -> (gradient, pool index or
        # None), summed in worker order
        self.waiting = {}
        self.held = {}
        self.accum = None
        self.copies = {}  # deterministic with buckets: worker -> its gradient, bucket by bucket

    def receive_buffers(self, num_workers, bucketed=False):
        """Return how many receive frames the ps needs (see :meth:`Async.receive_buffers`).

        Deterministic mode holds early gradients until their turn: one frame per worker,
        and one more for the messages that keep coming meanwhile. With buckets it copies
        them aside instead (a worker may be many buckets ahead) and receives into two.
        """
        if self.deterministic and not bucketed:
            return num_workers + 1
        return 2 if bucketed else 1

    def needed(self, svc):
        """Return how many gradients complete a step now (fewer once workers have left)."""
        return min(self.replicas_to_aggregate, svc.num_active)

    def on_push(self, svc, worker, step, frame, index, bucket=0):
        """Handle one pushed gradient (bucket); return True when its frame may be reused now.

        Each bucket is aggregated and applied on its own, as TF aggregates each variable;
        a bucket's step is how often it was applied, and the step completes with the last.
        """
        pipe = svc.pipeline
        g = pipe.steps[bucket]
        if step < g:
            svc.drop(worker, g - step, bucket)
            return True
        if step > g:
            raise PeerError(f"push for step {step} but the ps is at step {g}",
                            **svc.describe_worker(worker, "push"))
        if bucket == pipe.last:
            svc.note_staleness(0)
        lo, hi = pipe.ranges[bucket]
        grad = frame.payload[:hi - lo]
        waiting = self.waiting.setdefault(bucket, [])
        if self.deterministic:
            held = self.held.setdefault(bucket, {})
            if pipe.bucketed:
                copy = self.copies.get(worker)
                if copy is None:
                    copy = self.copies[worker] = svc.xp.empty_like(svc.shard.params)
                _put(copy[lo:hi], grad)
                held[worker] = (copy[lo:hi], None)
            else:
                held[worker] = (grad, index)
            waiting.append(worker)
            self.maybe_step(svc, bucket)
            return pipe.bucketed
        if not waiting and self.needed(svc) == 1 and self.weights is None:
            svc.apply(grad, (worker,), bucket)  # one gradient: no need to copy it first
            svc.reply(worker, bucket=bucket)
            return True
        if self.accum is None:
            self.accum = svc.xp.empty_like(svc.shard.params)
        accum = self.accum[lo:hi]
        if not waiting:
            _put(accum, grad)
        else:
            _add(svc.xp, accum, grad)
        waiting.append(worker)
        self.maybe_step(svc, bucket)
        return True

    def maybe_step(self, svc, bucket=0):
        """Apply the bucket's mean and answer its waiting workers once enough are in."""
        waiting = self.waiting.get(bucket)
        count = len(waiting) if waiting else 0
        if count == 0 or count < self.needed(svc):
            return
        lo, hi = svc.pipeline.ranges[bucket]
        if self.accum is None:
            self.accum = svc.xp.empty_like(svc.shard.params)
        accum = self.accum[lo:hi]
        if self.deterministic:
            held = self.held[bucket]
            order = sorted(held)
            _put(accum, held[order[0]][0])
            for w in order[1:]:
                _add(svc.xp, accum, held[w][0])
            for w in order:
                if held[w][1] is not None:
                    svc.release(held[w][1])
            held.clear()
        if self.weights is not None:
            count = sum(self.weights[w] for w in waiting)
        if count > 1:
            svc.xp.divide(accum, count, out=accum)
        self.waiting[bucket] = []
        svc.apply(accum, waiting, bucket)
        for w in waiting:
            svc.reply(w, bucket=bucket)

    def on_worker_gone(self, svc, worker):
        """A worker finished or paused: a step may now complete with fewer gradients."""
        for bucket in range(svc.pipeline.count):
            self.maybe_step(svc, bucket)

    def on_worker_lost(self, svc, worker):
        """Say what losing ``worker`` (it died, under ULFM) costs; deterministic: raise.

        A gradient it pushed for this step still counts; from now on each step waits for
        the survivors only (``needed`` counts the active workers).
        """
        if self.weights is not None:
            raise PeerError(f"a node's leader died at step {svc.global_step}: its node's "
                            "replicas wait on it, so the job ends",
                            **svc.describe_worker(worker, "training"))
        if self.deterministic:
            raise PeerError(f"a worker died at step {svc.global_step}: deterministic sync "
                            "needs every worker's gradient in every step, so the job ends",
                            **svc.describe_worker(worker, "training"))
        before = self.needed(svc)
        after = min(self.replicas_to_aggregate, svc.num_active - 1)
        return (f"sync steps now aggregate {after} gradient{'s' if after != 1 else ''} "
                f"(replicas_to_aggregate was {before})")

    def is_waiting(self, worker):
        """Return True if ``worker`` waits for this ps to finish a step."""
        return any(worker in w for w in self.waiting.values())


def _put(accum, grad):
    """Copy ``grad`` into the float32 ``accum``, widened from a 16-bit wire dtype."""
    if grad.dtype == accum.dtype:
        accum[...] = grad
    else:
        widen_into(grad, accum)


def _add(xp, accum, grad):
    """Add ``grad`` into ``accum`` in ``accum``'s dtype (a 16-bit wire's widened)."""
    if grad.dtype == accum.dtype:
        xp.add(accum, grad, out=accum)
    else:
        add_widened(accum, grad)


class Async:
    """Apply each gradient on arrival and answer with the current parameters."""

    name = "async"

    def receive_buffers(self, num_workers, bucketed=False):
        """Return how many receive frames the ps needs: one (two with buckets).

        Every gradient is used and its frame posted again before the next is waited for,
        so one frame is enough; a second one only takes turns with it and makes every
        large message land in memory that has gone cold in the cache (measured: 16 MiB
        round trips 10-15 % slower with two). With buckets the second one receives bucket
        k+1 while bucket k is applied.
        """
        return 2 if bucketed else 1

    def on_push(self, svc, worker, step, frame, index, bucket=0):
        """Apply the gradient (bucket) now; return True (the frame is free again)."""
        pipe = svc.pipeline
        if bucket == pipe.last:
            svc.note_staleness(svc.global_step - step)
        lo, hi = pipe.ranges[bucket]
        svc.apply(frame.payload[:hi - lo], (worker,), bucket)
        self.after_apply(svc, worker, bucket)
        return True

    def after_apply(self, svc, worker, bucket):
        """Answer the worker at once."""
        svc.reply(worker, bucket=bucket)

    def on_worker_gone(self, svc, worker):
        """Nothing waits on other workers in async mode."""

    def on_worker_lost(self, svc, worker):
        """Say what losing ``worker`` (it died, under ULFM) costs: its future pushes."""
        return f"its future pushes are lost ({self.name} mode waits for no one)"

    def is_waiting(self, worker):
        """Return False: no worker ever waits for others here."""
        return False


class BoundedStaleness(Async):
    """Async, but a worker more than ``staleness`` pushes ahead of the slowest waits for it.

    Each worker's clock counts its applied pushes; a worker whose clock would run more than
    ``staleness`` ahead of the slowest active worker gets its reply only when the slowest
    catches up. Workers that finished or paused for a checkpoint no longer hold others.
    """

    name = "ssp"

    def __init__(self, staleness):
        self.staleness = check_int("staleness", staleness, 0)
        self.clock = {}
        self.held = []

    def _slowest(self, svc):
        active = [self.clock.get(w, 0) for w in svc.unblocked_workers()]
        return min(active) if active else None

    def on_push(self, svc, worker, step, frame, index, bucket=0):
        """Record the worker's lead over the slowest, then apply as async does."""
        slowest = self._slowest(svc) if bucket == svc.pipeline.last else None
        if slowest is not None:
            svc.note_lead(self.clock.get(worker, 0) - slowest)
        return super().on_push(svc, worker, step, frame, index, bucket)

    def after_apply(self, svc, worker, bucket):
        """Advance the worker's clock after its last bucket; answer it unless too far ahead.

        Earlier buckets are answered at once: the worker waits for the last one.
        """
        if bucket != svc.pipeline.last:
            svc.reply(worker, bucket=bucket)
            return
        self.clock[worker] = self.clock.get(worker, 0) + 1
        self.held.append(worker)
        self.release(svc)

    def release(self, svc):
        """Answer every held worker that is within the bound again."""
        slowest = self._slowest(svc)
        still = []
        for w in self.held:
            if slowest is None or self.clock[w] - slowest <= self.staleness:
                svc.reply(w, bucket=svc.pipeline.last)
            else:
                still.append(w)
        self.held = still

    def on_worker_lost(self, svc, worker):
        """Say what losing ``worker`` (it died, under ULFM) costs: its future pushes."""
        return "its future pushes are lost (ssp no longer waits for it)"

    def on_worker_gone(self, svc, worker):
        """The slowest may have left: release whoever it held back (never a dead one)."""
        if worker in svc.lost:
            self.held = [w for w in self.held if w != worker]
        self.release(svc)

    def is_waiting(self, worker):
        """Return True if ``worker``'s reply is held back."""
        return worker in self.held


def make_policy(config, num_workers, total_num_replicas=None, weights=None):
    """Return the policy object for ``config`` (a :class:`~mpitf.config.TrainingConfig`).

    Its ``mode`` picks the policy ("sync", "async" or "ssp"); sync takes its
    ``replicas_to_aggregate`` (None: every worker) and ``deterministic``, ssp its
    ``staleness``. ``total_num_replicas`` is the number of replicas (None: all workers);
    ``weights`` (node-local aggregation, sync only) the replicas each worker's push sums.
    """
    if weights is not None:
        if config.mode != "sync" or (total_num_replicas or sum(weights)) != sum(weights):
            raise ConfigurationError(
                f"node-local aggregation needs sync mode and pushes for every replica: mode "
                f"{config.mode!r}, {sum(weights)} of {total_num_replicas} replicas")
        return SyncReplicas(len(weights), len(weights), config.deterministic, list(weights))
    if config.mode == "sync":
        total = total_num_replicas or num_workers
        if total != num_workers:
            raise ConfigurationError(
                f"total_num_replicas is {total} but the cluster has {num_workers} workers")
        return SyncReplicas(config.replicas_to_aggregate or total, total, config.deterministic)
    if config.mode == "async":
        return Async()
    if config.mode == "ssp":
        return BoundedStaleness(config.staleness)
    raise ConfigurationError(f"unknown mode {config.mode!r}: use 'sync', 'async' or 'ssp'")


class Senders:
    """The ranks that push to a ps, by worker index, and what each push stands for."""

    def __init__(self, replica_ranks, clients=None, nodes=None):
        self.nodes = nodes
        heads = [n[0] for n in nodes] if nodes else clients
        self.ranks = [replica_ranks[i] for i in heads or range(len(replica_ranks))]
        self.index = {r: i for i, r in enumerate(self.ranks)}  # rank -> worker index
        # the replica whose data position a worker's push carries (keys of the checkpoint)
        self.replica_of = heads if nodes else range(len(self.ranks))
        self.weights = [len(n) for n in nodes] if nodes else None  # replicas per push

    def counters(self):
        """Return the fan-in counters: ranks that push, the replicas they stand for, pushes."""
        return dict(fan_in=len(self.ranks), pushes_received=0,
                    replicas=sum(self.weights) if self.weights else len(self.ranks))

    def capacity(self, capacity):
        """Return the receive capacity in bytes a ps's frames need (None: their own size)."""
        if not self.nodes:
            return capacity
        return max(capacity or 0, H.HEADER_BYTES + 8 * max(map(len, self.nodes)))

    def note_positions(self, positions, worker, request, frame):
        """Record the data position(s) a request carries in ``positions`` (replica -> pair).

        A push carries its sender's; a node leader's paused or done one word per replica.
        """
        if request.kind == P.PUSH:
            positions[self.replica_of[worker]] = (request.epoch, request.cursor)
        elif request.count and request.kind in (P.PAUSED, P.DONE) and self.nodes:
            end = H.HEADER_BYTES + 8 * request.count
            words = frame.bytes[H.HEADER_BYTES:end].view(np.int64).tolist()
            positions.update(zip(self.nodes[worker], map(H.split_position, words)))
