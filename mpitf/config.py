"""One typed configuration: the options of a training job, checked once where they are built.

:class:`TrainingConfig` holds what a :class:`~mpitf.worker.session.TrainingSession` and the
ps tasks need; :class:`JobConfig` adds what the jobs' flags carry beyond it (model,
optimizer, deadline, files). Both refuse a bad value when constructed, and a misspelt
keyword is a ``TypeError`` that names it. Every range check is a function here, so library
constructors (data sets, optimizers, models) call the same checks instead of copies.
"""

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field

from .conflicts import check_combinations
from .errors import ConfigurationError

__all__ = [
    "DEFAULT_DEADLINE", "DEFAULT_MAX_NONFINITE_SKIPS", "DEFAULT_BUCKET_BYTES",
    "DEFAULT_SUMMARY_EVERY", "MODES", "SERVER_FIRST", "STALL_FACTOR", "STALL_FLOOR",
    "STALL_WARMUP_STEPS", "JobConfig", "PsAssignment", "TrainingConfig",
    "check_batch_size", "check_choice", "check_deadline", "check_int", "check_learning_rate",
    "check_memory_fraction", "check_moving_average_decay", "check_multiple", "check_number",
    "default_deadline", "stall_allowance",
]

DEFAULT_DEADLINE = 300.0  # seconds a rank waits on a silent peer; MPITF_DEADLINE overrides it

# Stall detection. With no --deadline flag the waits adapt to the step time: once
# STALL_WARMUP_STEPS steps have run, a silent rank ends the job within
# max(STALL_FLOOR, STALL_FACTOR x the slowest step since then), never later than the
# deadline. Start-up (imports, data, the first pull) and checkpoint writes (file-system
# speed, not step time) keep the whole deadline. ``--deadline S`` asks for a fixed S.
STALL_FLOOR = 30.0  # scheduling hiccups, a swapping node, a GC pause: never name a rank sooner
STALL_FACTOR = 10.0  # a step 10x slower than the slowest yet is a stall, not noise
STALL_WARMUP_STEPS = 5  # the first steps (compilation, caches, page faults) are not typical
# A worker waiting on a ps cannot tell a silent ps from a ps waiting (sync) on a silent
# worker; the ps can. So the rank that waits on workers waits 1/SERVER_FIRST as long.
SERVER_FIRST = 1.5
# Consecutive non-finite gradients a worker may skip before the job ends (--max-nonfinite-skips):
# a few bad batches are noise, a hundred in a row mean the parameters themselves diverged.
DEFAULT_MAX_NONFINITE_SKIPS = 100
# Buckets by default: a push leaves in parts of about this many bytes per ps, applied while
# the next arrives (benchmarks/README.md, "Push/pull against raw MPI, session 5").
DEFAULT_BUCKET_BYTES = 2 << 20
MODES = ("sync", "async", "ssp")
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # --wire-dtype
# Global steps between TensorBoard histograms (--summary-every); see docs/design.md for the cost.
DEFAULT_SUMMARY_EVERY = 100
# The most kernel threads a ps may be given (--ps-threads): a bound that catches typos.
MAX_PS_THREADS = 1024


# -- the checks ----------------------------------------------------------------------------

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


def stall_allowance(slowest_step, steps_seen, deadline=DEFAULT_DEADLINE):
    """Return the seconds a worker waits on a ps after ``steps_seen`` steps (None: forever).

    The adaptive rule: ``SERVER_FIRST * deadline`` until STALL_WARMUP_STEPS steps have run,
    then max(STALL_FLOOR, STALL_FACTOR * ``slowest_step``), at most that. A ps waits on a
    worker ``1 / SERVER_FIRST`` of it, so it speaks first.
    """
    if deadline is None:
        return None
    cap = SERVER_FIRST * deadline
    if steps_seen < STALL_WARMUP_STEPS:
        return cap
    return min(cap, max(STALL_FLOOR, STALL_FACTOR * slowest_step))


def default_deadline():
    """Return the default deadline: $MPITF_DEADLINE when set, else ``DEFAULT_DEADLINE``."""
    text = os.environ.get("MPITF_DEADLINE", "").strip()
    if not text:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        raise ConfigurationError(
            f"MPITF_DEADLINE={text!r} is not a number of seconds") from None
    return check_deadline(value)


