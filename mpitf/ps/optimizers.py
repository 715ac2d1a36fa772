"""Apply TF 1.x optimizers in place to a parameter server's flat buffers.

A ps holds its shard of every variable as one flat 1-D buffer ``params`` and
receives a flat gradient of the same length. The kernels here update
``params`` in place with ``xp`` ufuncs and ``out=``, so numpy and CuPy buffers
share one code path and a step allocates nothing: the only scratch buffer is
made once by :meth:`Optimizer.make_slots`, under a name starting with ``_``
(private, not checkpointed).

The update rules follow ``tf.train`` of TensorFlow 1.x exactly:
GradientDescentOptimizer, MomentumOptimizer (with ``use_nesterov``),
AdamOptimizer (bias correction folded into the learning rate, epsilon outside
the square root) and AdagradOptimizer (no epsilon; the accumulator starts at
``initial_accumulator_value``).
"""

from __future__ import annotations

import abc
import math

import numpy as np

from mpitf.config import check_number
from mpitf.errors import ConfigurationError
from mpitf.runtime.backend import array_module

from .average import ExponentialMovingAverage
from .schedules import make_schedule

# Below this many elements a host buffer takes the ufunc passes: there they cost what the
# fused kernel costs, within a few µs (less for SGD), and a ps whose buffers are all this
# small never starts numba, which takes 0.3-0.5 s of CPU out of every small job's start-up.
FUSED_MIN_SIZE = 1 << 14


def _fused_apply(*args):
    """Load the fused kernels (numba) on the first apply, then call them.

    Only a ps applies: a worker builds optimizers (to send their config) without paying for
    numba's import and start (about 0.3 s of CPU a process).
    """
    global _fused_apply
    from .kernels import fused_apply

    _fused_apply = fused_apply
    return fused_apply(*args)

__all__ = [
    "FUSED_MIN_SIZE", "Adagrad", "Adam", "ExponentialMovingAverage", "GradientDescent",
    "Momentum", "NoOp", "Optimizer", "array_module", "make_optimizer",
]

_SCRATCH = "_scratch"


# -------------------------------------------------------------------- optimizers


class Optimizer(abc.ABC):
    """Base of the in-place optimizers: subclasses set ``name``, ``slot_names``, the update.

    Args:
        learning_rate: a float, a schedule (``step -> lr`` with ``config()``),
            or a schedule's config dict such as
            ``{"schedule": "exponential_decay", ...}``.
    """

    name = "base"
    slot_names: tuple = ()
    _hyper: tuple = ()  # names of the hyper-parameters config() reports
    uses_scratch = True

    def __init__(self, learning_rate=0.01):
        self._lr = make_schedule(learning_rate)

    def learning_rate(self, step):
        """Return the learning rate used by the update at global step ``step``."""
        return self._lr if isinstance(self._lr, float) else float(self._lr(step))

    def make_slots(self, size, xp, dtype):
        """Allocate the persistent slots (initial values as TF) and the private scratch.

        Returns a dict of 1-D ``xp`` arrays of ``size`` elements; names in
        ``slot_names`` are state to checkpoint, names starting with ``_`` are
        scratch.
        """
        slots = {name: xp.zeros(size, dtype=dtype) for name in self.slot_names}
        if self.uses_scratch:
            slots[_SCRATCH] = xp.empty(size, dtype=dtype)
        self.init_slots(slots)
        return slots

    def init_slots(self, slots):  # noqa: B027 - most rules start every slot at zero
        """Give zeroed slots (views: a group's elements) their initial values, in place."""

    def resolve(self, names):
        """Return this optimizer for variables ``names`` (options per group: see groups.py)."""
        return self

    def apply(self, params, grad, slots, step, pool=None, reply=None, widened=None):
        """Update ``params`` in place from ``grad``; ``step`` is the global step before it.

        Host buffers of :data:`FUSED_MIN_SIZE` elements or more take the fused kernel of
        :mod:`mpitf.ps.kernels` (one pass, over ``pool``'s threads: a
        :class:`~mpitf.ps.threads.KernelPool`, or None for this thread); others (smaller
        ones, CuPy's) take the ufunc passes of ``reference_update``, to the same bits.
        ``grad`` may be a wire dtype (bfloat16, float16) and is then widened (into
        ``widened``, a buffer like ``params``, for the ufunc passes; None: a new one);
        ``reply`` (or None) gets the new parameters in its dtype. ``grad`` may be
        overwritten.
        """
        if params.shape != grad.shape:
            raise ValueError(
                f"expecting grad of shape {params.shape}, got {grad.shape} ({self.name})"
            )
        if params.size < FUSED_MIN_SIZE or not _fused_apply(
                self, params, grad, slots, int(step), pool, reply):
            g = grad
            if grad.dtype != params.dtype:  # a 16-bit wire (the conversions use numba)
                from mpitf.wire.convert import widen_into

                g = widened if widened is not None else array_module(params).empty_like(params)
                widen_into(grad, g)
            self.reference_update(array_module(params), params, g, slots, int(step))
            if reply is not None:
                from mpitf.wire.convert import narrow_into

                narrow_into(params, reply)

    def bind(self, params, slots, pool=None, reply=None, widened=None):
        """Return ``update(grad, step)``: :meth:`apply` to these buffers, every push of a shard.

        A rule whose small updates cost mostly their checks and dispatch makes them once
        here (GradientDescent); the others apply as :meth:`apply` does.
        """
        def update(grad, step):
            self.apply(params, grad, slots, step, pool, reply, widened)
        return update

    def bind_shard(self, slices, params):
        """Return ``update(grad, step)`` over a flat shard held elsewhere (local SGD's)."""
        from .groups import bind_shard

        return bind_shard(self, slices, params)

    @abc.abstractmethod
    def reference_update(self, xp, params, grad, slots, step):
        """Update ``params`` in place (each optimizer's arithmetic)."""

    def config(self):
        """Return a JSON-able dict; ``make_optimizer(**config)`` rebuilds an equal optimizer."""
        lr = self._lr if isinstance(self._lr, float) else self._lr.config()
        cfg = {"name": self.name, "learning_rate": lr}
        cfg.update((k, getattr(self, k)) for k in self._hyper)
        return cfg

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class NoOp(Optimizer):
    """Leave the parameters as they are (benchmarks: the ps only echoes)."""

    name = "none"
    uses_scratch = False

    def apply(self, params, grad, slots, step, pool=None, reply=None, widened=None):
        """Leave ``params`` (and a reply in a wire dtype, which holds them) as they are."""

    def reference_update(self, xp, params, grad, slots, step):
        """Change nothing: the ps only serves the parameters."""
        pass


