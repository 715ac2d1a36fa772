"""``TrainingSession``: the ``MonitoredTrainingSession`` of mpitf, run on every replica.

It configures the ps (chief), restores or initialises, runs steps (gradients into the
client's views, push, pull), and calls hooks: stop at a step, metrics (logs, metrics.jsonl,
TensorBoard), checkpoints every N steps or T seconds, at the end and on SIGTERM/SIGUSR1.
The replicas are the chief task (if any) and the worker tasks (``server.replica_index``).
"""

import functools
import inspect
import logging
import time

import numpy as np

from ..ckpt import cut
from ..ckpt.deltas import next_delta
from ..ckpt.tables import table_dicts
from ..config import JobFacts, TrainingConfig
from ..errors import ConfigurationError, NonFiniteGradientError
from ..models.clipping import clip_by_global_norm
from ..placement import replica_device_setter
from ..runtime.backend import get_backend
from ..runtime.exits import EXIT_REQUEUE, CheckpointSignals
from ..runtime.stall import StepClock
from ..runtime.timeline import Timeline
from ..wire import protocol as P
from .buckets import buckets_for_links
from .buffers import model_buffers
from .client import Client
from .embedding import Embeddings
from .healing import Healing, succeed_chief
from .hooks import CheckpointSaverHook, LoggingHook, StopAtStepHook
from .local import LocalSteps
from .node import NodeGroup
from .profile import ProfileHook

_log = logging.getLogger("mpitf")


