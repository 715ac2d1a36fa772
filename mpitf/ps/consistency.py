"""Consistency modes: small policies that decide what the ps does with each pushed gradient.

The service loop is the same for every mode; a policy answers "a push arrived" (first
:meth:`admit`: is it for a step the ps takes now, or stale, or early; then ``on_push``)
and "a worker left" (``on_worker_gone``, ``on_worker_lost``), calling back into the
service to apply and reply (:meth:`~mpitf.ps.service.Service.apply_and_reply`), drop or
release a frame. It also says what else depends on its mode: ``mode`` (the
:class:`~mpitf.modes.Mode` the workers see too: where clipping happens, cut steps),
``applies_gradients`` (the optimizer's update, or an average put in place),
:meth:`applies_at_once` (the one-frame path), ``receive_buffers`` and ``is_waiting``.
With node-local aggregation a push stands for several replicas (``weights``, from
:class:`~mpitf.ps.senders.Senders`); sync divides by their total.
"""


from ..config import check_int
from ..errors import ConfigurationError, PeerError
from ..modes import MODES


class SyncReplicas:
    """Aggregate gradients of the current step; apply their mean once enough have arrived.

    The counterpart of ``tf.train.SyncReplicasOptimizer``: a gradient computed on an older
    step is dropped (its sender still gets fresh parameters), and with
    ``total_num_replicas > replicas_to_aggregate`` the slowest workers are not waited for.
    Gradients are summed as they arrive. ``weights`` (node-local aggregation) is the
    replicas each worker's push sums: the mean divides by their total, not by the pushes.
    """

    name = "sync"
    mode = MODES["sync"]
    applies_gradients = True

    def __init__(self, replicas_to_aggregate, total_num_replicas, weights=None):
        if not 1 <= replicas_to_aggregate <= total_num_replicas:
            raise ConfigurationError(
                f"replicas_to_aggregate must be between 1 and total_num_replicas "
                f"({total_num_replicas}), got {replicas_to_aggregate}")
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_num_replicas = total_num_replicas
        self.weights = weights
        self.waiting = {}  # per bucket (one without buckets): its workers, in arrival order
        self.accum = None

    def receive_buffers(self, num_workers, bucketed=False):
        """Return how many receive frames the ps needs (see :meth:`Async.receive_buffers`)."""
        return 2 if bucketed else 1

    def needed(self, svc):
        """Return how many gradients complete a step now (fewer once workers have left)."""
        return min(self.replicas_to_aggregate, svc.state.num_active)

    def applies_at_once(self):
        """Return True when each push is its step: one gradient, not a node's sum."""
        return self.replicas_to_aggregate == 1 and self.weights is None

    def admit(self, svc, worker, step, bucket=0):
        """Return True for a push of the bucket's current step; drop an older one (False).

        A dropped push is answered with the parameters and changes nothing; a push of a
        step the ps has not reached is a broken worker's, and raises. A bucket whose mean
        is held for clipping (ps/clip.py) has had its step: a backup worker's is late.
        """
        pipe = svc.pipeline
        g = pipe.steps[bucket]
        if svc.holds_buckets and svc.clip.held[bucket] is not None:
            g += 1
        if step == g:
            if bucket == pipe.last:
                svc.state.note_staleness(0)
            return True
        if step < g:
            svc.drop(worker, g - step, bucket)
            return False
        raise PeerError(f"push for step {step} but the ps is at step {g}",
                        **svc.describe_worker(worker, "push"))

    def on_push(self, svc, worker, frame, index, bucket=0):
        """Handle one admitted gradient (bucket); return True when its frame may be reused.

        Each bucket is aggregated and applied on its own, as TF aggregates each variable;
        a bucket's step is how often it was applied, and the step completes with the last.
        """
        lo, hi = svc.pipeline.ranges[bucket]
        return self.gather(svc, worker, frame.payload[:hi - lo], index, bucket)

    def gather(self, svc, worker, grad, index, bucket):
        """Count ``worker``'s gradient (in pool frame ``index``) into the bucket's step.

        Returns True when the frame may be reused now: here always, as the gradient is
        summed (or applied) at once.
        """
        waiting = self.waiting.setdefault(bucket, [])
        if not waiting and self.needed(svc) == 1 and self.weights is None:
            # one gradient: applied from its frame, no need to copy it first
            svc.apply_and_reply(grad, (worker,), bucket, self.steps(svc))
            return True
        accum = self.accumulator(svc, bucket)
        if not waiting:
            _put(accum, grad)
        else:
            _add(svc.xp, accum, grad)
        waiting.append(worker)
        self.maybe_step(svc, bucket)
        return True

    def steps(self, svc):
        """Return the global steps the next apply advances: one."""
        return 1

    def accumulator(self, svc, bucket):
        """Return the bucket's part of the step's sum (made on the first gradient to sum)."""
        if self.accum is None:
            self.accum = svc.xp.empty_like(svc.shard.params)
        lo, hi = svc.pipeline.ranges[bucket]
        return self.accum[lo:hi]

    def summed(self, svc, bucket):
        """Return the bucket's sum of this step's gradients (summed as they arrived)."""
        return self.accumulator(svc, bucket)

    def maybe_step(self, svc, bucket=0):
        """Apply the bucket's mean and answer its waiting workers once enough are in."""
        waiting = self.waiting.get(bucket)
        count = len(waiting) if waiting else 0
        if count == 0 or count < self.needed(svc):
            return
        accum = self.summed(svc, bucket)
        if self.weights is not None:
            count = sum(self.weights[w] for w in waiting)
        if count > 1:
            svc.xp.divide(accum, count, out=accum)
        self.waiting[bucket] = []
        svc.apply_and_reply(accum, waiting, bucket, self.steps(svc))

    def on_worker_gone(self, svc, worker):
        """A worker finished or paused: a step may now complete with fewer gradients."""
        for bucket in range(svc.pipeline.count):
            self.maybe_step(svc, bucket)

    def on_worker_lost(self, svc, worker):
        """Say what losing ``worker`` (it died, under ULFM) costs.

        A gradient it pushed for this step still counts; from now on each step waits for
        the survivors only (``needed`` counts the active workers).
        """
        if self.weights is not None:
            raise PeerError(f"a node's leader died at step {svc.state.global_step}: its node's "
                            "replicas wait on it, so the job ends",
                            **svc.describe_worker(worker, "training"))
        before = self.needed(svc)
        after = min(self.replicas_to_aggregate, svc.state.num_active - 1)
        return (f"sync steps now aggregate {after} gradient{'s' if after != 1 else ''} "
                f"(replicas_to_aggregate was {before})")

    def is_waiting(self, worker):
        """Return True if ``worker`` waits for this ps to finish a step."""
        return any(worker in w for w in self.waiting.values())


