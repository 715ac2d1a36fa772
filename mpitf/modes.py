"""Consistency modes as both sides see them: everything outside the ps that a mode decides.

The ps's policies (:mod:`mpitf.ps.consistency`, :mod:`mpitf.ps.local`) decide what a push
does there; the worker must know a few things too (where a gradient is clipped, how many
examples a global step stands for, which steps end in a push, who applies the optimizer),
and the worker may not import the ps. So each mode is described once here, below both,
and every place that would test ``mode ==`` asks its :class:`Mode` instead.
"""

__all__ = ["DEFAULT_LOCAL_STEPS", "MODES", "Mode", "mode_of"]

DEFAULT_LOCAL_STEPS = 4  # --mode local without --local-steps: Lin et al.'s H of their CIFAR runs


class Mode:
    """One consistency mode's answers (the defaults are async's).

    Attributes:
        name: the ``--mode`` value.
        clips_on_ps: the ps clips the step's aggregated gradient (its tasks agree on the
            norm); otherwise each worker clips its own gradient before it leaves.
        steps_together: every worker's push of a step lands in that step, so a buddy's
            copy of a lost ps's shard counts steps as the buddy does (a checkpoint cut's
            step is its own).
        sums_gradients: a step is the sum of several pushes' gradients (what deterministic
            summation and a node's shared sum need).
        applies_locally: the workers run the optimizer and push their parameters, which
            the ps averages; otherwise they push gradients and the ps applies them.
        local_steps: the optimizer steps a worker takes between two pushes.
    """

    name = "async"
    clips_on_ps = False
    steps_together = False
    sums_gradients = False
    applies_locally = False
    local_steps = 1

    def examples_per_step(self, batch_size, num_workers, replicas_to_aggregate):
        """Return the examples one global step stands for (each push is a step here)."""
        return batch_size

    def pushes_after(self, step, last_step=None):
        """Return True when the worker's step that reached global step ``step`` pushes."""
        return True

    def with_local_steps(self, local_steps):
        """Return this mode with ``local_steps`` (None: its default); only local has any."""
        return self

    def __repr__(self):
        return f"Mode({self.name!r})"


class _Sync(Mode):
    name = "sync"
    clips_on_ps = True
    steps_together = True
    sums_gradients = True

    def examples_per_step(self, batch_size, num_workers, replicas_to_aggregate):
        """Return the batches of the gradients a step aggregates."""
        return batch_size * (replicas_to_aggregate or num_workers)


class _Ssp(Mode):
    name = "ssp"


class Local(Mode):
    """Local SGD: ``local_steps`` optimizer steps on each worker, then the ps averages."""

    name = "local"
    steps_together = True
    applies_locally = True

    def __init__(self, local_steps=DEFAULT_LOCAL_STEPS):
        self.local_steps = local_steps

    def examples_per_step(self, batch_size, num_workers, replicas_to_aggregate):
        """Return every worker's batch: each takes one local step per global step."""
        return batch_size * num_workers

    def pushes_after(self, step, last_step=None):
        """Push the parameters every ``local_steps`` steps, and at the last step."""
        return step % self.local_steps == 0 or step == last_step

    def with_local_steps(self, local_steps):
        return Local(local_steps or DEFAULT_LOCAL_STEPS)


MODES = {m.name: m for m in (_Sync(), Mode(), _Ssp(), Local())}  # --mode's choices, in order


def mode_of(name, local_steps=None):
    """Return the :class:`Mode` named ``name`` (``local_steps``: local SGD's K)."""
    return MODES[name].with_local_steps(local_steps)
