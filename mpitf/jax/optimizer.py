"""``DistributedOptimizer``: train a pytree of jax arrays on mpitf's parameter servers.

The update runs on the ps (one of the ps optimizers, by name); this rank only computes
gradients. ``step(grads)`` copies each gradient leaf into the push buffer of the
:class:`~mpitf.worker.client.Client` inside a :class:`~mpitf.worker.session.TrainingSession`,
pushes and pulls, and returns the new parameters as new jax arrays: one copy each way (jax
arrays are immutable, so the pulled buffer cannot be handed out as they are). Embedding
tables on the ps (``tables=``, :mod:`.tables`) are looked up by id with :meth:`lookup`
and their row gradients pushed by ``step(grads, table_grads=...)``.
"""

import dataclasses
import inspect

import numpy as np

from ..config import TrainingConfig
from ..errors import ConfigurationError
from ..ps.optimizers import make_optimizer
from ..worker.frontend import SessionFrontEnd, check_sparse_rule, ends_the_job
from ..worker.session import TrainingSession
from . import threads
from .tables import TableSteps, as_tables
from .tree import TreeLayout, leaf_name, to_jax

__all__ = ["DistributedOptimizer"]

_BATCH = ()  # the session's batch: the gradients are already computed
# What TrainingSession takes: its own arguments and TrainingConfig's fields.
SESSION_OPTIONS = frozenset(
    [n for n in inspect.signature(TrainingSession).parameters if n not in ("server", "model",
                                                                          "optimizer",
                                                                          "options")]
    + [f.name for f in dataclasses.fields(TrainingConfig) if f.init])


class _JaxVariables:
    """The pytree as the session sees it: names, shapes, dtype, and the chief's values.

    Its tables (``steps``, a :class:`.tables.TableSteps`) are looked up by
    :meth:`DistributedOptimizer.lookup`, one call per table and step: one step's buffers
    hold ``max_ids`` ids of each (``table_batch_size`` 1).
    """

    table_batch_size = 1

    def __init__(self, layout, leaves, steps):
        self.layout, self.steps = layout, steps
        self.values = {n: np.array(leaf, dtype=np.float32)
                       for n, leaf in zip(layout.names, leaves)}
        self.loss = None

    def tables(self):
        """Return the tables' descriptions (the ps holds their rows)."""
        return self.steps.specs()

    def initial_table_rows(self):
        """Return the chief's rows of the tables given ``initial`` (the others are drawn)."""
        return self.steps.initial()

    def variables(self):
        return [(n, s, np.float32) for n, s in zip(self.layout.names, self.layout.shapes)]

    def init(self, rng):
        """Return the parameters as given (the chief's become everyone's)."""
        return self.values

    def loss_and_grads(self, params, batch, grads):
        """Return the loss step() was given; step() already copied the gradients."""
        return self.loss


def _mask_group(mask, params, names):
    """Return the group that ``mask`` (optax's: True where weight decay applies) implies.

    ``mask`` is a pytree of bools shaped as ``params``, or a callable ``params -> mask``;
    the leaves it marks False get ``weight_decay`` 0 (None: every leaf is decayed).
    """
    import jax

    if callable(mask):
        mask = mask(params)
    flat, _ = jax.tree_util.tree_flatten_with_path(mask)
    marked = {leaf_name(path): bool(value) for path, value in flat}
    if set(marked) != set(names):
        odd = sorted(set(marked) ^ set(names))[0]
        raise ConfigurationError(
            f"the weight-decay mask and the parameters differ at leaf {odd!r}: give a "
            "pytree of bools shaped as the parameters (or a callable params -> mask)")
    off = [n for n in names if not marked[n]]
    return {"variables": off, "weight_decay": 0.0} if off else None


def _split(options):
    """Return (optimizer options, session options): TrainingSession's names go to it."""
    ps = {k: v for k, v in options.items() if k not in SESSION_OPTIONS}
    session = {k: v for k, v in options.items() if k in SESSION_OPTIONS}
    return ps, session


