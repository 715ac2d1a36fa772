"""Translate a torch.optim optimizer into the ps optimizer that runs the same update.

Only what the ps can run exactly is accepted: the optimizer's type (SGD, Adam, AdamW,
Adagrad, RMSprop, not subclasses) and its options (amsgrad and maximize are refused).
Param groups become options per group of variables on the ps (every option torch allows
per group: lr, weight_decay, betas, eps, momentum, ...); each group's learning rate travels
with each push, so schedulers may change them independently. Anything else is refused
before training, by name.
"""

import torch

from ..errors import ConfigurationError
from ..ps.optimizers import make_optimizer
from ..worker.frontend import check_sparse_rule

# Options that choose an implementation, not the numbers.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
# Keys torch's LR schedulers add to a param group.
_SCHEDULER_KEYS = ("initial_lr",)


def _sgd(g):
    return "torch_sgd", dict(momentum=g["momentum"], dampening=g["dampening"],
                             nesterov=g["nesterov"], weight_decay=g["weight_decay"])


def _adam(g):
    name = "adamw" if g.get("decoupled_weight_decay") else "torch_adam"
    beta1, beta2 = g["betas"]
    return name, dict(beta1=float(beta1), beta2=float(beta2), eps=g["eps"],
                      weight_decay=g["weight_decay"])


def _adagrad(g):
    return "torch_adagrad", dict(lr_decay=g["lr_decay"], weight_decay=g["weight_decay"],
                                 initial_accumulator_value=g["initial_accumulator_value"],
                                 eps=g["eps"])


def _rmsprop(g):
    return "rmsprop", dict(alpha=g["alpha"], eps=g["eps"], weight_decay=g["weight_decay"],
                           momentum=g["momentum"], centered=g["centered"])


_RULES = {torch.optim.SGD: _sgd, torch.optim.Adam: _adam, torch.optim.AdamW: _adam,
          torch.optim.Adagrad: _adagrad, torch.optim.RMSprop: _rmsprop}
# Options a rule reads or that change nothing; any other option is refused by name.
_KNOWN = {
    torch.optim.SGD: {"momentum", "dampening", "nesterov", "weight_decay", "maximize"},
    torch.optim.Adam: {"betas", "eps", "weight_decay", "amsgrad", "maximize",
                       "decoupled_weight_decay"},
    torch.optim.Adagrad: {"lr_decay", "weight_decay", "initial_accumulator_value", "eps",
                          "maximize"},
    torch.optim.RMSprop: {"alpha", "eps", "weight_decay", "momentum", "centered", "maximize"},
}
_KNOWN[torch.optim.AdamW] = _KNOWN[torch.optim.Adam]


def group_options(group):
    """Return the options of a param group that must agree across groups and steps."""
    return {k: v for k, v in group.items()
            if k not in ("params", "lr", *_SCHEDULER_KEYS, *_IMPLEMENTATION)}


def learning_rate(group):
    """Return a param group's learning rate as a float (torch allows a tensor)."""
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _rule(kind, group):
    """Return (ps rule, its options) of one param group, refusing what the ps cannot run."""
    name = kind.__name__
    options = group_options(group)
    unknown = sorted(set(options) - _KNOWN[kind])
    if unknown:
        raise ConfigurationError(f"{name}: mpitf.torch does not know option(s) {unknown}")
    for option in ("amsgrad", "maximize"):
        if options.get(option):
            raise ConfigurationError(
                f"{name}({option}=True) is not supported on the ps: leave {option} off")
    return _RULES[kind](options)


def translate(optimizer, names=None, rowwise_tables=False):
    """Return the ps optimizer (``make_optimizer``) that runs ``optimizer``'s update exactly.

    One param group is one rule. Several are one rule with options per group
    (:mod:`mpitf.ps.groups`): each group's variables (``names`` maps a parameter's ``id``
    to its name; parameters it lacks, frozen ones, are left out) with that group's
    options and learning rate; group ``k``'s rate is the ``k``-th of ``rate_groups``.
    ``rowwise_tables``: an Adagrad's tables train row-wise (:mod:`mpitf.ps.rowwise`).
    Raises ConfigurationError naming the optimizer or option the ps cannot run.
    """
    kind = type(optimizer)
    name = kind.__name__
    if kind not in _RULES:
        supported = ", ".join(sorted(k.__name__ for k in _RULES))
        raise ConfigurationError(
            f"mpitf.torch cannot run {name} on the ps: use one of torch.optim's {supported}")
    if rowwise_tables and kind is not torch.optim.Adagrad:
        raise ConfigurationError(f"rowwise_tables=True (row-wise Adagrad on the tables) "
                                 f"goes with torch.optim.Adagrad, not {name}")
    groups = optimizer.param_groups
    rules = [_rule(kind, group) for group in groups]
    if rowwise_tables:
        rules = [("rowwise_adagrad", options) for _, options in rules]
    rule, kwargs = rules[0]
    if len(groups) == 1:
        return make_optimizer(rule, learning_rate(groups[0]), **kwargs)
    names = names or {}
    table = []
    for k, (group, (other, options)) in enumerate(zip(groups, rules)):
        if other != rule:
            raise ConfigurationError(
                f"{name}: param group 0 runs {rule} but group {k} runs {other} (its "
                "decoupled_weight_decay differs): the ps runs one rule; give every group "
                "the same")
        variables = [names[id(p)] for p in group["params"] if id(p) in names]
        if variables:
            table.append({"variables": variables, "learning_rate": learning_rate(group),
                          **options})
    return make_optimizer(rule, learning_rate(groups[0]), groups=table, **kwargs)


def rate_groups(optimizer, names):
    """Return the indices of the param groups that have trainable parameters (in ``names``).

    These are the ps's groups, in order: their learning rates travel with each push.
    """
    return [k for k, group in enumerate(optimizer.param_groups)
            if any(id(p) in names for p in group["params"])]


def check_table_rule(optimizer, tables, rowwise_tables=False):
    """Refuse an update of ``tables``' rows (names) that torch would not run sparsely.

    The ps updates a table's present rows by the optimizer's rule, as torch updates a
    weight from a sparse gradient: SGD without momentum or weight decay, Adagrad without
    weight decay (torch's sparse Adagrad). Tables take the optimizer's one param group.
    """
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if len(groups) > 1:
        raise ConfigurationError(
            f"{name} has {len(groups)} param groups, but the model has mpitf.torch tables "
            f"({', '.join(tables)}), which train with one: give the optimizer one group")
    options = group_options(groups[0])
    check_sparse_rule(
        translate(optimizer, rowwise_tables=rowwise_tables), tables,
        label=f"{name}({', '.join(f'{k}={v}' for k, v in sorted(options.items()) if v)})",
        fix="torch.optim.SGD without momentum or weight_decay, or torch.optim.Adagrad "
            "without weight_decay, as torch updates a sparse gradient (Adam, AdamW and "
            "RMSprop are not supported for tables)")
