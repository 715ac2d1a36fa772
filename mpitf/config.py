"""One typed configuration: the options of a training job, each declared once, checked once.

:class:`TrainingConfig` holds what a :class:`~mpitf.worker.session.TrainingSession` and the
ps tasks need; :class:`JobConfig` adds what the jobs' flags carry beyond it (model,
optimizer, deadline, devices, files). Each option is one field declared with
:func:`~mpitf.options.option`: its default, flag, help and check in one place, from which
``mpitf.options`` makes the jobs' flags and reads them back (:meth:`JobConfig.from_args`).
The options that refuse each other, and those the job's facts refuse, are checked in
``mpitf.conflicts`` (at construction, and by :meth:`TrainingConfig.check_job`). Both
refuse a bad value when constructed, and a misspelt keyword is a ``TypeError`` that names it.
The range checks live in ``mpitf.checks`` (re-exported here), so library constructors
(data sets, optimizers, models) call the same checks instead of copies.
"""

import dataclasses
import os
from dataclasses import dataclass, field

from .checks import (
    JobFacts,
    check_batch_size,
    check_choice,
    check_deadline,
    check_int,
    check_learning_rate,
    check_memory_fraction,
    check_moving_average_decay,
    check_multiple,
    check_number,
    number_from_environment,
)
from .conflicts import check_job, refuse_combinations
from .errors import ConfigurationError
from .modes import DEFAULT_LOCAL_STEPS, MODES, mode_of
from .options import check_fields, integer, number, option, values_from_args

