"""The ps's handler of each request kind, mixed into :class:`~mpitf.ps.service.Service`.

``Service._serve`` reads a request's header, does what every request shares, and calls
the handler its kind names (``Service._handlers``): ``(state, worker, request, frame,
index, now)``, ``state`` being the service's :class:`~mpitf.ps.state.ServiceState`,
returning whether the pool frame is free again. A push goes to the consistency policy,
which first admits it (or drops a stale one: then nothing changes, not even the
learning rate it carries), then applies and answers it, or holds it for its step. Pull,
init, done, paused, save and counters are not steps (start-up, evaluation, a
checkpoint), so the worker gets the whole deadline until its next push.
"""

import numpy as np

from ..errors import PeerError
from ..wire import header as H
from ..wire import protocol as P


class Handlers:
    """One method per request kind (see the module docstring)."""

    def _on_push(self, state, worker, request, frame, index, now):
        bucket = request.bucket_index
        if request.bucket_count != self.pipeline.count:
            raise PeerError(
                f"a push in {request.bucket_count} buckets, but this ps cuts its shard "
                f"in {self.pipeline.count}: every task needs the same --bucket-bytes",
                **self.describe_worker(worker, "push"))
        if bucket == 0:
            self.stepped(worker, now)
        frame.received(request.count)
        state.counters["bytes_in"] += H.HEADER_BYTES + request.count * frame.itemsize
        policy = self.policy
        if not policy.admit(self, worker, request.step, bucket):
            return True  # dropped and answered: a stale push changes nothing, its rate neither
        self.take_learning_rate(request)
        return policy.on_push(self, worker, frame, index, bucket)

    def _on_rates(self, state, worker, request, frame, index, now):
        # Before a push, within its step: each group's learning rate, then (mpitf.torch's
        # clip_grad_norm_ in sync mode) the norm to clip the step's mean to, 0 for none.
        rates = frame.bytes[H.HEADER_BYTES:H.HEADER_BYTES + 8 * request.count].view(np.float64)
        groups = self.shard.rules.group_count
        if groups:
            self.shard.set_learning_rates(rates[:groups])
        if request.count > groups:
            self.set_clip_norm(float(rates[groups]) or None)
        return True

    def _on_sparse(self, state, worker, request, frame, index, now):
        return self.sparse.handle(worker, request.kind, index)  # within a step: not a pause

    def _on_skip(self, state, worker, request, frame, index, now):
        # The worker found NaN/Inf in its gradient and was told to skip it: count it and
        # answer with the current parameters (it retries with its next batch).
        state.counters["nonfinite_skipped"] += 1
        self.reply(worker)
        return True

    # Pull, init, done, pause, save, counters are not steps (start-up, evaluation, a
    # checkpoint): the worker gets the whole deadline until its next push.

    def _on_pull(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        if not state.initialized:
            state.pending_pulls.append((worker, request.kind))
        else:
            self._answer_pull(worker, request.kind)
        return True

    def _on_init(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        frame.received()
        self._finish_replies()
        self.shard.initialize(frame.payload[:self.shard.size])  # a frame may be larger
        state.initialized = True
        self.pipeline.at_step(state.global_step)
        self.write_header()
        for w, k in state.pending_pulls:
            self._answer_pull(w, k)
        state.pending_pulls.clear()
        return True

    def _on_done(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        state.done.add(worker)
        state.requeue = state.requeue or bool(request.flags & P.FLAG_REQUEUE)
        self.policy.on_worker_gone(self, worker)
        self._check_quiescent(state)
        return True

    def _on_paused(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        state.paused.add(worker)
        self.policy.on_worker_gone(self, worker)
        self._check_quiescent(state)
        return True

    def _on_save(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        self._finish_replies()
        self.delta_cut = bool(request.flags & P.FLAG_DELTA)  # ps/cuts.py writes it
        state.pausing = True
        self.write_header()
        self._check_quiescent(state)
        return True

    def _on_counters(self, state, worker, request, frame, index, now):
        state.last_push[worker] = None
        tables = self.tables.stats() if self.tables else {}
        self.comm.send(dict(state.counters, ps_task=self.ps_task, tables=tables,
                            workers_lost=len(state.lost)),
                       dest=self.worker_ranks[worker], tag=P.TAG_CONTROL)
        return True

    def _answer_pull(self, worker, kind):
        average = kind == P.PULL_AVERAGE and self.shard.average_frame is not None
        self.reply(worker, self.shard.average_frame if average else None)
