"""``DistributedOptimizer``: train a torch model on mpitf's parameter servers.

The wrapped torch optimizer's update runs on the ps (translated by :mod:`.translate`);
the model's parameters and gradients are zero-copy torch views of the flat buffers of
the :class:`~mpitf.worker.client.Client` inside a :class:`~mpitf.worker.session.TrainingSession`,
so backward writes the gradient where the push sends it from and the pull lands where
the model reads its parameters. Every step checks that the views are still bound.

Where the model is cut into buckets (the session's ``bucket_bytes``: by default 2 MiB per
ps, so a model of at most that per ps goes as one frame) a post-accumulate-grad hook pushes
each bucket as soon as backward has finished all its parameters (the layout puts the last
layers' buckets first, the order backward produces them, as DDP guesses), and ``step()``
pushes the rest and waits. The first step pushes at ``step()`` and learns what the loop
does between backward and ``step()``: with one backward per step and the gradients and
learning rates left as backward and the loop's top set them, the hooks push from the
second step on; with gradient accumulation, or gradients changed after backward (a scaling
in place bumps the tensors' version counters), or a rate set there, every step pushes its
buckets at ``step()``, since a bucket must not leave before the gradient is final. In sync
mode torch's ``clip_grad_norm_`` leaves the gradients alone: the ps clips the workers'
mean, as DDP's clips the all-reduced gradient (:mod:`.clipping`, :mod:`mpitf.ps.clip`).
"""

import contextlib
import logging
import os

import torch

from ..errors import ConfigurationError
from ..runtime.cores import node_share, ranks_on_host, usable_cores
from ..worker.frontend import SessionFrontEnd, ends_the_job
from ..worker.session import TrainingSession
from .buffers import check_model
from .clipping import Clipping
from .model import TorchVariables, examples_in, sparse_message, table_modules, trainable
from .position import data_position
from .tables import Embedding
from .translate import check_table_rule, group_options, learning_rate, rate_groups, translate
from .wrapping import Hook, claim, refuse_wrapped, release

__all__ = ["DistributedOptimizer", "share_threads"]

_log = logging.getLogger("mpitf")
_BATCH = ()  # the session's batch: backward already ran, so there is nothing to feed


# what a refusal of a change after backward adds: why, and the two ways out
_EARLY = (" (the first step showed no such change, so buckets leave as backward finishes "
          "them): make the change before backward(), or from the first step on, or pass "
          "bucket_bytes=0 (one frame per ps, pushed at step())")


def _as_left(grad):
    """Return what tells a gradient tensor changed: its memory and its version counter."""
    if grad is None:
        return None
    return grad.data_ptr() if grad.layout == torch.strided else id(grad), grad._version


def share_threads(server):
    """Give torch this rank's share of its node's cores unless OMP/MKL_NUM_THREADS is set.

    Several ranks on a node each running torch's default (every core) fight for the
    cores; returns the thread count set, or None when the environment chose.
    """
    if "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
        return None
    host, local = server.hosts[server.rank], ranks_on_host(server.hosts, server.rank)
    threads, cores = node_share(local), usable_cores()
    torch.set_num_threads(threads)
    print(f"mpitf.torch: rank {server.rank} uses {threads} torch thread(s) ({cores} cores, "
          f"{local} ranks on {host}); set OMP_NUM_THREADS to choose", flush=True)
    return threads


