"""Options per group of variables: one update rule, its options per group, by element range.

torch's param groups (weight decay on matrices and none on biases, layer-wise learning
rates), optax's masks and a numpy model's "no decay on biases" are one table: each group is
a set of variables and the options it overrides; every other variable keeps the
optimizer's own. :class:`Grouped` holds one :class:`~mpitf.ps.optimizers.Optimizer` per
group (the same rule, its own options), and :class:`ElementRules` turns it into ranges of
a ps's shard, ``[(lo, hi, optimizer)]``, from the shard's variable slices (a variable split
over several ps by a partitioner is a range on each). The shard applies each range's
optimizer to its elements: the same kernels, and one range (today's whole shard) when there
is one group.

Learning rates that a worker sends (mpitf.torch's schedulers) come per group, in a
``RATES`` request before the push (:meth:`Grouped.set_learning_rates`).
"""

import fnmatch

from mpitf.errors import ConfigurationError
from mpitf.runtime.backend import array_module
from mpitf.wire.header import HEADER_BYTES

__all__ = ["ElementRules", "Grouped"]

_SCRATCH = "_scratch"


class Grouped:
    """One rule with options per group of variables (``config()``: ``groups`` of names).

    Args:
        base: the optimizer of the variables in no group (its options are the defaults).
        groups: ``[(variables, optimizer, options)]``: names (or fnmatch patterns until
            :meth:`resolve`), the group's optimizer, and the options it was given.
    """

    def __init__(self, base, groups):
        self.base = base
        self.groups = list(groups)
        self.name = base.name
        names = list(base.slot_names)
        for _, opt, _ in self.groups:
            names += [n for n in opt.slot_names if n not in names]
        self.slot_names = tuple(names)  # what a shard keeps: every group's slots
        self._group_of = None  # variable name -> group index, once resolved

    @classmethod
    def build(cls, name, learning_rate, options, groups):
        """Return the optimizer ``make_optimizer(name, learning_rate, groups=..., **options)``."""
        from .optimizers import make_optimizer

        base = make_optimizer(name, learning_rate, **options)
        built = []
        for k, group in enumerate(groups):
            group = dict(group)
            variables = group.pop("variables", None)
            if isinstance(variables, str):
                variables = [variables]
            if not variables:
                raise ConfigurationError(
                    f"optimizer group {k} names no variables: give it "
                    "'variables': [names or fnmatch patterns]")
            rate = group.pop("learning_rate", learning_rate)
            try:
                opt = make_optimizer(name, rate, **{**options, **group})
            except ConfigurationError as exc:
                raise ConfigurationError(f"optimizer group {k}: {exc}") from None
            built.append((tuple(variables), opt, group))
        return cls(base, built)

    def resolve(self, names):
        """Return the optimizer for variables ``names``: patterns turned into names.

        A pattern that matches no variable, or a variable two groups claim, is refused.
        """
        owner, groups = {}, []
        for k, (patterns, opt, options) in enumerate(self.groups):
            chosen = []
            for pattern in patterns:
                hits = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
                if not hits:
                    some = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                    raise ConfigurationError(
                        f"optimizer group {k}: {pattern!r} matches no variable of the model "
                        f"(its variables: {some})")
                chosen += [n for n in hits if n not in chosen]
            for n in chosen:
                if owner.setdefault(n, k) != k:
                    raise ConfigurationError(
                        f"variable {n!r} is in optimizer groups {owner[n]} and {k}: put it "
                        "in one")
            groups.append((tuple(chosen), opt, options))
        resolved = Grouped(self.base, groups)
        resolved._group_of = owner
        return resolved

    def optimizer_of(self, name):
        """Return the optimizer that updates variable ``name`` (resolved groups)."""
        if self._group_of is None:
            self._group_of = {n: k for k, (names, _, _) in enumerate(self.groups)
                              for n in names}
        k = self._group_of.get(name)
        return self.base if k is None else self.groups[k][1]

    def learning_rate(self, step):
        """Return the rate of the variables in no group (the one logs report)."""
        return self.base.learning_rate(step)

    def set_learning_rate(self, lr):
        """Apply ``lr`` to the variables in no group (a push header's single rate)."""
        self.base.set_learning_rate(lr)

    def set_learning_rates(self, rates):
        """Apply ``rates[k]`` to group ``k`` from the next update on (a ``RATES`` request)."""
        for (_, opt, _), lr in zip(self.groups, rates):
            opt.set_learning_rate(lr)

    def config(self):
        """Return a JSON-able dict; ``make_optimizer(**config)`` rebuilds an equal optimizer."""
        cfg = self.base.config()
        groups = []
        for names, opt, _ in self.groups:
            own = opt.config()
            del own["name"]
            groups.append({"variables": list(names), **own})
        cfg["groups"] = groups
        return cfg

    def bind_shard(self, slices, params):
        """Return ``update(grad, step)`` over ``params``, a flat shard (see :func:`bind_shard`)."""
        return bind_shard(self, slices, params)

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        return f"Grouped({self.config()!r})"


