"""``SessionFrontEnd``: what each framework's ``DistributedOptimizer`` shares.

mpitf.torch and mpitf.jax differ in how gradients reach the push buffer; stopping,
closing, the exit code, the context manager and the tables' front end (each table looked
up once per step, an evaluation's lookup left out of the push, the ps rules whose sparse
update equals the dense one) are their session's, written once here.
"""

import functools

from ..errors import ConfigurationError
from ..runtime.exits import end_job

__all__ = ["SPARSE_RULES", "SessionFrontEnd", "check_sparse_rule", "ends_the_job"]

# ps optimizer -> the options that must be 0 for its update of the rows a step looks up
# (the sparse update) to equal the dense one
SPARSE_RULES = {"sgd": (), "adagrad": (),
                "torch_sgd": ("momentum", "weight_decay"),
                "torch_adagrad": ("weight_decay",), "rowwise_adagrad": ("weight_decay",)}


def check_sparse_rule(optimizer, tables, label=None, fix=None):
    """Refuse a ps ``optimizer`` whose update of the rows a step looks up is not the dense one.

    SGD and Adagrad leave a row without gradient (and its slots) as it is, so updating
    the present rows only equals the dense update; momentum, Adam, RMSprop, weight decay
    (and FTRL, whose first step sets every row from its slots) move rows that were not
    looked up. ``tables``: their names; ``label`` names the optimizer as the user gave it
    and ``fix`` the rules to use instead, in the framework's words (defaults: the ps's).
    """
    name = getattr(optimizer, "name", type(optimizer).__name__)
    zero = SPARSE_RULES.get(name)
    odd = [k for k in zero or () if getattr(optimizer, k, 0)]
    if zero is not None and not odd:
        return
    if label is None:
        with_ = f" with {', '.join(f'{k}={getattr(optimizer, k)}' for k in odd)}" if odd else ""
        label = f"{name!r}{with_}"
    raise ConfigurationError(
        f"table {tables[0]!r} cannot be updated by {label} on the ps: a table's rows are "
        "updated only when a step looks them up, which equals the dense update only for "
        + (fix or f"{sorted(SPARSE_RULES)} (torch_sgd without momentum or weight_decay, "
                  "torch_adagrad without weight_decay)"))


def ends_the_job(method):
    """Decorate a front end's method: a configuration it cannot run ends every rank.

    The refusal is printed once, as one line that names the parameter and what to do,
    and every rank exits non-zero (:func:`~mpitf.runtime.exits.end_job`), as a job's bad
    flag does. In one process (no server, or a world of one) it is raised as it is.
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ConfigurationError as exc:
            server = getattr(self, "_server", None)
            if server is None or server.comm.Get_size() < 2:
                raise
            end_job(exc, first=server.replica_index in (0, None))
    return wrapper


class SessionFrontEnd:
    """Base of a wrapper that holds a :class:`~.session.TrainingSession` in ``session``."""

    session = None
    # what the refusal of a table looked up twice in a step advises, in the framework's words
    ONCE_PER_STEP = "look each table up once per step (all its ids in one call)"

    def lookup_rows(self, name, ids, train=True):
        """Pull the rows of table ``name``'s ``ids`` now; the step pushes their gradients.

        Each table is looked up once per step; ``train=False`` (an evaluation's lookup)
        leaves them out of the push. Returns the table's lookup.
        """
        return self.lookup_tables({name: ids}, train)[name]

    def lookup_tables(self, ids, train=True):
        """Pull the rows of several tables' ``ids`` ({table: ids}) in one request per ps.

        As :meth:`lookup_rows`, for every table named; returns {table: lookup}.
        """
        session = self.session
        for name in ids:
            if name in session.table_lookups:
                raise ConfigurationError(
                    f"table {name!r} was looked up twice before step() at step "
                    f"{session.global_step}: {self.ONCE_PER_STEP}")
        return session.lookup(ids, push=train)

    @property
    def global_step(self):
        """Return the global step of the last reply."""
        return self.session.global_step

    def should_stop(self):
        """Return True once the last step is reached or a signal asked to stop."""
        return self.session.should_stop()

    def close(self):
        """Checkpoint at the end (chief), tell every ps this worker is done; return exit_code."""
        self.session.close()
        return self.exit_code

    @property
    def exit_code(self):
        """Return this rank's exit code (75 after a signal with a checkpoint cut)."""
        return self.session.exit_code

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        return False