class DistributedOptimizer(SessionFrontEnd):
    """Run a torch.optim optimizer's update on the ps for ``model``'s parameters.

    Args:
        optimizer: a torch.optim SGD, Adam, AdamW, Adagrad or RMSprop over the model's
            trainable parameters; anything the ps cannot run exactly is refused here (on
            a rank of a multi-rank job: one line, and every rank exits 2). Its param
            groups keep their own options on the ps, and each group's learning rate (a
            scheduler's) travels with every push.
        model: the ``torch.nn.Module`` (on the CPU). The chief's parameters at this call
            are every worker's starting values, unless a checkpoint is restored. Its
            buffers (BatchNorm statistics, anything in ``state_dict()`` that is not
            trained) are the chief's: checkpointed by the chief and given to every worker
            at the start, at each checkpoint and at close (see :mod:`mpitf.worker.buffers`).
        server: this rank's :class:`~mpitf.runtime.server.Server` (a chief or worker task).
        session_options: :class:`~mpitf.worker.session.TrainingSession`'s (mode,
            checkpoint_dir, save_checkpoint_steps, last_step, bucket_bytes, hooks, ...).
            Gradients leave in buckets during backward where the first step showed that
            the loop changes neither ``.grad`` nor the learning rate between
            ``backward()`` and ``step()`` (see the module's docstring); ``bucket_bytes=0``
            pushes one frame per ps at ``step()``.
            ``reset_optimizer_state=True`` resumes a checkpoint of another optimizer
            (other slots), which is refused otherwise, with fresh optimizer state.
            ``dataset``: a :class:`~mpitf.data.sharded.ShardedDataset`, or the loop's own
            sampler with ``state_dict()``/``load_state_dict()`` over ``{"epoch",
            "cursor"}``: its position is checkpointed and restored. ``batch_size``: the
            examples one worker's step holds, for the log's examples/sec (default: the
            dataset's, else the first dimension of the model's first input, counted over
            the forwards of each step). ``log_every=0`` silences the chief's progress
            lines; ``log_stream`` (a file) takes them instead of stdout.
        lr_scheduler: a torch LR scheduler of ``optimizer``, stepped once per step by the
            loop: on restore it is advanced to the restored ``global_step``.
        rowwise_tables: with a torch.optim.Adagrad, train the tables by row-wise Adagrad
            (TorchRec's default fused optimizer: one accumulator per row, the mean of the
            squared gradient over the row; ``torchrec.optim.RowWiseAdagrad``), the dense
            parameters by torch's Adagrad (:mod:`mpitf.ps.rowwise`).
    """

    ONCE_PER_STEP = ("call each mpitf.torch table once per step (give a table that several "
                     "fields share all their ids in one call), and evaluate under "
                     "torch.no_grad() after step(), not between forward and step()")

    @ends_the_job
    def __init__(self, optimizer, model, server, lr_scheduler=None, rowwise_tables=False,
                 **session_options):
        self._server = server
        self.optimizer, self.model = optimizer, model
        refuse_wrapped(model, optimizer)
        if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise ConfigurationError("lr_scheduler schedules another optimizer than the one "
                                     "DistributedOptimizer wraps: give the wrapped one's")
        session_options["dataset"] = data_position(session_options.get("dataset"))
        tables = table_modules(model)
        self._named = trainable(model, optimizer, tables)
        names = {id(p): name for name, p in self._named}
        self.ps_optimizer = translate(optimizer, names, rowwise_tables)
        if tables:
            check_table_rule(optimizer, list(tables), rowwise_tables)
        check_model(model, self._named + [(n, m.weight) for n, m in tables.items()])
        self._options = [group_options(g) for g in optimizer.param_groups]
        # several param groups: each one's rate travels (a RATES request), else one rate
        self._rate_groups = rate_groups(optimizer, names) \
            if len(optimizer.param_groups) > 1 else None
        share_threads(server)
        self._variables = TorchVariables(self._named, model, tables)
        self.session = TrainingSession(server, self._variables, self.ps_optimizer,
                                       **session_options)
        self.client = self.session.client
        self._watch(model, optimizer)
        if lr_scheduler is not None:
            self._advance(lr_scheduler)
        self._reached = [False] * len(self._named)
        self._need_all = True  # as after zero_grad(set_to_none=True): torch's grads are None
        self._fired = [0] * len(self._named)  # hook calls since the last step()
        # each gradient as backward left it: (data pointer, version); a change before
        # step() (clip_grad_norm_, a scaling) means the hooks must not push it early
        self._left = [None] * len(self._named)
        self._rates_at_backward = None  # the learning rates backward's hooks saw (1st step)
        self._handle = None  # the bucketed push that backward's hooks started
        # the hooks push once the first step has shown one backward per step (see step())
        self._hooks_push = False
        # tables: their gradients are final after backward, and leave before the dense push
        self._learning = self.client.bucketed and not self.session.config.skip_nonfinite \
            and not tables
        self._bind()
        for name, module in tables.items():
            module.bind(name, self)
        self._clipping = Clipping.for_session(self.session, self._named,
                                              [v[3] for v in self._views], tables)
        claim(model, optimizer)  # a wrapping refused above leaves them free

    def table_forward(self, module, *args):
        """Run a table module's bound forward; bad ids end every rank, naming the table."""
        return self.tables_forward([(module, args)])[0]

    @ends_the_job
    def tables_forward(self, calls):
        """Run tables' bound forwards (``[(module, args)]``, or a generator), one pull per ps.

        Every call's ids are checked first (a refusal, the generator's too, ends all ranks),
        then all the tables' rows come in one sparse request per ps; returns the outputs.
        """
        calls = list(calls)
        for module, args in calls:
            module.check(*args)
        found = self.lookup_tables({m.table_name: args[0].numpy() for m, args in calls},
                                   train=torch.is_grad_enabled())
        return [module.run(lambda m, _: found[m.table_name], *args) for module, args in calls]

    @ends_the_job
    def table_rows(self, name, ids):
        """Return rows ``ids`` of table ``name`` as the ps holds them now (a new tensor)."""
        module = self._variables.table_modules.get(name)
        if module is None:
            raise ConfigurationError(f"the model has no mpitf.torch table {name!r}: its "
                                     f"tables are {sorted(self._variables.table_modules)}")
        ids = torch.as_tensor(ids)
        with torch.no_grad():  # an Embedding's lookup, on any table module
            Embedding.check(module, ids)
            return Embedding.run(module, self._pull, ids).clone()

    def _pull(self, module, ids):
        """Pull the rows of table ``module``'s ``ids`` now; step() pushes their gradients.

        Under ``torch.no_grad()`` (evaluation) the rows are not pushed.
        """
        return self.lookup_rows(module.table_name, ids, train=torch.is_grad_enabled())

    def _bind(self):
        """Point every parameter's ``.data`` and ``.grad`` at the client's buffers."""
        self._views = []
        for i, (name, p) in enumerate(self._named):
            data = torch.from_numpy(self.client.params[name])
            grad = torch.from_numpy(self.client.grads[name])
            p.data = data
            p.grad = grad
            p.register_post_accumulate_grad_hook(Hook(lambda _, i=i: self._on_grad(i)))
            self._views.append((name, p, data, grad))

    @ends_the_job
    def _on_grad(self, i):
        """Backward finished parameter ``i``'s gradient: push its bucket if it is complete."""
        self._reached[i] = True
        self._fired[i] += 1
        self._adopt(i)
        if not self._hooks_push:
            if self._learning:
                if self._rates_at_backward is None:
                    self._rates_at_backward = self._learning_rate()
                self._left[i] = _as_left(self._views[i][1].grad)
            return
        name = self._views[i][0]
        if self._fired[i] > 1:
            raise ConfigurationError(
                f"backward reached {name!r} twice before step() at step {self.global_step}, "
                "but its bucket had already been pushed: with bucket_bytes the first step "
                "shows whether gradients accumulate over several backward calls; accumulate "
                "from the first step on, run the first backward calls inside dist.no_sync() "
                "(DDP's), or set bucket_bytes=0")
        if self._handle is None:
            self._check_loaded()
            self._set_rates(self._learning_rate())
            self._handle = self.session.start_push()
        self._check_param(i)
        self._left[i] = _as_left(self._views[i][3])
        self._handle.final((name,))

    def _watch(self, model, optimizer):
        """Hook the model and optimizer: a load, torch's own step(), the examples a step takes."""
        self._loaded = False
        model.register_load_state_dict_post_hook(Hook(self._on_load))
        # torch's own step() would train this worker's copy and push nothing
        self._step_hook = optimizer.register_step_pre_hook(Hook(self._refuse_torch_step))
        # examples/sec: count the inputs' first dimension unless the batch size is known
        session = self.session
        self._examples = 0 if session.config.batch_size is None and not hasattr(
            session.dataset, "batch_size") else None
        self._per_example = session.examples_per_global_step // session.batch_size
        if self._examples is not None:
            model.register_forward_pre_hook(Hook(self._count_examples))

    def _on_load(self, module, incompatible):
        self._loaded = True

    def _advance(self, scheduler):
        """Step ``scheduler`` to the restored global step (a fresh start leaves it as it is)."""
        self.optimizer._opt_called = True  # torch warns of a schedule stepped before step()
        for _ in range(self.global_step - scheduler.last_epoch):
            scheduler.step()

    def _count_examples(self, module, args):
        """Forward pre-hook: add the first input's examples to this step's (``examples_in``)."""
        if torch.is_grad_enabled() and args:
            self._examples += examples_in(args[0])

    @ends_the_job
    def _refuse_torch_step(self, optimizer, args, kwargs):
        raise ConfigurationError(
            "optimizer.step() on the optimizer that DistributedOptimizer wraps: it would "
            "train this worker's copy only and push nothing; call dist.step(loss) (the "
            "update runs on the ps)")

    @ends_the_job
    def _refuse_copy(self):
        raise ConfigurationError(
            "DistributedOptimizer cannot be copied or pickled (it holds this rank's MPI "
            "session), and a model with mpitf.torch tables holds it: save "
            "model.state_dict() instead (its tables' rows are on the ps: use checkpoint_dir "
            "and `mpitf ckpt export`, or dist.table_rows())")

    def __reduce_ex__(self, protocol):
        self._refuse_copy()

    def __deepcopy__(self, memo):
        self._refuse_copy()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over the backward calls inside, as DDP's ``no_sync()``.

        mpitf sends nothing before :meth:`step`: the backward calls between two steps
        add into the gradient, and ``step()`` pushes the sum. Inside ``no_sync()`` no
        bucket leaves during backward, from now on (every step pushes at ``step()``).
        """
        if self._handle is not None:
            raise ConfigurationError(
                f"no_sync() after a backward() of step {self.global_step} had pushed "
                "buckets: enter no_sync() for the first micro-batches of a step, then run "
                "the last backward() outside it, as with DDP")
        if self._hooks_push or self._learning:
            self._hooks_push = self._learning = False
            if self.session.server.is_chief:
                print("mpitf.torch: no_sync(): gradients accumulate; the buckets leave at "
                      "step(), not during backward", flush=True)
        yield

    @ends_the_job
    def zero_grad(self, set_to_none=True):
        """Set the gradients to None (torch's default), or zero their views in place.

        With ``set_to_none`` backward makes each gradient afresh and a hook copies it into
        the push buffer (:meth:`_adopt`); a parameter that the next backward does not reach
        is an error at step(), as its None gradient would be in torch. Without, the views
        stay bound and backward adds into them.
        """
        if self._handle is not None:
            raise ConfigurationError(
                "zero_grad() between backward() and step(): with bucket_bytes backward has "
                "already pushed part of the gradient; call zero_grad() before backward()")
        if set_to_none:
            for _, p, _, _ in self._views:
                p.grad = None
            self._reached = [False] * len(self._views)
        else:
            for _, p, _, grad in self._views:
                grad.zero_()
                p.grad = grad
        self._need_all = bool(set_to_none)

    def _adopt(self, i):
        """Copy a gradient backward made afresh (after a None) into the buffer, and bind it.

        Backward writes a fresh gradient where ``.grad`` is None and adds into one that is
        not: copying the fresh one here, while it is in cache, costs less than zeroing the
        buffer before backward and adding into it.
        """
        _, p, _, grad = self._views[i]
        g = p.grad
        if g is not None and g.layout == torch.strided and g.data_ptr() != grad.data_ptr() \
                and g.shape == grad.shape and g.dtype == grad.dtype:
            grad.copy_(g)
            p.grad = grad

    def _check(self):
        """Refuse a broken parameter alias; re-bind a gradient torch replaced (one copy)."""
        self._check_loaded()
        for i in range(len(self._views)):
            self._check_param(i)

    def _check_loaded(self):
        if self._loaded:
            raise ConfigurationError(
                "model.load_state_dict() was called after DistributedOptimizer wrapped the "
                "model: it changes this worker's copy only (the ps holds the parameters); load "
                "before wrapping, or resume from a checkpoint_dir")

    def _check_param(self, i):
        """Check parameter ``i``'s views (see :meth:`_check`)."""
        step = self.global_step
        name, p, data, grad = self._views[i]
        if p.data_ptr() != data.data_ptr() or p.dtype != data.dtype or p.shape != data.shape:
            raise ConfigurationError(
                f"parameter {name!r} no longer lies in mpitf's buffer at step {step} (its "
                f"data is now {p.dtype} {tuple(p.shape)} on {p.device}): model.to(), "
                "load_state_dict(assign=True) or a new .data after wrapping; do those "
                "before DistributedOptimizer")
        g = p.grad
        if g is not None and g.layout != torch.strided:
            raise ConfigurationError(sparse_message(name))
        if g is None or (self._need_all and not self._reached[i]):
            raise ConfigurationError(
                f"parameter {name!r} requires grad but backward left its gradient None "
                f"at step {step}: compute the loss from it, or set its requires_grad to "
                "False before wrapping")
        if g.data_ptr() != grad.data_ptr():
            if g.shape != grad.shape or g.dtype != grad.dtype:
                raise ConfigurationError(
                    f"the gradient of {name!r} is {g.dtype} {tuple(g.shape)}, its "
                    f"parameter {grad.dtype} {tuple(grad.shape)}")
            self._adopt(i)  # backward's hook did not run for it: bind it now

    def _learning_rate(self):
        """Return the learning rate (one group) or each group's, refusing other changes."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._options):
            raise ConfigurationError(
                f"the optimizer has {len(groups)} param groups, but {len(self._options)} when "
                "DistributedOptimizer wrapped it: add groups before wrapping")
        for k, group in enumerate(groups):
            if group_options(group) != self._options[k]:
                changed = sorted(o for o in set(self._options[k]) | set(group_options(group))
                                 if self._options[k].get(o) != group_options(group).get(o))
                raise ConfigurationError(
                    f"param group {k}'s {changed} changed after wrapping: the ps runs the "
                    "options it was given; only learning rates may change while training")
        if self._rate_groups is None:
            return learning_rate(groups[0])
        return tuple(learning_rate(groups[k]) for k in self._rate_groups)

    def _set_rates(self, rates):
        if self._rate_groups is None:
            self.client.learning_rate = rates
        else:
            self.client.rates.values = rates

    @ends_the_job
    def step(self, loss=None):
        """Push the gradients, apply the update on the ps, and pull: the model is updated.

        ``loss`` (a number or a scalar tensor) is only reported (logs, metrics).
        """
        lr = self._learning_rate()
        handle, self._handle = self._handle, None
        sent = self.client.learning_rate if self._rate_groups is None else \
            self.client.rates.values
        if handle is not None:
            if lr != sent:
                raise ConfigurationError(
                    f"the learning rate changed from {sent} to {lr} between backward() and "
                    f"step() at step {self.global_step}, but backward had already pushed "
                    f"gradients with the rate it found{_EARLY}")
            self._check_unchanged()
        changed = self._learning and self._changed_after_backward(lr)
        self._check()
        self._set_rates(lr)
        if self._clipping is not None:  # sync: the loop's clip_grad_norm_ goes to the ps
            self._clipping.ask(self.client.rates, handle is not None, self.global_step)
        self._variables.loss = float("nan") if loss is None else float(
            loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self.optimizer._opt_called = True  # torch's LR schedulers look for a step() call
        if self._examples:  # the examples this step's forwards took, as all workers' step
            self.session.batch_size = self._examples
            self.session.examples_per_global_step = self._examples * self._per_example
            self._examples = 0
        if handle is not None:
            self.session.loss = self._variables.loss
            self.session.finish_push(handle)
        else:
            self.session.run(_BATCH)
        if self._clipping is not None:
            self._clipping.finish(self.client.replies.clipped_norm)
        if self._learning:
            self._learn(changed)
        self._fired = [0] * len(self._views)
        self._left = [None] * len(self._views)
        return loss

    def _changed_after_backward(self, lr):
        """Return what the loop changed between backward and this first ``step()``, or ''."""
        if self._rates_at_backward is not None and lr != self._rates_at_backward:
            return "the learning rate is set"
        name = self._first_changed()
        return "" if name is None else \
            f"the gradients change (first {name!r}; clip_grad_norm_, a scaling)"

    def _check_unchanged(self):
        """Refuse a gradient changed after its bucket left during backward (see _learn)."""
        name = self._first_changed()
        if name is not None:
            raise ConfigurationError(
                f"the gradient of {name!r} changed between backward() and step() at step "
                f"{self.global_step}, but backward had already pushed it{_EARLY}")

    def _first_changed(self):
        """Return the first parameter whose gradient changed since backward left it, or None."""
        for (name, p, _, _), left in zip(self._views, self._left):
            if left is not None and _as_left(p.grad) != left:
                return name
        return None

    def _learn(self, changed):
        """After the first step: let the hooks push unless the loop showed it must not."""
        self._learning = False
        most = max(self._fired)
        buckets = sum(len(b) for b in self.client.buckets)
        self._hooks_push = most <= 1 and not changed
        if not self.session.server.is_chief:
            return
        if self._hooks_push:
            print(f"mpitf.torch: {buckets} buckets leave as backward produces them", flush=True)
        else:
            why = (f"backward ran {most} times before step() (gradient accumulation)"
                   if most > 1 else f"between backward() and step() {changed}")
            print(f"mpitf.torch: {why}: the {buckets} buckets leave at step(), not during "
                  "backward", flush=True)

    def close(self):
        """Checkpoint at the end (chief), tell every ps this worker is done; return exit_code."""
        self._hooks_push = False  # a backward after training (evaluation) pushes nothing
        self._step_hook.remove()
        if self._clipping is not None:
            self._clipping.close()
        release(self.model, self.optimizer)
        return super().close()