class GradientDescent(Optimizer):
    """``var -= lr * grad`` (tf.train.GradientDescentOptimizer)."""

    name = "sgd"

    uses_scratch = False

    def reference_update(self, xp, params, grad, slots, step):
        """Subtract ``lr * grad`` from the parameters, the gradient scaled in its own buffer."""
        # Scale the gradient where it lies: the freshly received gradient is the one cold
        # buffer here, and a scratch buffer would be one more to pull through the cache.
        xp.multiply(grad, self.learning_rate(step), grad)  # out positional: a small
        xp.subtract(params, grad, params)  # buffer's update is mostly the call's cost

    def bind(self, params, slots, pool=None, reply=None, widened=None):
        """Bind the ufunc passes of a small host buffer directly, the rate as a 0-d array.

        On 4 KiB the two ufuncs take about 1 µs and ``apply``'s checks and dispatch as
        much again; a Python float as the factor costs numpy 0.4 µs to convert every call,
        a 0-d array of the buffer's dtype nothing (the same bits: the float is cast to
        that dtype either way).
        """
        if reply is not None or type(params) is not np.ndarray or \
                params.size >= FUSED_MIN_SIZE:
            return super().bind(params, slots, pool, reply, widened)
        lr, rate, size = np.zeros((), params.dtype), self.learning_rate, params.size
        multiply, subtract = np.multiply, np.subtract
        if isinstance(self._lr, float) and type(self).learning_rate is Optimizer.learning_rate:
            lr[()], rate = self._lr, None  # a constant rate (no schedule, none pushed): once

        def update(grad, step):
            if grad.size != size:
                raise ValueError(f"expecting grad of {size} elements, got {grad.size} (sgd)")
            if rate is not None:
                lr[()] = rate(step)
            multiply(grad, lr, grad)
            subtract(params, grad, params)
        return update


class Momentum(Optimizer):
    """Momentum SGD as tf.train.MomentumOptimizer, Nesterov's form included.

    ``accum = momentum * accum + grad``; then ``var -= lr * accum``, or with
    Nesterov ``var -= lr * grad + lr * momentum * accum``.
    """

    name = "momentum"
    slot_names = ("momentum",)
    _hyper = ("momentum", "use_nesterov")

    def __init__(self, learning_rate=0.01, momentum=0.9, use_nesterov=False):
        super().__init__(learning_rate)
        check_number("momentum", momentum, low=0.0)
        self.momentum = float(momentum)
        self.use_nesterov = bool(use_nesterov)

    def reference_update(self, xp, params, grad, slots, step):
        """TensorFlow's momentum update (Nesterov's when asked), in numpy passes."""
        lr, mu = self.learning_rate(step), self.momentum
        accum, tmp = slots["momentum"], slots[_SCRATCH]
        xp.multiply(accum, mu, out=accum)
        xp.add(accum, grad, out=accum)
        if self.use_nesterov:
            # lr * grad + lr * mu * accum == lr * (mu * accum + grad)
            xp.multiply(accum, mu, out=tmp)
            xp.add(tmp, grad, out=tmp)
            xp.multiply(tmp, lr, out=tmp)
        else:
            xp.multiply(accum, lr, out=tmp)
        xp.subtract(params, tmp, out=params)