class DistributedOptimizer(SessionFrontEnd):
    """Train ``params`` (a pytree of float32 jax arrays) with ``optimizer`` run on the ps.

    Args:
        params: the parameters; their pytree structure, shapes and leaf names (key paths
            joined by ``/``) are fixed here. The chief's are every worker's starting values,
            unless a checkpoint is restored: read them back from ``opt.params``.
        server: this rank's :class:`~mpitf.runtime.server.Server` (a chief or worker task).
        optimizer: a ps optimizer by name (:func:`~mpitf.ps.optimizers.make_optimizer`:
            "sgd", "momentum", "adam", "adamw", "rmsprop", "adagrad", "ftrl", torch's
            "torch_sgd", "torch_adam", "torch_adagrad").
        learning_rate: a float or a ps schedule config (``{"schedule": "cosine_decay",
            ...}``); the ps runs it by the global step.
        mask: as optax.adamw's: a pytree of bools shaped as ``params`` (or a callable
            ``params -> mask``), True where weight decay applies; the leaves it marks False
            get ``weight_decay`` 0 (biases, norms).
        groups: options per subtree: ``[{"variables": [leaf names or fnmatch patterns
            such as "layers/1/*"], "learning_rate": ..., option: value}]`` (see
            :mod:`mpitf.ps.groups`); a leaf is in one group at most (the mask's included).
        options: the optimizer's hyper-parameters (``weight_decay``, ``beta1``, ...) and
            :class:`~mpitf.worker.session.TrainingSession`'s options (mode, dataset,
            checkpoint_dir, save_checkpoint_steps, last_step, ...; the deadline is the
            Server's); a name neither takes is refused, naming both lists.
        tables: embedding tables on the ps (:class:`~mpitf.jax.Table` objects, or
            ``{name: (num_embeddings, dim)}``), looked up with :meth:`lookup`; their rows
            are updated sparsely, so the optimizer must be "sgd" or "adagrad" (or torch's
            without weight decay or momentum), with no groups or mask.
    """

    ONCE_PER_STEP = ("look each table up once per step (all its ids in one call), and "
                     "evaluate with train=False")

    @ends_the_job
    def __init__(self, params, server, optimizer="sgd", learning_rate=0.01, *, mask=None,
                 groups=None, tables=(), **options):
        self._server = server
        ps_options, session_options = _split(options)
        if "deadline" in ps_options:
            raise ConfigurationError(
                "deadline is the Server's, not a session option: Server(cluster, deadline=...)")
        self.layout = TreeLayout(params)
        groups = list(groups or ())
        if mask is not None:
            masked = _mask_group(mask, params, self.layout.names)
            groups += [masked] if masked else []
        if groups:
            ps_options["groups"] = groups
        try:
            self.ps_optimizer = make_optimizer(optimizer, learning_rate, **ps_options)
        except ConfigurationError as exc:
            if ps_options and "takes no option" in str(exc):
                raise ConfigurationError(
                    f"{exc}; session options: {sorted(SESSION_OPTIONS)}") from None
            raise
        steps = TableSteps(as_tables(tables))
        if steps.tables:
            if groups:
                raise ConfigurationError("groups and mask are not supported with tables: the "
                                         "tables take the optimizer's one set of options")
            check_sparse_rule(self.ps_optimizer, list(steps.tables))
        self._variables = _JaxVariables(self.layout, self.layout.leaves(params, "parameter"),
                                        steps)
        self._say_threads(server)
        self.session = TrainingSession(server, self._variables, self.ps_optimizer,
                                       **session_options)
        self.client = self.session.client
        self._views = [(self.client.grads[n], self.client.params[n]) for n in self.layout.names]
        self._variables.values = None  # sent (chief) or not needed: free the copy
        self.params = self._pulled()

    @staticmethod
    def _say_threads(server):
        if threads.chosen is not None:
            n, cores, ranks = threads.chosen
            print(f"mpitf.jax: rank {server.rank} uses {n} XLA CPU thread(s) ({cores} cores, "
                  f"{ranks} ranks on {server.host_of(server.rank)}); set NPROC to choose",
                  flush=True)
        elif threads.late:
            print(f"mpitf.jax: rank {server.rank}: jax computed before mpitf.jax was imported, "
                  "so XLA keeps its default threads (every core); import mpitf.jax before "
                  "the first jax operation, or set NPROC", flush=True)

    def _pulled(self):
        """Return the pulled parameters as a new pytree of jax arrays (one copy)."""
        return self.layout.unflatten([to_jax(p) for _, p in self._views])

    @ends_the_job
    def lookup(self, name, ids, train=True):
        """Pull the rows of table ``name``'s ``ids`` now: return ``(rows, inverse)``.

        ``rows`` (u x dim) are the rows of the unique ids, ``inverse`` (ids' shape) each
        id's index among them, both jax arrays: ``rows[inverse]`` gathers each id's row.
        Give the loss ``rows`` as an argument and pass ``jax.grad``'s gradient for them to
        ``step(..., table_grads={name: g})``. Each table is looked up once per step;
        ``train=False`` (evaluation) pushes nothing. An id outside the table is refused,
        naming the table, the id and its position.
        """
        ids = self._variables.steps.ids(name, ids)
        found = self.lookup_rows(name, ids, train)
        return to_jax(found.unique_rows), to_jax(found.inverse.astype(np.int32))

    @ends_the_job
    def table_rows(self, name, ids):
        """Return rows ``ids`` (1-D) of table ``name`` as the ps holds them now (a jax array).

        Pulled ``max_ids`` at a time, pushing nothing: any number of rows (the whole table).
        """
        import jax.numpy as jnp

        table = self._variables.steps.table(name)
        ids, n = np.asarray(ids).reshape(-1), table.max_ids
        parts = [self.lookup(name, ids[i:i + n], train=False) for i in range(0, len(ids), n)]
        return jnp.concatenate([rows[inverse] for rows, inverse in parts]) if parts else \
            jnp.zeros((0, table.dim), jnp.float32)

    @ends_the_job
    def step(self, grads, loss=None, table_grads=None):
        """Push ``grads`` (the parameters' pytree structure), update on the ps, pull.

        Returns the new parameters (also ``opt.params``). ``loss`` (a number or a scalar
        array) is only reported (log lines, metrics). A gradient pytree that differs from
        the parameters (a missing leaf, a shape, a dtype) is refused, naming the leaf.
        ``table_grads``: ``{table: d(loss)/d(rows)}`` of each table looked up (for
        training) since the last step, pushed sparsely before the dense push.
        """
        try:
            leaves = self.layout.leaves(grads, "gradient")
        except ConfigurationError as exc:
            raise ConfigurationError(f"step {self.global_step}: {exc}") from None
        if self._variables.steps.tables:
            TableSteps.copy_grads(self.session.table_lookups, table_grads, self.global_step)
        elif table_grads:
            raise ConfigurationError("step() got table_grads, but the optimizer has no tables")
        for (grad, _), leaf in zip(self._views, leaves):
            np.copyto(grad, np.asarray(leaf))  # a CPU jax array reads without a copy
        self._variables.loss = float("nan") if loss is None else float(loss)
        self.session.run(_BATCH)
        self.params = self._pulled()
        return self.params

    def pull(self):
        """Pull the newest parameters without a step (async: others' updates) and return them."""
        self.session.last_reply = self.client.pull()
        self.params = self._pulled()
        return self.params