class ElementRules:
    """Which optimizer updates which elements of a shard: ``ranges``, made once.

    Args:
        optimizer: an Optimizer (one range: the whole shard) or a :class:`Grouped`.
        slices: the shard's :class:`~mpitf.placement.VariableSlice` list.
        size: the shard's elements.
    """

    def __init__(self, optimizer, slices, size):
        self.optimizer = optimizer
        if not isinstance(optimizer, Grouped):
            self.ranges = ((0, size, optimizer),)
            return
        ranges = []
        for s in sorted(slices, key=lambda s: s.offset):
            opt = optimizer.optimizer_of(s.name)
            lo, hi = s.offset, s.offset + s.size
            if ranges and ranges[-1][2] is opt and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi, opt)  # neighbours with one rule: one range
            else:
                ranges.append((lo, hi, opt))
        self.ranges = tuple(ranges)

    @property
    def default(self):
        """Return the optimizer of what is in no group (embedding tables: every row)."""
        return getattr(self.optimizer, "base", self.optimizer)

    @property
    def group_count(self):
        """Return the optimizer's groups (0: one set of options, whose rate a push carries)."""
        return len(getattr(self.optimizer, "groups", ()))

    @property
    def rates_bytes(self):
        """Return the most bytes of a ``RATES`` request: each group's rate and a clip norm."""
        return HEADER_BYTES + 8 * (self.group_count + 1)

    @property
    def optimizers(self):
        """Return each distinct optimizer of the ranges once, in range order."""
        seen = []
        for _, _, opt in self.ranges:
            if all(opt is not o for o in seen):
                seen.append(opt)
        return seen

    def make_slots(self, size, xp, dtype):
        """Allocate every group's slots over the whole shard, each range initialised by its rule.

        No groups: the optimizer's own ``make_slots``. Groups: zeros for the union of their
        slot names (every ps keeps the same slots; one a group lacks stays 0 and unused
        there), one scratch.
        """
        if not isinstance(self.optimizer, Grouped):
            return self.optimizer.make_slots(size, xp, dtype)
        names = self.optimizer.slot_names
        slots = {name: xp.zeros(size, dtype=dtype) for name in names}
        if any(opt.uses_scratch for opt in self.optimizers):
            slots[_SCRATCH] = xp.empty(size, dtype=dtype)
        for lo, hi, opt in self.ranges:
            opt.init_slots({k: slots[k][lo:hi] for k in opt.slot_names})
        return slots

    def parts(self, lo, hi):
        """Return ``[(a, b, optimizer)]``: the ranges within ``[lo, hi)``, from ``lo``."""
        return [(max(a, lo) - lo, min(b, hi) - lo, opt) for a, b, opt in self.ranges
                if a < hi and b > lo]


def bind_shard(optimizer, slices, params):
    """Return ``update(grad, step)``: ``optimizer``'s rules applied to ``params`` in place.

    ``params`` is a flat shard whose variables ``slices`` lays out, held outside a ps: a
    local SGD worker's copy (:mod:`mpitf.worker.local`), which so takes the steps the ps
    would, with the same kernels, its slots its own.
    """
    xp = array_module(params)
    size = len(params)
    rules = ElementRules(optimizer, slices, size)
    slots = rules.make_slots(size, xp, params.dtype)
    parts = [(opt.bind(params[a:b], {k: v[a:b] for k, v in slots.items()}), a, b)
             for a, b, opt in rules.parts(0, size)]

    def update(grad, step):
        for apply, a, b in parts:
            apply(grad[a:b], step)
    return update
