"""Learning-rate schedules the ps runs as configuration (``{"schedule": kind, ...}``).

Each is a callable ``step -> lr`` with ``config()`` (what :func:`make_schedule` turns back
into it). TensorFlow's :class:`ExponentialDecay` takes its arguments as
``tf.train.exponential_decay``; every other decay takes ``warmup_steps``: the rate rises
linearly to ``initial_learning_rate`` over those steps (``lr * (step + 1) / warmup_steps``),
then the decay runs from step 0.
"""

import bisect
import math

from mpitf.config import check_learning_rate, check_number
from mpitf.errors import ConfigurationError

__all__ = ["SCHEDULES", "ConstantWithWarmup", "CosineDecay", "ExponentialDecay", "LinearDecay",
           "PiecewiseConstant", "PolynomialDecay", "StepDecay", "make_schedule"]


class ExponentialDecay:
    """Decay the learning rate exponentially with the global step.

    As ``tf.train.exponential_decay``:
    ``lr = initial_learning_rate * decay_rate ** (step / decay_steps)``, with the
    exponent floored when ``staircase`` is true.

    Args:
        initial_learning_rate: the rate at step 0.
        decay_steps: the steps over which the rate is multiplied by ``decay_rate`` once.
        decay_rate: the factor per ``decay_steps``.
        staircase: decay in whole steps of ``decay_steps`` rather than continuously.
    """

    kind = "exponential_decay"

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False):
        check_learning_rate(initial_learning_rate, "initial_learning_rate", allow_zero=True)
        check_number("exponential_decay: decay_steps", decay_steps, low=0.0, low_open=True)
        check_number("exponential_decay: decay_rate", decay_rate, low=0.0, low_open=True)
        self.initial_learning_rate = float(initial_learning_rate)
        steps = float(decay_steps)
        self.decay_steps = int(steps) if steps.is_integer() else steps
        self.decay_rate = float(decay_rate)
        self.staircase = bool(staircase)

    def __call__(self, step):
        """Return the learning rate at global step ``step``."""
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate**p

    def config(self):
        """Return a JSON-able dict that :func:`make_schedule` turns back into this schedule."""
        return {
            "schedule": self.kind,
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "schedule")
        return f"ExponentialDecay({args})"


class _Schedule:
    """Base: ``_hyper`` names the arguments ``config()`` reports, after the initial rate."""

    kind = "base"
    _hyper = ()

    def __init__(self, initial_learning_rate, warmup_steps=0):
        check_learning_rate(initial_learning_rate, "initial_learning_rate", allow_zero=True)
        check_number(f"{self.kind}: warmup_steps", warmup_steps, low=0.0)
        self.initial_learning_rate = float(initial_learning_rate)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        """Return the learning rate at global step ``step``."""
        if step < self.warmup_steps:
            return self.initial_learning_rate * (step + 1) / self.warmup_steps
        return self._decayed(step - self.warmup_steps)

    def _decayed(self, step):
        return self.initial_learning_rate

    def config(self):
        """Return a JSON-able dict that ``make_schedule`` turns back into this schedule."""
        cfg = {"schedule": self.kind, "initial_learning_rate": self.initial_learning_rate}
        cfg.update((k, getattr(self, k)) for k in self._hyper)
        cfg["warmup_steps"] = self.warmup_steps
        return cfg

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "schedule")
        return f"{type(self).__name__}({args})"


def _steps(kind, name, value):
    check_number(f"{kind}: {name}", value, low=0.0, low_open=True)
    return int(value)


class ConstantWithWarmup(_Schedule):
    """Linear warmup over ``warmup_steps``, then ``initial_learning_rate``."""

    kind = "constant"


class CosineDecay(_Schedule):
    """``lr * ((1 - alpha) * (1 + cos(pi * min(step, decay_steps) / decay_steps)) / 2 + alpha)``."""

    kind = "cosine_decay"
    _hyper = ("decay_steps", "alpha")

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, warmup_steps=0):
        super().__init__(initial_learning_rate, warmup_steps)
        self.decay_steps = _steps(self.kind, "decay_steps", decay_steps)
        self.alpha = check_number("cosine_decay: alpha", alpha, low=0.0, high=1.0,
                                  high_open=False)

    def _decayed(self, step):
        p = min(step, self.decay_steps) / self.decay_steps
        cos = 0.5 * (1.0 + math.cos(math.pi * p))
        return self.initial_learning_rate * ((1.0 - self.alpha) * cos + self.alpha)