class DeterministicSync(SyncReplicas):
    """Sync whose step sums the gradients in worker order, so runs are bit-for-bit equal.

    Early gradients wait for their turn: in their receive frame (one frame per worker, and
    one more for the messages that keep coming meanwhile), or with buckets copied aside (a
    worker may be many buckets ahead), received into two frames. Every worker's gradient
    is in every step, so backup workers, and a lost worker, are refused.
    """

    def __init__(self, replicas_to_aggregate, total_num_replicas, weights=None):
        if replicas_to_aggregate != total_num_replicas:
            raise ConfigurationError(
                "deterministic sync needs replicas_to_aggregate == total_num_replicas: with "
                "backup workers, which gradients make a step depends on timing")
        super().__init__(replicas_to_aggregate, total_num_replicas, weights)
        self.held = {}  # per bucket: worker -> its gradient, in a frame or copied aside
        self.frames = {}  # per bucket: the pool frames that hold gradients, freed once summed
        self.copies = {}  # with buckets: worker -> its gradient, bucket by bucket

    def receive_buffers(self, num_workers, bucketed=False):
        return 2 if bucketed else num_workers + 1

    def applies_at_once(self):
        """Return False: a step's gradients wait for their turn in their frames."""
        return False

    def gather(self, svc, worker, grad, index, bucket):
        """Hold ``worker``'s gradient for the step; True when its frame is free (copied)."""
        copied = svc.pipeline.bucketed
        if copied:
            copy = self.copies.get(worker)
            if copy is None:
                copy = self.copies[worker] = svc.xp.empty_like(svc.shard.params)
            lo, hi = svc.pipeline.ranges[bucket]
            _put(copy[lo:hi], grad)
            grad = copy[lo:hi]
        else:
            self.frames.setdefault(bucket, []).append(index)
        self.held.setdefault(bucket, {})[worker] = grad
        self.waiting.setdefault(bucket, []).append(worker)
        self.maybe_step(svc, bucket)
        return copied

    def summed(self, svc, bucket):
        """Sum the held gradients in worker order; free the frames that held them."""
        accum = self.accumulator(svc, bucket)
        held = self.held[bucket]
        order = sorted(held)
        _put(accum, held[order[0]])
        for w in order[1:]:
            _add(svc.xp, accum, held[w])
        held.clear()
        for index in self.frames.pop(bucket, ()):
            svc.release(index)
        return accum

    def on_worker_lost(self, svc, worker):
        """Raise: a step needs every worker's gradient, so the job ends."""
        raise PeerError(f"a worker died at step {svc.state.global_step}: deterministic sync "
                        "needs every worker's gradient in every step, so the job ends",
                        **svc.describe_worker(worker, "training"))


def _put(accum, grad):
    """Copy ``grad`` into the float32 ``accum``, widened from a 16-bit wire dtype."""
    if grad.dtype == accum.dtype:
        accum[...] = grad
    else:  # the conversions use numba: a ps of a float32 wire does not import it
        from ..wire.convert import widen_into

        widen_into(grad, accum)


def _add(xp, accum, grad):
    """Add ``grad`` into ``accum`` in ``accum``'s dtype (a 16-bit wire's widened)."""
    if grad.dtype == accum.dtype:
        xp.add(accum, grad, out=accum)
    else:
        from ..wire.convert import add_widened

        add_widened(accum, grad)


