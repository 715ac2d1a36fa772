"""The range checks every option and library constructor shares, one function each.

Each returns the value (as ``float`` or ``int`` where it says) or raises a
:class:`~mpitf.errors.ConfigurationError` naming the option, the range and the value, so a
data set, an optimizer and a flag refuse a bad value with the same words; and the facts of
a job (:class:`JobFacts`) its options are checked against.
"""

import math
import numbers
import os
from dataclasses import dataclass

from .errors import ConfigurationError

__all__ = [
    "JobFacts",
    "check_batch_size", "check_choice", "check_deadline", "check_int", "check_learning_rate",
    "check_memory_fraction", "check_moving_average_decay", "check_multiple", "check_number",
    "number_from_environment",
]


def check_number(name, value, low=None, high=None, low_open=False, high_open=True):
    """Return ``value`` as a float; raise unless it is a finite real number within range.

    ``low`` and ``high`` bound it; ``low_open`` / ``high_open`` leave the bound out.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number, got {value!r}")
    below = low is not None and (value < low or (low_open and value == low))
    above = high is not None and (value > high or (high_open and value == high))
    if below or above:
        if high is None:
            raise ConfigurationError(f"{name} must be {'>' if low_open else '>='} {low}, "
                                     f"got {value!r}")
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ConfigurationError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return float(value)


def check_int(name, value, low=None):
    """Return ``value`` as an int; raise unless it is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ConfigurationError(f"{name} must be >= {low}, got {value!r}")
    return int(value)


def check_choice(name, value, choices):
    """Return ``value``; raise unless it is one of ``choices``."""
    if value not in choices:
        raise ConfigurationError(
            f"unknown {name} {value!r}: use {', '.join(repr(c) for c in choices[:-1])} "
            f"or {choices[-1]!r}")
    return value


def check_multiple(name, value, of):
    """Return ``value``; raise unless it is a positive integer multiple of ``of``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0 \
            or value % of:
        raise ConfigurationError(f"{name} must be a positive multiple of {of}, got {value!r}")
    return int(value)


def check_batch_size(value):
    """Return the batch size; raise unless it is an integer >= 1."""
    return check_int("batch_size", value, 1)


def check_learning_rate(value, name="learning_rate", allow_zero=False):
    """Return the learning rate; raise unless finite and > 0 (>= 0 with ``allow_zero``).

    Only an optimizer built directly may take 0 (the "none" optimizer of the benchmarks).
    """
    return check_number(name, value, low=0.0, low_open=not allow_zero)


def check_moving_average_decay(value):
    """Return the decay of a moving average; raise unless it is in (0, 1)."""
    return check_number("moving_average_decay", value, low=0.0, high=1.0, low_open=True)


def check_memory_fraction(value):
    """Return the fraction of a GPU's memory a rank may use; raise unless it is in (0, 1]."""
    return check_number("gpu memory fraction", value, low=0.0, high=1.0, low_open=True,
                        high_open=False)


def check_deadline(value):
    """Return the deadline in seconds (None: wait forever); raise unless it is > 0."""
    if value is None:
        return None
    return check_number("deadline", value, low=0.0, low_open=True)


def number_from_environment(name, unit, environ=None):
    """Return ``$name`` as a float of ``unit``s (>= 0), or None when it is unset or empty.

    Empty counts as unset (``MPITF_X= mpiexec ...`` clears one); anything else that is not
    a finite number >= 0 is refused naming the variable, where the job reads it.
    """
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name}={text!r} is not a number of {unit} (>= 0): give "
                                 "one, or unset it for the default")
    return value


@dataclass(frozen=True)
class JobFacts:
    """What a job's options are checked against (``TrainingConfig.check_job``).

    The same on every rank of a job: gathered before training (``mpitf.cli.flags``), or
    what one worker of a library session knows. Fields: ``num_ps`` and ``num_replicas``
    (the cluster's ps tasks and training replicas); ``ulfm`` (the MPI is Open MPI with
    ULFM, so a lost rank can be survived); ``tables`` (the model has embedding tables);
    ``backends`` (the array backends of the ranks known, ps and replicas; names) and
    ``replica_backends`` (the replicas' alone); ``nodes_problem`` (why the replicas
    cannot be grouped by node, or None).
    """

    num_ps: int
    num_replicas: int
    ulfm: bool = False
    tables: bool = False
    backends: tuple = ("numpy",)
    replica_backends: tuple = ("numpy",)
    nodes_problem: str = None