class PolynomialDecay(_Schedule):
    """tf's polynomial_decay: ``(lr - end) * (1 - min(step, T) / T)**power + end``."""

    kind = "polynomial_decay"
    _hyper = ("decay_steps", "end_learning_rate", "power")

    def __init__(self, initial_learning_rate, decay_steps, end_learning_rate=0.0001, power=1.0,
                 warmup_steps=0):
        super().__init__(initial_learning_rate, warmup_steps)
        self.decay_steps = _steps(self.kind, "decay_steps", decay_steps)
        self.end_learning_rate = check_learning_rate(end_learning_rate, "end_learning_rate",
                                                     allow_zero=True)
        self.power = check_number(f"{self.kind}: power", power, low=0.0, low_open=True)

    def _decayed(self, step):
        p = min(step, self.decay_steps) / self.decay_steps
        return ((self.initial_learning_rate - self.end_learning_rate) * (1.0 - p) ** self.power
                + self.end_learning_rate)


class LinearDecay(PolynomialDecay):
    """Linear decay to ``end_learning_rate`` over ``decay_steps`` (polynomial, power 1)."""

    kind = "linear_decay"
    _hyper = ("decay_steps", "end_learning_rate")

    def __init__(self, initial_learning_rate, decay_steps, end_learning_rate=0.0,
                 warmup_steps=0):
        super().__init__(initial_learning_rate, decay_steps, end_learning_rate, 1.0,
                         warmup_steps)


class StepDecay(_Schedule):
    """torch's StepLR: ``lr * gamma ** (step // step_size)``."""

    kind = "step_decay"
    _hyper = ("step_size", "gamma")

    def __init__(self, initial_learning_rate, step_size, gamma=0.1, warmup_steps=0):
        super().__init__(initial_learning_rate, warmup_steps)
        self.step_size = _steps(self.kind, "step_size", step_size)
        self.gamma = check_number(f"{self.kind}: gamma", gamma, low=0.0, low_open=True)

    def _decayed(self, step):
        return self.initial_learning_rate * self.gamma ** (step // self.step_size)


class PiecewiseConstant:
    """tf's piecewise_constant: ``values[i]`` while ``boundaries[i-1] < step <= boundaries[i]``."""

    kind = "piecewise_constant"

    def __init__(self, boundaries, values):
        boundaries, values = [int(b) for b in boundaries], [float(v) for v in values]
        if len(values) != len(boundaries) + 1:
            raise ConfigurationError(
                f"piecewise_constant: expecting one value more than boundaries, got "
                f"{len(boundaries)} boundaries and {len(values)} values")
        if boundaries != sorted(set(boundaries)):
            raise ConfigurationError(
                f"piecewise_constant: boundaries must increase, got {boundaries}")
        for v in values:
            check_learning_rate(v, "piecewise_constant: values", allow_zero=True)
        self.boundaries, self.values = boundaries, values

    def __call__(self, step):
        """Return the learning rate at global step ``step``."""
        return self.values[bisect.bisect_left(self.boundaries, step)]

    def config(self):
        """Return a JSON-able dict that ``make_schedule`` turns back into this schedule."""
        return {"schedule": self.kind, "boundaries": self.boundaries, "values": self.values}

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        return f"PiecewiseConstant(boundaries={self.boundaries!r}, values={self.values!r})"


SCHEDULES = {cls.kind: cls for cls in (ExponentialDecay, ConstantWithWarmup, CosineDecay,
                                       PolynomialDecay, LinearDecay, StepDecay,
                                       PiecewiseConstant)}


def make_schedule(learning_rate):
    """Turn a float, a schedule, or a schedule's config dict into a schedule or a float.

    Returns a float for a constant rate, otherwise a callable ``step -> lr``
    with a ``config()`` method.
    """
    if hasattr(learning_rate, "config") and callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, dict):
        cfg = dict(learning_rate)
        kind = cfg.pop("schedule", None)
        if kind not in SCHEDULES:
            raise ConfigurationError(
                f"unknown learning-rate schedule {kind!r}; expected one of {sorted(SCHEDULES)}"
            )
        try:
            return SCHEDULES[kind](**cfg)
        except TypeError as exc:
            raise ConfigurationError(f"bad arguments for schedule {kind!r}: {exc}") from None
    return check_learning_rate(learning_rate, allow_zero=True)