class Async:
    """Apply each gradient on arrival and answer with the current parameters."""

    name = "async"
    mode = MODES["async"]
    applies_gradients = True

    def receive_buffers(self, num_workers, bucketed=False):
        """Return how many receive frames the ps needs: one (two with buckets).

        Every gradient is used and its frame posted again before the next is waited for,
        so one frame is enough; a second one only takes turns with it and makes every
        large message land in memory that has gone cold in the cache (measured: 16 MiB
        round trips 10-15 % slower with two). With buckets the second one receives bucket
        k+1 while bucket k is applied.
        """
        return 2 if bucketed else 1

    def applies_at_once(self):
        """Return True: each push is applied alone and answered at once."""
        return True

    def admit(self, svc, worker, step, bucket=0):
        """Return True: every push is applied, however stale (its staleness is counted)."""
        if bucket == svc.pipeline.last:
            svc.state.note_staleness(svc.state.global_step - step)
        return True

    def on_push(self, svc, worker, frame, index, bucket=0):
        """Apply the gradient (bucket) now; return True (the frame is free again)."""
        lo, hi = svc.pipeline.ranges[bucket]
        self.after_apply(svc, worker, frame.payload[:hi - lo], bucket)
        return True

    def after_apply(self, svc, worker, grad, bucket):
        """Apply ``grad`` and answer the worker at once."""
        svc.apply_and_reply(grad, (worker,), bucket)

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
    mode = MODES["ssp"]

    def __init__(self, staleness):
        self.staleness = check_int("staleness", staleness, 0)
        self.clock = {}
        self.held = []

    def _slowest(self, svc):
        active = [self.clock.get(w, 0) for w in svc.state.unblocked_workers()]
        return min(active) if active else None

    def applies_at_once(self):
        """Return False: a reply may be held back."""
        return False

    def on_push(self, svc, worker, frame, index, bucket=0):
        """Record the worker's lead over the slowest, then apply as async does."""
        slowest = self._slowest(svc) if bucket == svc.pipeline.last else None
        if slowest is not None:
            svc.state.note_lead(self.clock.get(worker, 0) - slowest)
        return super().on_push(svc, worker, frame, index, bucket)

    def after_apply(self, svc, worker, grad, bucket):
        """Apply, then after the last bucket advance the worker's clock; answer unless ahead.

        Earlier buckets are answered at once: the worker waits for the last one.
        """
        if bucket != svc.pipeline.last:
            svc.apply_and_reply(grad, (worker,), bucket)
            return
        svc.apply_and_reply(grad, (worker,), bucket, reply=False)  # held: see release
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
        if worker in svc.state.lost:
            self.held = [w for w in self.held if w != worker]
        self.release(svc)

    def is_waiting(self, worker):
        """Return True if ``worker``'s reply is held back."""
        return worker in self.held


def _sync(config, num_workers, total_num_replicas, weights):
    sync = DeterministicSync if config.deterministic else SyncReplicas
    if weights is not None:
        if (total_num_replicas or sum(weights)) != sum(weights):
            raise ConfigurationError(
                f"node-local aggregation needs pushes for every replica: {sum(weights)} of "
                f"{total_num_replicas} replicas")
        return sync(len(weights), len(weights), list(weights))
    total = total_num_replicas or num_workers
    if total != num_workers:
        raise ConfigurationError(
            f"total_num_replicas is {total} but the cluster has {num_workers} workers")
    return sync(config.replicas_to_aggregate or total, total)


def _local(config, num_workers, total_num_replicas, weights):
    from .local import LocalAverage  # built on SyncReplicas, above

    return LocalAverage(num_workers, config.consistency)


POLICIES = {  # mode name -> (config, workers, total_num_replicas, weights) -> its policy
    "sync": _sync,
    "async": lambda config, *_: Async(),
    "ssp": lambda config, *_: BoundedStaleness(config.staleness),
    "local": _local,
}


def make_policy(config, num_workers, total_num_replicas=None, weights=None):
    """Return the policy object for ``config`` (a :class:`~mpitf.config.TrainingConfig`).

    Its ``mode`` picks the policy (:data:`POLICIES`); sync takes its
    ``replicas_to_aggregate`` (None: every worker) and ``deterministic``, ssp its
    ``staleness``, local its ``local_steps``. ``total_num_replicas`` is the number of
    replicas (None: all workers); ``weights`` (node-local aggregation, sync only) the
    replicas each worker's push sums.
    """
    make = POLICIES.get(config.mode)
    if make is None:
        raise ConfigurationError(f"unknown mode {config.mode!r}: use one of "
                                 f"{', '.join(map(repr, POLICIES))}")
    if weights is not None and make is not _sync:
        raise ConfigurationError(
            f"node-local aggregation needs sync mode and pushes for every replica: mode "
            f"{config.mode!r}, {sum(weights)} of {total_num_replicas} replicas")
    return make(config, num_workers, total_num_replicas, weights)