__all__ = [
    "DEFAULT_DEADLINE", "DEFAULT_MAX_NONFINITE_SKIPS", "DEFAULT_BUCKET_BYTES",
    "LINK_BUCKET_BYTES", "LINK_MIN_BUCKETS", "LINK_MIN_BUCKET_BYTES", "default_bucket_bytes",
    "DEFAULT_SUMMARY_EVERY", "MODES", "SERVER_FIRST", "STALL_FACTOR", "STALL_FLOOR",
    "STALL_WARMUP_STEPS", "WIRE_DTYPES", "JobConfig", "JobFacts", "PsAssignment",
    "TrainingConfig",
    "check_batch_size", "check_choice", "check_deadline", "check_int", "check_learning_rate",
    "check_memory_fraction", "check_moving_average_decay", "check_multiple", "check_number",
    "default_deadline", "shard_bucket_bytes", "stall_allowance",
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
# the next arrives (benchmarks/README.md, "Push/pull against raw MPI", "Why 2 MiB buckets").
DEFAULT_BUCKET_BYTES = 2 << 20
# Where ps and workers span nodes: before the first reply can leave, a round of buckets, one
# per ps, crosses each worker's link, and the last round's replies cross after the push, so
# a step costs about (model + ps x bucket) / link. 128 KiB buckets were as fast as 256 KiB or
# faster at every point measured over 200 Mbit/s and 1 Gbit/s links, 1 to 8 ps (8 + 8 ps,
# 16 MiB, 200 Mbit/s, alternated in one run: 754 ms against 920; benchmarks/README.md,
# "Scaling over links").
LINK_BUCKET_BYTES = 128 << 10
# And a ps's shard there travels in at least LINK_MIN_BUCKETS buckets (of at least
# LINK_MIN_BUCKET_BYTES): a sync ps answers its first bucket once every worker's has come,
# so a round of buckets, one per ps, crosses each worker's link before any answer (8 + 8
# ps, 4 MiB in 128 KiB buckets: a quarter of the model). 32 KiB buckets were as fast as
# 128 KiB or faster at every point of the 16-node grid at 200 Mbit/s (8 + 8 ps on their own
# nodes, alternated in one run: 4 MiB 232 against 305 ms, 16 MiB 975 against 1,037, with
# compute; benchmarks/README.md, "Scaling over links").
LINK_MIN_BUCKETS = 64
LINK_MIN_BUCKET_BYTES = 32 << 10
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # --wire-dtype (wire/dtypes.py maps them)
# Global steps between TensorBoard histograms (--summary-every); see docs/design.md for the cost.
DEFAULT_SUMMARY_EVERY = 100
# The most kernel threads a ps may be given (--ps-threads): a bound that catches typos.
MAX_PS_THREADS = 1024


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
    value = number_from_environment("MPITF_DEADLINE", "seconds")
    return DEFAULT_DEADLINE if value is None else check_deadline(value)


# -- the configuration ---------------------------------------------------------------------

def _ps_threads(name, value):
    check_int(name, value, 1)
    if value > MAX_PS_THREADS:
        raise ConfigurationError(
            f"{name} must be at most {MAX_PS_THREADS}, got {value}; leave it out for the cores "
            "the ps may use")
    return value


def _clients(name, value):
    return tuple(check_int(name, c, 0) for c in value)


def default_bucket_bytes(across_nodes):
    """Return the default bucket size: smaller where pushes cross a link between nodes."""
    return LINK_BUCKET_BYTES if across_nodes else DEFAULT_BUCKET_BYTES


def shard_bucket_bytes(config, shard_bytes):
    """Return the bucket size of a ps's shard of ``shard_bytes``: ``config.bucket_bytes``.

    Across nodes, by default, smaller for a small shard, so that it travels in at least
    LINK_MIN_BUCKETS buckets of at least LINK_MIN_BUCKET_BYTES. Worker and ps cut alike.
    """
    given = config.bucket_bytes
    if not given or not config.across_nodes or "bucket_bytes" not in config.defaulted:
        return given
    return min(given, max(LINK_MIN_BUCKET_BYTES, shard_bytes // LINK_MIN_BUCKETS))


def _one_frame_or_buckets(config):
    """The default bucket size: one frame where an option needs the whole push at once."""
    one = config.clients is not None or config.aggregate_per_node or \
        config.consistency.applies_locally or config.ps_replication_steps
    return 0 if one else default_bucket_bytes(config.across_nodes)


@dataclass(frozen=True)
class TrainingConfig:
    """What a training session and the ps tasks run by; checked when built.

    Each field's ``help`` says what it is; a field left at None means what leaving its
    flag out means.
    """

    mode: str = option(
        "sync", "--mode", choices=tuple(MODES),
        help="sync replicas, async, bounded staleness (ssp), or local SGD (local: each worker "
             "steps on its own, the ps averages the parameters every --local-steps steps)")
    local_steps: int = option(
        None, "--local-steps", check=integer(1), label="local_steps (--local-steps)",
        help="local: the optimizer steps each worker takes between two averagings "
             f"(default: {DEFAULT_LOCAL_STEPS})")
    last_step: int = option(
        None, "--steps", flag_default=300, check=integer(0), label="last_step (--steps)",
        help="stop at this global step")
    batch_size: int = option(
        None, "--batch-size", flag_default=32, check=integer(1),
        help="examples per worker step")
    checkpoint_dir: str = option(
        None, "--checkpoint-dir", flag_default=lambda: os.environ.get("MPITF_CHECKPOINT_DIR"),
        help="checkpoint directory; the newest good checkpoint there is restored "
             "(default: $MPITF_CHECKPOINT_DIR, else none)")
    save_checkpoint_steps: int = option(
        None, "--checkpoint-every", check=integer(1),
        label="save_checkpoint_steps (--checkpoint-every)",
        help="checkpoint every N global steps")
    save_checkpoint_secs: float = option(
        None, "--checkpoint-secs", check=number(low=0.0, low_open=True),
        label="save_checkpoint_secs (--checkpoint-secs)", help="checkpoint every T seconds")
    max_to_keep: int = option(
        5, "--max-to-keep", check=integer(0),
        help="complete checkpoints kept, the newest (0: keep all)")
    full_checkpoint_every: int = option(
        1, "--full-checkpoint-every", check=integer(1),
        help="of the checkpoints taken (--checkpoint-every/--checkpoint-secs), every Nth is "
             "full and the ones between are deltas: the dense shard whole and only the "
             "embedding-table rows changed since the checkpoint before (1: all full)")
    replicas_to_aggregate: int = option(
        None, "--replicas-to-aggregate", "--replicas_to_aggregate", check=integer(1),
        label="replicas_to_aggregate (leave it out for every worker)",
        help="sync: gradients per step (default: all workers; fewer gives backups)")
    deterministic: bool = option(
        False, "--deterministic",
        help="sync: sum gradients in worker order so runs are bit-for-bit equal")
    staleness: int = option(
        2, "--staleness", check=integer(0), help="ssp: largest lead over the slowest")
    skip_nonfinite: bool = option(
        False, "--skip-nonfinite",
        help="drop NaN/Inf gradients and count them instead of stopping; the job still ends "
             "(exit 1, naming the variable) after --max-nonfinite-skips in a row on one worker")
    max_nonfinite_skips: int = option(
        DEFAULT_MAX_NONFINITE_SKIPS, "--max-nonfinite-skips", check=integer(1),
        label="max_nonfinite_skips (--max-nonfinite-skips)",
        help="with --skip-nonfinite: consecutive skipped gradients of one worker that end "
             f"the job (default: {DEFAULT_MAX_NONFINITE_SKIPS})")
    moving_average_decay: float = option(
        None, "--moving-average-decay", check=number(low=0.0, high=1.0, low_open=True),
        help="keep an exponential moving average of the variables for evaluation")
    clip_norm: float = option(
        None, check=number(low=0.0, low_open=True),
        help="clip to this global L2 norm (None: none): sync, the aggregated gradient (the ps "
             "tasks agree on its norm; with buckets each ps holds the step's until its last "
             "is in); async and ssp, each push on its worker")
    ps_strategy: str = option(
        None, "--ps-strategy", flag_default="round_robin",
        flag_choices=("round_robin", "greedy"),
        help="how variables go to ps tasks: round_robin (TensorFlow's default) or greedy "
             "(by bytes); in code, also a strategy object")
    seed: int = option(0, "--seed", check=integer(0), help="seed of initial values and shuffling")
    log_every: int = option(
        20, "--log-every", check=integer(0),
        help="chief logs every N steps (0: never): a line, metrics.jsonl and TensorBoard "
             "scalars")
    summary_every: int = option(
        DEFAULT_SUMMARY_EVERY, "--summary-every", check=integer(0),
        label="summary_every (--summary-every)",
        help="chief writes TensorBoard histograms of gradients and variables every N steps "
             f"(0: never; default: {DEFAULT_SUMMARY_EVERY})")
    run_dir: str = option(
        None, "--run-dir", flag_default="runs/latest",
        help="where metrics.jsonl, summary.json and the TensorBoard event files go "
             "(tensorboard --logdir runs/)")
    timeline: str = option(None, "--timeline", help="write a Chrome trace of every rank here")
    bucket_bytes: int = option(
        None, "--bucket-bytes", check=integer(0), resolve=_one_frame_or_buckets,
        label="bucket_bytes (--bucket-bytes; 0 for one frame per ps)",
        help="push gradients per ps in buckets of about this many bytes, last layers first, "
             "pipelined on the ps (0: one frame per ps; default: "
             f"{DEFAULT_BUCKET_BYTES >> 20} MiB, {LINK_BUCKET_BYTES >> 10} KiB where ps and "
             f"workers span nodes, there down to {LINK_MIN_BUCKET_BYTES >> 10} KiB so that a "
             f"ps's shard travels in at least {LINK_MIN_BUCKETS}; with --aggregate-per-node "
             "or --ps-replication-steps: 0)")
    across_nodes: bool = option(
        False, help="the ps tasks and training replicas run on more than one node (the "
                    "session sets it from the cluster's hosts): buckets default to "
                    f"{LINK_BUCKET_BYTES >> 10} KiB")
    clients: tuple = option(
        None, check=_clients,
        help="in-graph replication: the worker tasks that talk to the ps (None: all)")
    ps_threads: int = option(
        None, "--ps-threads", check=_ps_threads, label="ps_threads (--ps-threads)",
        help="threads each ps applies the optimizer with (default: the cores the ps rank may "
             "use, shared among the ranks on its node)")
    profile_steps: int = option(
        0, "--profile-steps", check=integer(0),
        label="profile_steps (--profile-steps; 0 for none)",
        help="the chief times N steps after N/4 warm-up steps and writes "
             "RUN_DIR/profile.json: model bytes, compute per step and example, push+pull "
             "(for mpitf bench --plan)")
    aggregate_per_node: bool = option(
        False, "--aggregate-per-node",
        help="sync: sum a node's gradients in shared memory; one rank per node pushes")
    wire_dtype: str = option(
        "float32", "--wire-dtype", choices=WIRE_DTYPES, flag_choices=None,
        label="wire_dtype (--wire-dtype)",
        help="the dtype gradients and parameters travel in: float32, bfloat16 or float16 "
             "(the ps keeps float32 parameters and optimizer slots)")
    ps_replication_steps: int = option(
        0, "--ps-replication-steps", check=integer(0),
        label="ps_replication_steps (--ps-replication-steps)",
        help="under Open MPI with ULFM: every K applies each ps sends its shard (parameters "
             "and optimizer slots, its embedding tables' rows) to its buddy, the next ps, "
             "which serves it if the ps dies (at most K-1 of its steps lost; 0: off)")
    heal: bool = option(
        False, "--heal",
        help="under Open MPI with ULFM: a lost worker or ps (with --ps-replication-steps) "
             "is replaced by a process spawned into the job under its task's name (it needs "
             "a free slot: mpitf run oversubscribes)")
    reset_optimizer_state: bool = option(
        False, "--reset-optimizer-state",
        help="restore the parameters of a checkpoint written by another optimizer (or with "
             "other slots) and start the optimizer's state afresh; without it such a restore "
             "is refused")
    # The fields that ``resolve`` chose because None was given; replace() chooses them again.
    defaulted: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "defaulted", check_fields(self))
        refuse_combinations(self)  # the options that refuse each other (conflicts.py)

    def replace(self, **changes):
        """Return a copy with ``changes`` applied (checked again; misspelt names raise)."""
        for name in self.defaulted:  # a default stays a default
            changes.setdefault(name, None)
        return dataclasses.replace(self, **changes)

    @property
    def consistency(self):
        """Return the :class:`~mpitf.modes.Mode` of ``mode``: what depends on it, once."""
        return mode_of(self.mode, self.local_steps)

    def check_job(self, facts):
        """Raise if an option cannot work in the job :class:`JobFacts` ``facts`` describe.

        The one check of the options against the job's facts (its MPI, ps tasks, replicas,
        backends, tables and nodes): every rank calls it with the same facts before
        training, so a refusal is one message, alike everywhere. Each message names the
        option, the fact and the fix (``mpitf.conflicts``).
        """
        check_job(self, facts)


def _deadline(name, value):
    return check_deadline(value)


def _learning_rate(name, value):
    return check_learning_rate(value, name)


@dataclass(frozen=True)
class JobConfig:
    """Everything a job's flags set: the training options plus model, optimizer and files.

    Build it with :meth:`from_args` right after parsing the flags, on every rank: it is
    pure, so a bad value fails identically everywhere.
    """

    training: TrainingConfig = field(default_factory=TrainingConfig)
    model: str = option("mlp", "--model", choices=("mlp", "cnn"), help="reference model")
    hidden: int = option(128, "--hidden", check=integer(1), label="hidden units (--hidden)",
                         help="hidden units of the MLP")
    optimizer: str = option(
        "sgd", "--optimizer", choices=("sgd", "momentum", "adam", "adagrad", "ftrl"),
        help="the ps's update rule")
    lr: float = option(0.3, "--lr", "--learning_rate", check=_learning_rate,
                       label="learning rate (--lr)", help="learning rate")
    lr_decay: float = option(
        None, "--lr-decay", check=number(low=0.0, low_open=True),
        label="learning-rate decay (--lr-decay)",
        help="exponential decay rate of the learning rate per --lr-decay-steps")
    lr_decay_steps: int = option(100, "--lr-decay-steps", check=integer(1),
                                 label="decay steps (--lr-decay-steps)", help="steps per decay")
    deadline: float = option(
        None, "--deadline", default_factory=default_deadline, check=_deadline,
        flag_default=None,
        help="a fixed number of seconds to wait on a silent rank before ending the job (set it "
             "above the longest step and checkpoint). Without it, a silent rank is named within "
             "max(30 s, 10 x the slowest step so far) once a few steps have run, and start-up "
             f"and checkpoints may take up to $MPITF_DEADLINE, else {DEFAULT_DEADLINE:g} s")
    fixed_deadline: bool = False  # True: every wait is ``deadline``; False: adaptive, up to it
    data: str = option(
        None, "--data",
        help="HDF5 data set (x_train, y_train, x_test, y_test); default: the digits set, "
             "prepared on first use under $MPITF_DATA_DIR or ~/.cache/mpitf")
    export: str = option(
        None, "--export",
        help="after training, the chief writes every variable to this .npz (its directory "
             "must exist and be writable: checked before training)")
    evaluator: bool = option(
        False, "--evaluator",
        help="with --num-ps (no spec): the highest rank is an evaluator task that evaluates "
             "each checkpoint of --checkpoint-dir")
    log_device_placement: bool = option(
        False, "--log-device-placement",
        help="print which rank runs which task, and (the chief) which ps task holds each "
             "variable and slice")
    device: str = option(
        "cpu", "--device", choices=("auto", "cpu", "gpu"), group="devices",
        help="where variables and gradients live: 'auto' takes a GPU (local rank modulo "
             "visible devices) when CuPy and CUDA are there (default: cpu)")
    allow_soft_placement: bool = option(
        False, "--allow-soft-placement", group="devices",
        help="fall back to the CPU, saying so once, when --device=gpu cannot be had")
    gpu_memory_fraction: float = option(
        None, "--gpu-memory-fraction", group="devices", label="gpu memory fraction",
        check=number(low=0.0, high=1.0, low_open=True, high_open=False),
        help="cap each rank's CuPy memory pool at this fraction of its GPU "
             "(per_process_gpu_memory_fraction)")
    allow_growth: bool = option(
        True, "--no-allow-growth", dest="allow_growth", group="devices",
        help="with --gpu-memory-fraction, allocate that much once at start")

    def __post_init__(self):
        check_fields(self)

    @classmethod
    def from_args(cls, args):
        """Build the configuration from parsed job flags (see ``add_training_arguments``).

        Without ``--deadline`` the waits adapt to the step time, up to the default deadline.
        """
        return cls(fixed_deadline=args.deadline is not None, **values_from_args(cls, args))


@dataclass(frozen=True)
class PsAssignment:
    """What the chief tells one ps beyond the :class:`TrainingConfig`: its part of the model.

    Fields: slices (this ps's variable slices), shard_size, dtype (a numpy dtype string),
    num_ps, optimizer (an ``Optimizer.config()`` dict), restore (a checkpoint directory or
    None), chief_rank, deadline (seconds, or None), adaptive (True: the deadline is an upper
    bound and waits adapt to the step time, see ``stall_allowance``), chunk_bytes (or None),
    total_num_replicas (the workers that push, or None: all), sparse (embedding tables:
    ``tables``, ``batch_size``; None: none), nodes (node-local aggregation: each node's
    replica indices, its leader first, which pushes for all of them; None: none), ward
    (with ``ps_replication_steps``: the PsAssignment of the ps whose shard this one keeps a
    copy of, and serves if that ps dies; None: none).
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
    ward: object = None