class TrainingSession:
    """Train ``model`` on this replica against the ps tasks of ``server``'s cluster.

    Args:
        server: this rank's :class:`~mpitf.runtime.server.Server` (a chief or worker task).
        model: an object with ``variables()``, ``init(rng)`` and
            ``loss_and_grads(params, batch, grads)`` (see :mod:`mpitf.models`); with
            ``buffers()``, its untrained state is the chief's (:mod:`.buffers`).
        optimizer: an :class:`~mpitf.ps.optimizers.Optimizer`; it runs on the ps.
        mode: "sync", "async", "ssp" (bounded staleness) or "local" (local SGD); default:
            the config's.
        dataset: a :class:`~mpitf.data.sharded.ShardedDataset`; its position is checkpointed.
        hooks: more :class:`Hook` objects.
        log_stream: where the chief's progress lines go (a file; default stdout).
        partitioner: how large variables are split over ps tasks (see :mod:`mpitf.placement`).
        config: a :class:`~mpitf.config.TrainingConfig`; ``options`` (its field names, e.g.
            last_step, checkpoint_dir) build one or change the given one. A misspelt option
            is a TypeError that names it; a bad value a ConfigurationError.
    """

    def __init__(self, server, model, optimizer, mode=None, dataset=None, *, hooks=(),
                 partitioner=None, config=None, log_stream=None, **options):
        if mode is not None:
            options["mode"] = mode
        config = TrainingConfig(**options) if config is None else config.replace(**options)
        if server.replica_index is None:
            raise ConfigurationError(
                f"TrainingSession runs on the chief and worker tasks, not on "
                f"/job:{server.job_name}/task:{server.task_index}: ps tasks join(), an "
                "evaluator runs mpitf.worker.evaluator.Evaluator, other jobs do their own work"
                if server.num_replicas else
                "TrainingSession needs a chief or worker task, but the cluster has none: add "
                "a 'worker' (or 'chief') job to the spec")
        self.config = config = buckets_for_links(config, server)
        self.server = server
        self.model = model
        self.dataset = dataset
        self.log_stream = log_stream
        self.mode = config.mode
        self.consistency = config.consistency  # what the mode decides here (mpitf.modes)
        self.checkpoint_dir = config.checkpoint_dir
        self.clients = config.clients  # in-graph: the replicas that talk to the ps
        workers = server.replica_ranks
        self.client_ranks = [workers[i] for i in self.clients or range(len(workers))]
        self.num_workers = len(self.client_ranks)
        self.batch_size = config.batch_size or getattr(dataset, "batch_size", 1)
        self.examples_per_global_step = self.consistency.examples_per_step(
            self.batch_size, self.num_workers, config.replicas_to_aggregate)
        self.timeline = Timeline(server.rank, server.device, bool(config.timeline))
        self.signals = CheckpointSignals().install()
        self._stop = False
        self.requeue = False
        self.steps_run = 0
        self.nonfinite_skipped = 0  # gradients this worker dropped for NaN/Inf, in all
        self.skips_in_a_row = 0
        self.loss = None  # no step run yet (e.g. resumed at the last step)
        self.committed = []  # chief: the steps of the checkpoints committed by this session
        self.delta = None  # chief: the manifest's entry of the delta cut asked for, if one
        placement = replica_device_setter(server.cluster, ps_strategy=config.ps_strategy,
                                          partitioner=partitioner)
        self.placement = placement.place(model.variables())
        tables = model.tables() if hasattr(model, "tables") else ()
        here = (get_backend().name,)  # the options against what this worker knows of the job
        config.check_job(JobFacts(len(server.ranks_of("ps")), server.num_replicas, server.ulfm,
                                  bool(tables), here, here))
        self.node = node = NodeGroup.for_session(server, config)  # or None
        self.client = Client.from_config(server, self.placement, config, node,
                                         timeline=self.timeline)
        # who a ps's worker index w is (its checkpoint release goes there), who releases us
        self.push_ranks = [workers[n[0]] for n in node.nodes] if node else self.client_ranks
        self.releaser = node.leader_rank if node and not node.leader else \
            self.client_ranks[server.chief_index]  # a replacement (--heal): maybe not 0
        self.stall = StepClock(server.deadline, adaptive=not server.fixed_deadline)
        # finish_push's: computed once per step, whether the wait polls it or not
        self._nonfinite_check = functools.cache(self.client.nonfinite_gradient)
        # With buckets, a model that reports finished layers (``final``) pushes them during
        # backward; a NaN/Inf found after that still ends the job, but cannot be skipped.
        self.layerwise = self.client.bucketed and not config.skip_nonfinite and not tables \
            and "final" in inspect.signature(model.loss_and_grads).parameters
        link = self.client.link
        # a front end that looks tables up itself (mpitf.torch) sizes them per step
        self.embeddings = Embeddings(link, tables, getattr(
            model, "table_batch_size", self.batch_size)) if tables else None
        self.buffers = model_buffers(model, server, self.clients)  # see worker/buffers.py
        self.hooks = []
        if config.last_step is not None:
            self.hooks.append(StopAtStepHook(config.last_step))
        self.saver = CheckpointSaverHook.from_config(config) if server.is_chief else None
        if server.is_chief:
            self.hooks += [hook for hook in (LoggingHook.from_config(config, log_stream),
                                             ProfileHook.from_config(config), self.saver) if hook]
        self.hooks.extend(hooks)
        self.healing = Healing(self) if config.heal else None  # --heal: see .healing
        self._start(optimizer)

    # -- start -----------------------------------------------------------------------------

    def _start(self, optimizer):
        optimizer = optimizer.resolve(names := [n for n, _, _ in self.placement.variables])
        replacement = self.server.replacement  # spawned for a lost worker: no restore
        restore = None if replacement else cut.agree_on_restore(
            self.server.replica_comm, self.checkpoint_dir if self.server.is_chief else None,
            self.clients, log=lambda m: _log.warning("%s", m))
        if restore is not None and self.server.is_chief:  # slots that fit, or a reset
            cut.check_optimizer_state(restore, optimizer, names,
                                      self.config.reset_optimizer_state, _log.warning)
        values = None
        sparse = self.embeddings.assignment if self.embeddings else None
        if restore is None:
            rng = np.random.default_rng(self.config.seed)
            values = self.model.init(rng)
            if sparse and hasattr(self.model, "initial_table_rows") and self.server.is_chief:
                sparse = self.embeddings.assignments(self.model.initial_table_rows())
        with self.timeline.span("pull"):
            self.last_reply = self.client.start(
                optimizer.config(), values, restore,
                total_num_replicas=self.num_workers, sparse=sparse)
        self.global_step = self.last_reply.global_step
        self.optimizer = optimizer
        # local SGD: this worker runs the optimizer; the ps averages (worker/local.py)
        self.local = LocalSteps(self.client, optimizer) \
            if self.consistency.applies_locally else None
        # A worker waiting on a reply cannot tell a silent ps from a ps waiting (sync) on a
        # silent worker; the ps can. Its allowance (the clock's, scaled) runs out first, so
        # the message names the right rank.
        self.client.deadline = self.stall.allowance
        if self.buffers is not None and not replacement:
            self.buffers.start(restore)
        if restore is not None and self.dataset is not None:
            self.dataset.restore(cut.data_position(restore, self.server.replica_index))
        if replacement:
            self.healing.take_over(replacement["facts"])
        if restore is not None and self.server.is_chief:
            print(f"restored {restore} at step {self.global_step}", flush=True)
        for hook in self.hooks:
            hook.begin(self)
        self._started = time.monotonic()
        self._start_step = self.global_step

    @property
    def elapsed(self):
        """Return the seconds since training started (or resumed)."""
        return time.monotonic() - self._started

    @property
    def examples_seen(self):
        """Return the examples all workers fed into applied steps since the start."""
        return (self.global_step - self._start_step) * self.examples_per_global_step

    # -- the loop --------------------------------------------------------------------------

    @property
    def params(self):
        """Return the model's parameters (views into the pulled buffer)."""
        return self.client.params

    @property
    def grads(self):
        """Return the gradient views of the last step (what was pushed, or is about to be)."""
        return self.client.grads

    def request_stop(self):
        """Ask the loop to end after this step."""
        self._stop = True

    def should_stop(self):
        """True once a hook or a signal asked to stop (a signal cuts a checkpoint first)."""
        return self._stop or self.requeue or (
            self.signals.requested and not self.checkpoint_dir)

    def run(self, batch=None):
        """Run one step: gradients on ``batch`` (or the dataset's next), push, pull, hooks."""
        tl = self.timeline
        if self.layerwise:
            return self._run_layerwise(batch)
        with tl.span("compute", step=self.global_step):
            if batch is None:
                batch = self.dataset.next_batch()
            if self.embeddings is None or not hasattr(self.model, "ids"):
                # no tables, or a front end looked them up already (lookup(), in forward)
                self.loss = self.model.loss_and_grads(self.client.params, batch,
                                                      self.client.grads)
            else:  # pull the batch's rows, backward into them
                lookups = self.embeddings.lookup(self.model.ids(batch))
                self.loss = self.model.loss_and_grads(self.client.params, batch,
                                                      self.client.grads, lookups)
            if self.embeddings is not None:
                self.embeddings.reduce()  # sum per id
        state = self.dataset.state() if self.dataset is not None else {"epoch": 0, "cursor": 0}
        bad = self.client.nonfinite_gradient() or (
            self.embeddings.nonfinite() if self.embeddings else None)
        if bad is not None:
            return self._skip(bad)
        self.skips_in_a_row = 0
        if self.config.clip_norm is not None and not self.consistency.clips_on_ps:
            clip_by_global_norm(self.client.grads.values(), self.config.clip_norm)
        self._save_if_due()
        if self.local is not None:
            return self._local_step(state)
        with tl.span("push_pull", step=self.global_step):
            if self.embeddings is not None:
                self.embeddings.push()  # before the dense push: the ps applies both at once
            reply = self.client.push_pull((state["epoch"], state["cursor"])).wait()
        return self._finish_step(reply)

    def _local_step(self, state):
        """Local SGD: step this worker's parameters; push them when the mode says (every K)."""
        with self.timeline.span("apply", step=self.global_step):
            self.local.step(self.global_step)
        step = self.global_step + 1
        if not self.consistency.pushes_after(step, self.config.last_step):
            return self._finish_step(None)
        with self.timeline.span("push_pull", step=self.global_step):
            reply = self.local.push(step, (state["epoch"], state["cursor"])).wait()
        return self._finish_step(reply)

    def _finish_step(self, reply):
        """End a step with the ps's ``reply`` (None: a local step, answered by no one)."""
        if reply is None:
            self.global_step += 1
        else:
            self.last_reply = reply
            if reply.chief is not None and reply.chief != self.server.chief_index:
                succeed_chief(self, reply.chief)
            self.global_step = reply.global_step
        self.steps_run += 1
        if reply is not None and reply.heal:
            self.healing.pause_and_heal()
        if reply is not None and reply.pause:
            self._pause(relay=True)
        for hook in self.hooks:
            hook.after_run(self, self.loss)
        self.stall.tick(time.monotonic())
        self.client.deadline = self.stall.allowance
        return self.loss

    def _run_layerwise(self, batch):
        """One step whose buckets leave as backward finishes them (see ``layerwise``)."""
        with self.timeline.span("compute", step=self.global_step):
            if batch is None:
                batch = self.dataset.next_batch()
            handle = self.start_push()
            self.loss = self.model.loss_and_grads(self.client.params, batch,
                                                  self.client.grads, final=handle.final)
        return self.finish_push(handle)

    def lookup(self, ids, push=True):
        """Pull the rows of ``ids`` ({table: ids}, some tables) now; push them at :meth:`run`.

        For a front end whose model looks tables up in its forward pass (mpitf.torch): the
        step's :meth:`run` then pushes their gradients, before the dense push. ``push``
        False (an evaluation's lookup) leaves them out of it.
        """
        with self.timeline.span("pull", step=self.global_step):
            found = self.embeddings.lookup(ids, partial=True)
        if not push:
            for name in found:
                self.embeddings.forget(name)
        return found

    @property
    def table_lookups(self):
        """Return this step's table lookups that the step pushes ({table: lookup})."""
        return self.embeddings.lookups if self.embeddings is not None else {}

    def start_push(self):
        """Begin a bucketed step whose backward runs outside ``run`` (as in mpitf.torch)."""
        state = self.dataset.state() if self.dataset is not None else {"epoch": 0, "cursor": 0}
        self._save_if_due()
        return self.client.start_push((state["epoch"], state["cursor"]))

    def finish_push(self, handle):
        """End a :meth:`start_push` step: push the rest, wait for every reply, run hooks.

        Buckets have left, so a gradient holding NaN/Inf cannot be skipped, only named:
        the check runs while the replies travel, in time the worker would spend waiting.
        """
        check = self._nonfinite_check
        check.cache_clear()
        with self.timeline.span("push_pull", step=self.global_step):
            reply = handle.wait(between=check)
        bad = check()
        if bad is not None:
            return self._skip(bad)  # raises (no skip_nonfinite with buckets from backward)
        return self._finish_step(reply)

    def _skip(self, variable):
        """Drop a gradient holding NaN/Inf in ``variable`` (with skip_nonfinite), or raise.

        A checkpoint cut still happens while skipping (a signal, or one due), so a job whose
        parameters went Inf still checkpoints and exits on SIGTERM/SIGUSR1; after
        ``max_nonfinite_skips`` in a row the job ends, naming the variable.
        """
        if not self.config.skip_nonfinite:
            raise NonFiniteGradientError(
                f"the gradient of variable {variable!r} holds NaN or Inf at step "
                f"{self.global_step}; pass skip_nonfinite (--skip-nonfinite) to drop such "
                f"gradients instead")
        self.nonfinite_skipped += 1
        self.skips_in_a_row += 1
        limit = self.config.max_nonfinite_skips
        if self.skips_in_a_row >= limit:
            raise NonFiniteGradientError(
                f"the gradient of variable {variable!r} held NaN or Inf {limit} steps in a row "
                f"(at step {self.global_step}; {self.nonfinite_skipped} skipped in all): the "
                "parameters have likely diverged; lower the learning rate, or raise "
                "max_nonfinite_skips (--max-nonfinite-skips)")
        if self.local is not None:  # nothing was sent: the step is taken again, here
            for hook in self.hooks:
                hook.after_skip(self, variable)
            return self.loss
        self._save_if_due()
        if self.embeddings is not None:
            self.embeddings.lookups = {}  # the skipped step's rows are not pushed
        self.last_reply = self.client.skip_push()
        self.global_step = self.last_reply.global_step
        for hook in self.hooks:
            hook.after_skip(self, variable)
        if self.last_reply.pause:
            self._pause(relay=True)
        return self.loss

    def _save_if_due(self):
        """Chief, before a push or skip: a heal if due (--heal), else SAVE if asked for."""
        if self.healing is not None and self.server.is_chief and self.healing.due():
            return
        if not (self.server.is_chief and self.checkpoint_dir):
            return
        if not self.consistency.pushes_after(self.global_step + 1, self.config.last_step):
            return  # a cut lands with a push (local SGD's every K steps)
        if self.signals.requested or (self.saver is not None and self.saver.due(self)):
            self._send_save(self.global_step + 1)

    def _send_save(self, step):
        """Chief: ask every ps for a cut expected at ``step``; False if it is already saved."""
        self.delta = next_delta(self.checkpoint_dir, self.committed,
                                self.config.full_checkpoint_every)
        return cut.request(self.checkpoint_dir, step, self.client.send_control,
                           delta=self.delta is not None)

    def _pause(self, relay=False):
        """Stop for a checkpoint cut; the chief writes the manifest and releases the others.

        ``relay``: the pause came in a reply, so a node's members paused too (aggregation).
        """
        self.stall.pause()  # writing takes what the file system takes: the whole deadline
        self.client.deadline = self.stall.allowance
        self.client.paused()
        with self.timeline.span("checkpoint", step=self.global_step):
            if self.server.is_chief:
                message = self._collect_checkpoint()
            else:
                message = cut.wait_for_release(self.server.comm, self.releaser,
                                               self.server.deadline, self.server.peer,
                                               self.global_step)
                if self.buffers is not None:
                    self.buffers.load(message["buffers"])
            if relay and self.node is not None and self.node.leader:
                self.node.relay(message)
        if message.get("stop"):
            self.requeue = True

    def _collect_checkpoint(self):
        # the ranks that serve each shard now: a lost ps's buddy reports its shard too
        reports = cut.collect(self.server.comm, self.client.link.ranks, self.server.deadline,
                              self.server.host_of)
        layout = dict(num_ps=len(reports), num_workers=self.num_workers, mode=self.mode,
                      cluster=repr(self.server.cluster), optimizer=self.optimizer.config())
        if self.embeddings is not None:
            layout["tables"] = table_dicts(self.embeddings.specs)
        buffers = self.buffers.copy() if self.buffers is not None else None
        step = cut.commit(self.checkpoint_dir, reports, self.placement.variables, layout,
                          max_to_keep=self.config.max_to_keep, buffers=buffers,
                          delta=self.delta)
        self.committed.append(step)
        if self.saver is not None:
            self.saver.saved(self)
        stop = self.signals.requested
        if stop:
            print(f"{self.signals.received}: checkpointed at step {step}; exiting with code "
                  f"{EXIT_REQUEUE} so the job is requeued", flush=True)
        message = {"stop": stop, "step": step, "buffers": buffers}
        cut.release(self.server.comm, reports, self.push_ranks, self.server.rank, message)
        return message

    # -- the end ---------------------------------------------------------------------------

    def final_checkpoint(self):
        """Cut a checkpoint at the end of training (chief), if a directory is set."""
        if self.server.is_chief and self.checkpoint_dir and not self.requeue:
            if self._send_save(self.global_step):
                self._pause()

    def evaluate(self, x, y, average=False):
        """Pull the newest parameters (or their average) and return (loss, accuracy)."""
        from ..models import evaluate

        self.last_reply = self.client.pull(average=average)
        return evaluate(self.model, self.client.params, x, y)

    def close(self):
        """Checkpoint at the end (chief), tell every ps this worker is done, run end hooks."""
        try:
            if not self.requeue and not self._stop and self.signals.requested \
                    and self.checkpoint_dir:
                self.requeue = True  # the loop ended early on the signal: cut and requeue
                if self.server.is_chief:
                    if self._send_save(self.global_step):
                        self._pause()
                    else:
                        print(f"{self.signals.received}: step {self.global_step} is already "
                              f"checkpointed; exiting with code {EXIT_REQUEUE}", flush=True)
            else:
                self.final_checkpoint()
        finally:
            self.client.done(P.FLAG_REQUEUE if self.requeue else 0)
            if self.server.is_chief:
                self._end_evaluators()
            for hook in self.hooks:
                hook.end(self)
            path = self.config.timeline
            if path:  # collective with the ps tasks, which gather after serving
                self.timeline.gather_and_write(self.server.comm, path)
        if self.buffers is not None:
            self.buffers.share()

    def _end_evaluators(self):
        """Chief: tell every evaluator task that training ended, and its last checkpoint."""
        message = {"step": self.committed[-1] if self.committed else None,
                   "committed": list(self.committed), "requeue": self.requeue}
        for rank in self.server.ranks_of("evaluator"):
            self.server.comm.send(message, dest=rank, tag=P.TAG_TRAINING_END)

    @property
    def exit_code(self):
        """Return the code this rank should exit with (the requeue code after a signal)."""
        if self.requeue:
            return EXIT_REQUEUE
        if self.signals.requested and not self._stop:
            import signal

            return 128 + int(getattr(signal, self.signals.received))  # nothing was saved
        return 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False