class Adam(Optimizer):
    """Adam as tf.train.AdamOptimizer.

    With ``t = step + 1``: ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``,
    ``m += (1 - beta1) * (g - m)``, ``v += (1 - beta2) * (g*g - v)``,
    ``var -= lr_t * m / (sqrt(v) + epsilon)``.
    """

    name = "adam"
    slot_names = ("m", "v")
    _hyper = ("beta1", "beta2", "epsilon")

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
        super().__init__(learning_rate)
        check_number("beta1", beta1, low=0.0, high=1.0)
        check_number("beta2", beta2, low=0.0, high=1.0)
        check_number("epsilon", epsilon, low=0.0)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def reference_update(self, xp, params, grad, slots, step):
        """TensorFlow 1's Adam (epsilon before the bias correction), in numpy passes."""
        b1, b2, t = self.beta1, self.beta2, step + 1
        lr_t = self.learning_rate(step) * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        m, v, tmp = slots["m"], slots["v"], slots[_SCRATCH]
        xp.subtract(grad, m, out=tmp)
        xp.multiply(tmp, 1.0 - b1, out=tmp)
        xp.add(m, tmp, out=m)
        xp.multiply(grad, grad, out=tmp)
        xp.subtract(tmp, v, out=tmp)
        xp.multiply(tmp, 1.0 - b2, out=tmp)
        xp.add(v, tmp, out=v)
        xp.sqrt(v, out=tmp)
        xp.add(tmp, self.epsilon, out=tmp)
        xp.divide(m, tmp, out=tmp)
        xp.multiply(tmp, lr_t, out=tmp)
        xp.subtract(params, tmp, out=params)


class Adagrad(Optimizer):
    """Adagrad as tf.train.AdagradOptimizer: ``accum += g*g; var -= lr * g / sqrt(accum)``."""

    name = "adagrad"
    slot_names = ("accumulator",)
    _hyper = ("initial_accumulator_value",)

    def __init__(self, learning_rate=0.01, initial_accumulator_value=0.1):
        super().__init__(learning_rate)
        # TF refuses 0 too: the first update would divide by sqrt(g*g) and
        # any zero gradient entry would give 0/0.
        check_number("adagrad: initial_accumulator_value", initial_accumulator_value, low=0.0,
                     low_open=True)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def init_slots(self, slots):
        """Fill the accumulator with ``initial_accumulator_value``."""
        slots["accumulator"].fill(self.initial_accumulator_value)

    def reference_update(self, xp, params, grad, slots, step):
        """Add ``grad**2`` to the accumulator, then ``lr * grad / sqrt(accum)`` off ``params``."""
        accum, tmp = slots["accumulator"], slots[_SCRATCH]
        xp.multiply(grad, grad, out=tmp)
        xp.add(accum, tmp, out=accum)
        xp.sqrt(accum, out=tmp)
        xp.divide(grad, tmp, out=tmp)
        xp.multiply(tmp, self.learning_rate(step), out=tmp)
        xp.subtract(params, tmp, out=params)


_OPTIMIZERS = {cls.name: cls for cls in (GradientDescent, Momentum, Adam, Adagrad, NoOp)}


def make_optimizer(name, learning_rate=0.01, groups=None, **kwargs):
    """Build an optimizer by name: "sgd", "momentum", "adam", "adagrad", "ftrl", "none", ...

    torch.optim's rules are "torch_sgd", "torch_adam", "adamw", "torch_adagrad" and
    "rmsprop" (see :mod:`mpitf.ps.torch_optimizers`).

    Args:
        name: the optimizer's name, as above.
        learning_rate: a float, a schedule, or a schedule config dict.
        groups: options per group of variables, ``[{"variables": [names or fnmatch
            patterns], option: value, ...}]`` (see :mod:`mpitf.ps.groups`); the others
            keep these.
        **kwargs: the optimizer's hyper-parameters (``momentum``, ``use_nesterov``;
            ``beta1``, ``beta2``, ``epsilon``; ``initial_accumulator_value``; ftrl's
            ``learning_rate_power``, ``l1``, ``l2``).

    Returns:
        An :class:`~mpitf.ps.optimizers.Optimizer`, which runs on the ps.

    Raises:
        ConfigurationError: an unknown name, an unknown hyper-parameter, or a value out
            of range.
    """
    from .ftrl import Ftrl  # in a module of its own: this one is at its size limit
    from .rowwise import RowwiseAdagrad
    from .torch_optimizers import TORCH_OPTIMIZERS

    classes = {**_OPTIMIZERS, Ftrl.name: Ftrl, **TORCH_OPTIMIZERS,
               RowwiseAdagrad.name: RowwiseAdagrad}
    key = name.lower() if isinstance(name, str) else name
    if key not in classes:
        raise ConfigurationError(
            f"unknown optimizer {name!r}; expected one of {sorted(classes)}"
        )
    cls = classes[key]
    if groups is not None:
        from .groups import Grouped

        return Grouped.build(key, learning_rate, kwargs, groups)
    unknown = sorted(set(kwargs) - set(cls._hyper))
    if unknown:
        raise ConfigurationError(
            f"optimizer {key!r} takes no option(s) {unknown}; "
            f"valid options: {['learning_rate', *cls._hyper]}"
        )
    return cls(learning_rate, **kwargs)