# -- the configuration ---------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingConfig:
    """What a training session and the ps tasks run by; checked when built.

    Fields:
        mode: "sync", "async" or "ssp" (bounded staleness).
        last_step: stop at this global step (None: never).
        batch_size: examples per worker step (None: the data set's).
        checkpoint_dir: where checkpoints live; the newest good one is restored.
        save_checkpoint_steps / save_checkpoint_secs: checkpoint every N steps / T seconds.
        max_to_keep: checkpoints kept.
        replicas_to_aggregate: sync: gradients per step (None: every worker).
        deterministic: sync: sum gradients in worker order (bit-for-bit runs).
        staleness: ssp: the largest lead of a worker over the slowest.
        skip_nonfinite: drop NaN/Inf gradients and count them instead of stopping.
        max_nonfinite_skips: with skip_nonfinite, the job ends (naming the variable) when a
            worker has skipped this many gradients in a row.
        moving_average_decay: keep an exponential moving average (None: none).
        clip_norm: clip to this global L2 norm (None: none): sync, the aggregated gradient
            (the ps tasks agree on its norm); async and ssp, each push on its worker.
        ps_strategy: how variables go to ps tasks (None: the placement's default).
        seed: seed of the initial values.
        log_every: the chief logs a line, metrics.jsonl and TensorBoard scalars every N steps.
        summary_every: TensorBoard histograms of gradients and variables every N steps.
        run_dir: where metrics.jsonl and the TensorBoard event files go (None: nowhere).
        timeline: write a Chrome trace of every rank to this path.
        bucket_bytes: buckets of about this many bytes per ps, last layers first (0: one;
            None: DEFAULT_BUCKET_BYTES, or 0 with clip_norm, clients, aggregate_per_node).
        clients: in-graph replication: the worker tasks that talk to the ps (None: all).
        ps_threads: threads each ps applies the optimizer with (None: the cores the ps
            rank may use, shared among the ranks on its node; see ps/threads.py).
        profile_steps: the chief times N steps into RUN_DIR/profile.json (worker/profile.py).
        aggregate_per_node: sync: the replicas of a node sum their gradients in shared
            memory and one leader per node pushes for them (see worker/node.py).
        wire_dtype: "float32", "bfloat16" or "float16": the dtype gradients and parameters
            travel in; the ps keeps float32 parameters and slots (see wire/convert.py).
        reset_optimizer_state: restore a checkpoint's parameters but not its optimizer
            slots (they start afresh): the way to resume under another optimizer, which is
            refused otherwise (see ckpt/slots.py).
    """

    mode: str = "sync"
    last_step: int = None
    batch_size: int = None
    checkpoint_dir: str = None
    save_checkpoint_steps: int = None
    save_checkpoint_secs: float = None
    max_to_keep: int = 5
    replicas_to_aggregate: int = None
    deterministic: bool = False
    staleness: int = 2
    skip_nonfinite: bool = False
    max_nonfinite_skips: int = DEFAULT_MAX_NONFINITE_SKIPS
    moving_average_decay: float = None
    clip_norm: float = None
    ps_strategy: str = None
    seed: int = 0
    log_every: int = 20
    summary_every: int = DEFAULT_SUMMARY_EVERY
    run_dir: str = None
    timeline: str = None
    bucket_bytes: int = None
    clients: tuple = None
    ps_threads: int = None
    profile_steps: int = 0
    aggregate_per_node: bool = False
    wire_dtype: str = "float32"
    reset_optimizer_state: bool = False

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        if self.last_step is not None:
            check_int("last_step (--steps)", self.last_step, 0)
        if self.batch_size is not None:
            check_batch_size(self.batch_size)
        if self.save_checkpoint_steps is not None:
            check_int("save_checkpoint_steps (--checkpoint-every)", self.save_checkpoint_steps, 1)
        if self.save_checkpoint_secs is not None:
            check_number("save_checkpoint_secs (--checkpoint-secs)", self.save_checkpoint_secs,
                         low=0.0, low_open=True)
        check_int("max_to_keep", self.max_to_keep, 0)
        if self.replicas_to_aggregate is not None:
            check_int("replicas_to_aggregate (leave it out for every worker)",
                      self.replicas_to_aggregate, 1)
        check_int("staleness", self.staleness, 0)
        if self.deterministic and self.mode != "sync":
            raise ConfigurationError(
                f"deterministic (--deterministic) needs mode 'sync', got {self.mode!r}: in "
                f"{self.mode} mode the order of updates depends on timing; drop one of them")
        check_int("max_nonfinite_skips (--max-nonfinite-skips)", self.max_nonfinite_skips, 1)
        if self.moving_average_decay is not None:
            check_moving_average_decay(self.moving_average_decay)
        if self.bucket_bytes is None:  # default: one frame where an option needs the whole push
            one = self.clip_norm is not None or self.clients is not None or self.aggregate_per_node
            object.__setattr__(self, "bucket_bytes", 0 if one else DEFAULT_BUCKET_BYTES)
            object.__setattr__(self, "_default_buckets", True)
        if self.clip_norm is not None:
            check_number("clip_norm", self.clip_norm, low=0.0, low_open=True)
            if self.bucket_bytes:
                raise ConfigurationError(
                    "clip_norm needs the whole gradient before any of it is applied, but "
                    f"bucket_bytes={self.bucket_bytes} pushes and applies it in buckets: "
                    "leave bucket_bytes at 0 to clip")
        check_int("seed", self.seed, 0)
        check_int("log_every", self.log_every, 0)
        check_int("summary_every (--summary-every)", self.summary_every, 0)
        check_int("bucket_bytes (--bucket-bytes; 0 for one frame per ps)", self.bucket_bytes, 0)
        check_int("profile_steps (--profile-steps; 0 for none)", self.profile_steps, 0)
        if self.ps_threads is not None:
            check_int("ps_threads (--ps-threads)", self.ps_threads, 1)
            if self.ps_threads > MAX_PS_THREADS:
                raise ConfigurationError(
                    f"ps_threads (--ps-threads) must be at most {MAX_PS_THREADS}, got "
                    f"{self.ps_threads}; leave it out for the cores the ps may use")
        if self.clients is not None:
            object.__setattr__(self, "clients", tuple(
                check_int("clients", c, 0) for c in self.clients))
        check_choice("wire_dtype (--wire-dtype)", self.wire_dtype, WIRE_DTYPES)
        check_combinations(self)

    def replace(self, **changes):
        """Return a copy with ``changes`` applied (checked again; misspelt names raise)."""
        if getattr(self, "_default_buckets", False):
            changes.setdefault("bucket_bytes", None)
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class JobConfig:
    """Everything a job's flags set: the training options plus model, optimizer and files.

    Build it with :meth:`from_args` right after parsing the flags, on every rank: it is
    pure, so a bad value fails identically everywhere.
    """

    training: TrainingConfig = field(default_factory=TrainingConfig)
    model: str = "mlp"
    hidden: int = 128
    optimizer: str = "sgd"
    lr: float = 0.3
    lr_decay: float = None
    lr_decay_steps: int = 100
    deadline: float = field(default_factory=default_deadline)
    fixed_deadline: bool = False  # True: every wait is ``deadline``; False: adaptive, up to it
    data: str = None
    export: str = None
    gpu_memory_fraction: float = None

    def __post_init__(self):
        check_choice("model", self.model, ("mlp", "cnn"))
        check_int("hidden units (--hidden)", self.hidden, 1)
        check_choice("optimizer", self.optimizer,
                     ("sgd", "momentum", "adam", "adagrad", "ftrl"))
        check_learning_rate(self.lr, "learning rate (--lr)")
        if self.lr_decay is not None:
            check_number("learning-rate decay (--lr-decay)", self.lr_decay, low=0.0,
                         low_open=True)
        check_int("decay steps (--lr-decay-steps)", self.lr_decay_steps, 1)
        check_deadline(self.deadline)
        if self.gpu_memory_fraction is not None:
            check_memory_fraction(self.gpu_memory_fraction)

    @classmethod
    def from_args(cls, args):
        """Build the configuration from parsed job flags (see ``add_training_arguments``)."""
        training = TrainingConfig(
            mode=args.mode, last_step=args.steps, batch_size=args.batch_size,
            checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.checkpoint_every,
            save_checkpoint_secs=args.checkpoint_secs, max_to_keep=args.max_to_keep,
            replicas_to_aggregate=args.replicas_to_aggregate, deterministic=args.deterministic,
            staleness=args.staleness, skip_nonfinite=args.skip_nonfinite,
            max_nonfinite_skips=args.max_nonfinite_skips,
            moving_average_decay=args.moving_average_decay, ps_strategy=args.ps_strategy,
            seed=args.seed, log_every=args.log_every, summary_every=args.summary_every,
            run_dir=args.run_dir, timeline=args.timeline, bucket_bytes=args.bucket_bytes,
            ps_threads=args.ps_threads, profile_steps=args.profile_steps,
            aggregate_per_node=args.aggregate_per_node, wire_dtype=args.wire_dtype,
            reset_optimizer_state=getattr(args, "reset_optimizer_state", False))
        return cls(training=training, model=args.model, hidden=args.hidden,
                   optimizer=args.optimizer, lr=args.lr, lr_decay=args.lr_decay,
                   lr_decay_steps=args.lr_decay_steps,
                   deadline=default_deadline() if args.deadline is None else args.deadline,
                   fixed_deadline=args.deadline is not None,
                   data=args.data, export=args.export,
                   gpu_memory_fraction=args.gpu_memory_fraction)


@dataclass(frozen=True)
class PsAssignment:
    """What the chief tells one ps beyond the :class:`TrainingConfig`: its part of the model.

    Fields: slices (this ps's variable slices), shard_size, dtype (a numpy dtype string),
    num_ps, optimizer (an ``Optimizer.config()`` dict), restore (a checkpoint directory or
    None), chief_rank, deadline (seconds, or None), adaptive (True: the deadline is an upper
    bound and waits adapt to the step time, see ``stall_allowance``), chunk_bytes (or None),
    total_num_replicas (the workers that push, or None: all), sparse (embedding tables:
    ``tables``, ``batch_size``; None: none), nodes (node-local aggregation: each node's
    replica indices, its leader first, which pushes for all of them; None: none).
    """

    slices: tuple
    shard_size: int
    dtype: str
    num_ps: int
    optimizer: dict
    chief_rank: int
    restore: str = None
    deadline: float = None
    adaptive: bool = False
    chunk_bytes: int = None
    total_num_replicas: int = None
    sparse: dict = None
    nodes: tuple = None
