"""The training flags every job shares, with the TensorFlow example scripts' names kept."""

import dataclasses
import os

from ..cluster import add_cluster_arguments
from ..cluster_args import check_claimed_role, cluster_from_args
from ..config import DEFAULT_DEADLINE, DEFAULT_MAX_NONFINITE_SKIPS, MODES, JobConfig, TrainingConfig
from ..errors import ConfigurationError, MpitfError
from ..roles import check_training_cluster
from ..runtime.exits import collective, setup_logging

# The defaults of the flags are those of the configuration: written once, there.
_TRAINING = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}
_JOB = {f.name: f.default for f in dataclasses.fields(JobConfig)}


def add_training_arguments(parser, steps=300, batch_size=32, lr=_JOB["lr"]):
    """Add data, optimiser, consistency, checkpoint and logging flags to ``parser``.

    Build the :class:`~mpitf.config.JobConfig` from the parsed flags with
    :func:`config_from_args`, which checks every value.
    """
    add_cluster_arguments(parser)
    g = parser.add_argument_group("training")
    g.add_argument("--data", default=None,
                   help="HDF5 data set (x_train, y_train, x_test, y_test); default: the digits "
                        "set, prepared on first use under $MPITF_DATA_DIR or ~/.cache/mpitf")
    g.add_argument("--model", choices=("mlp", "cnn"), default=_JOB["model"],
                   help="reference model")
    g.add_argument("--hidden", type=int, default=_JOB["hidden"], help="hidden units of the MLP")
    g.add_argument("--steps", type=int, default=steps, help="stop at this global step")
    g.add_argument("--batch-size", type=int, default=batch_size, help="examples per worker step")
    g.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=lr,
                   help="learning rate")
    g.add_argument("--lr-decay", type=float, default=None,
                   help="exponential decay rate of the learning rate per --lr-decay-steps")
    g.add_argument("--lr-decay-steps", type=int, default=_JOB["lr_decay_steps"],
                   help="steps per decay")
    g.add_argument("--optimizer", choices=("sgd", "momentum", "adam", "adagrad", "ftrl"),
                   default=_JOB["optimizer"])
    g.add_argument("--mode", choices=MODES, default=_TRAINING["mode"],
                   help="sync replicas, async, or bounded staleness (ssp)")
    g.add_argument("--replicas-to-aggregate", "--replicas_to_aggregate", type=int, default=None,
                   help="sync: gradients per step (default: all workers; fewer gives backups)")
    g.add_argument("--staleness", type=int, default=_TRAINING["staleness"],
                   help="ssp: largest lead over the slowest")
    g.add_argument("--ps-threads", type=int, default=None,
                   help="threads each ps applies the optimizer with (default: the cores the "
                        "ps rank may use, shared among the ranks on its node)")
    g.add_argument("--aggregate-per-node", action="store_true",
                   help="sync: sum a node's gradients in shared memory; one rank per node pushes")
    g.add_argument("--deterministic", action="store_true",
                   help="sync: sum gradients in worker order so runs are bit-for-bit equal")
    g.add_argument("--skip-nonfinite", action="store_true",
                   help="drop NaN/Inf gradients and count them instead of stopping; the job "
                        "still ends (exit 1, naming the variable) after --max-nonfinite-skips "
                        "in a row on one worker")
    g.add_argument("--max-nonfinite-skips", type=int, default=DEFAULT_MAX_NONFINITE_SKIPS,
                   help="with --skip-nonfinite: consecutive skipped gradients of one worker "
                        f"that end the job (default: {DEFAULT_MAX_NONFINITE_SKIPS})")
    g.add_argument("--moving-average-decay", type=float, default=None,
                   help="keep an exponential moving average of the variables for evaluation")
    g.add_argument("--ps-strategy", choices=("round_robin", "greedy"), default="round_robin")
    g.add_argument("--seed", type=int, default=_TRAINING["seed"],
                   help="seed of initial values and shuffling")
    g.add_argument("--evaluator", action="store_true",
                   help="with --num-ps (no spec): the highest rank is an evaluator task that "
                        "evaluates each checkpoint of --checkpoint-dir")
    g.add_argument("--log-every", type=int, default=_TRAINING["log_every"],
                   help="chief logs every N steps (0: never): a line, metrics.jsonl and "
                        "TensorBoard scalars")
    g.add_argument("--summary-every", type=int, default=_TRAINING["summary_every"],
                   help="chief writes TensorBoard histograms of gradients and variables "
                        f"every N steps (0: never; default: {_TRAINING['summary_every']})")
    g.add_argument("--run-dir", default="runs/latest",
                   help="where metrics.jsonl, summary.json and the TensorBoard event files "
                        "go (tensorboard --logdir runs/)")
    g.add_argument("--checkpoint-dir", default=os.environ.get("MPITF_CHECKPOINT_DIR"),
                   help="checkpoint directory; the newest good checkpoint there is restored "
                        "(default: $MPITF_CHECKPOINT_DIR, else none)")
    g.add_argument("--reset-optimizer-state", action="store_true",
                   help="restore the parameters of a checkpoint written by another optimizer "
                        "(or with other slots) and start the optimizer's state afresh; "
                        "without it such a restore is refused")
    g.add_argument("--checkpoint-every", type=int, default=None,
                   help="checkpoint every N global steps")
    g.add_argument("--checkpoint-secs", type=float, default=None,
                   help="checkpoint every T seconds")
    g.add_argument("--max-to-keep", type=int, default=_TRAINING["max_to_keep"],
                   help="complete checkpoints kept, the newest (0: keep all)")
    g.add_argument("--deadline", type=float, default=None,
                   help="a fixed number of seconds to wait on a silent rank before ending "
                        "the job (set it above the longest step and checkpoint). Without "
                        "it, a silent rank is named within max(30 s, 10 x the slowest step "
                        "so far) once a few steps have run, and start-up and checkpoints "
                        f"may take up to $MPITF_DEADLINE, else {DEFAULT_DEADLINE:g} s")
    g.add_argument("--timeline", default=None, help="write a Chrome trace of every rank here")
    g.add_argument("--profile-steps", type=int, default=0,
                   help="the chief times N steps after N/4 warm-up steps and writes "
                        "RUN_DIR/profile.json: model bytes, compute per step and example, "
                        "push+pull (for mpitf bench --plan)")
    g.add_argument("--wire-dtype", default=_TRAINING["wire_dtype"],
                   help="the dtype gradients and parameters travel in: float32, bfloat16 or "
                        "float16 (the ps keeps float32 parameters and optimizer slots)")
    g.add_argument("--bucket-bytes", type=int, default=_TRAINING["bucket_bytes"],
                   help="push gradients per ps in buckets of about this many bytes, last "
                        "layers first, pipelined on the ps (0: one frame per ps; default: "
                        f"{TrainingConfig().bucket_bytes >> 20} MiB; with --aggregate-per-node: 0)")
    g.add_argument("--log-device-placement", action="store_true",
                   help="print which rank runs which task, and (the chief) which ps task "
                        "holds each variable and slice")
    g.add_argument("--export", default=None,
                   help="after training, the chief writes every variable to this .npz (its "
                        "directory must exist and be writable: checked before training)")
    d = parser.add_argument_group("devices")
    d.add_argument("--device", choices=("auto", "cpu", "gpu"), default="cpu",
                   help="where variables and gradients live: 'auto' takes a GPU (local rank "
                        "modulo visible devices) when CuPy and CUDA are there (default: cpu)")
    d.add_argument("--allow-soft-placement", action="store_true",
                   help="fall back to the CPU, saying so once, when --device=gpu cannot be had")
    d.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="cap each rank's CuPy memory pool at this fraction of its GPU "
                        "(per_process_gpu_memory_fraction)")
    d.add_argument("--no-allow-growth", dest="allow_growth", action="store_false",
                   help="with --gpu-memory-fraction, allocate that much once at start")
    return parser


def setup_backend(args, server):
    """Choose this rank's array backend from the flags, make it current, log it on rank 0."""
    import logging

    from ..runtime.backend import describe_backend, select_backend, set_backend

    be = select_backend(args.device, server.local_rank, rank=server.rank,
                        allow_soft_placement=args.allow_soft_placement,
                        memory_fraction=args.gpu_memory_fraction,
                        allow_growth=args.allow_growth)
    set_backend(be)
    if server.rank == 0 and args.device != "cpu":
        logging.getLogger("mpitf").info("%s", describe_backend(be))
    return be


def resolve_cluster(args, world_size):
    """Return the cluster the flags describe; its errors are the same on every rank.

    With ``--evaluator`` (the --num-ps form only) the highest rank is an evaluator task.
    """
    try:
        if getattr(args, "evaluator", False):
            from .side_tasks import evaluator_cluster

            return evaluator_cluster(args, world_size)
        return cluster_from_args(args, world_size)
    except MpitfError as exc:
        raise collective(exc) from None


def check_roles(args, server):
    """Check --job_name/--task_index on every rank; raise one error for the whole job."""
    try:
        check_claimed_role(args, server.job_name, server.task_index, rank=server.rank)
        problem = None
    except ConfigurationError as exc:
        problem = str(exc)
    problems = [p for p in server.comm.allgather(problem) if p]
    if problems:
        others = len(problems) - 1
        more = "" if not others else (
            f" (and {others} more rank{'s disagree' if others > 1 else ' disagrees'})")
        raise collective(ConfigurationError(problems[0] + more))


def config_from_args(args):
    """Return the :class:`~mpitf.config.JobConfig` of the parsed flags, checked.

    Call it on every rank right after parsing: it is pure, so a bad value fails alike on
    every rank, and the error is collective (rank 0 prints it once, every rank exits 2).
    """
    try:
        return JobConfig.from_args(args)
    except ConfigurationError as exc:
        raise collective(exc) from None


def claim_checkpoint_dir(server, root):
    """The chief takes ``root``'s lock (creating it) before anything is read or written there.

    A directory that is a file, cannot be written, or is owned by another live job is one
    message on rank 0 and exit 2 on every rank; nothing in it is touched.
    """
    import logging

    from ..ckpt.lock import acquire
    from ..errors import CheckpointError

    problem = None
    if server.rank == chief_rank(server):
        try:
            acquire(root, log=logging.getLogger("mpitf").warning)
        except CheckpointError as exc:  # handed to every rank just below
            problem = exc
    raise_shared(server.comm, problem)


def check_inputs(config, comm, chief=0, num_shards=1, batch_size=None, check_data=None):
    """Check the data file and --timeline (rank 0) and the chief's output paths, up front.

    One rank looks at each and every rank learns the outcome, so a missing file, bad labels,
    a batch larger than a worker's shard (``num_shards`` workers of ``batch_size``, default
    the configuration's) or an unwritable ``--run-dir``/``--export``/``--timeline`` give one
    message and every rank exits 2, before training (not after it, losing the result).
    ``chief`` (the chief replica's rank) writes the run directory and the export;
    ``check_data`` (default: ``check_file``) checks the job's data format. Returns the path.
    """
    from ..data.datasets import default_data_path, ensure_digits
    from ..data.sharded import check_file

    path = config.data or default_data_path()
    rank, problem = comm.Get_rank(), None
    try:
        if rank == 0:
            (check_data or check_file)(ensure_digits(path) if not config.data else path,
                                       batch_size=batch_size or config.training.batch_size,
                                       num_shards=num_shards)
            if config.training.timeline:
                _check_writable_dir("--timeline", config.training.timeline,
                                    os.path.dirname(os.path.abspath(config.training.timeline)))
        if rank == chief:
            check_output_paths(config)
    except (MpitfError, OSError) as exc:  # handed to every rank just below
        problem = exc
    raise_shared(comm, problem)
    return path


def raise_shared(comm, problem):
    """Raise on every rank the first problem any rank of ``comm`` found (None: none).

    Collective: each rank passes what it found, so a check made by one rank ends every
    rank alike, with one message (rank 0's) and exit 2.
    """
    problems = [p for p in comm.allgather(problem) if p is not None]
    if problems:
        raise collective(problems[0])


def _refuse(flag, path, cause):
    raise ConfigurationError(f"{flag} {path}: {cause}; choose another path or fix it first")


def _check_writable_dir(flag, path, target):
    """Raise unless ``target`` is, or could be made as, a directory this process can write."""
    probe = os.path.abspath(target)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        _refuse(flag, path, f"{probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        _refuse(flag, path, f"directory {probe} is not writable (permissions or a read-only "
                            "file system)")


def check_output_paths(config):
    """Raise ConfigurationError naming the path unless --run-dir and --export can be written.

    Nothing is created: the run directory is made when the first line is logged and the
    export is written after training (``np.savez`` adds ``.npz``; its directory must exist).
    """
    run_dir = config.training.run_dir
    if run_dir:
        _check_writable_dir("--run-dir", run_dir, run_dir)
    export = config.export
    if export:
        target = os.path.abspath(export if export.endswith(".npz") else export + ".npz")
        if os.path.isdir(target):
            _refuse("--export", export, f"{target} is a directory")
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            _refuse("--export", export, f"directory {parent} does not exist")
        _check_writable_dir("--export", export, parent)
        if os.path.exists(target) and not os.access(target, os.W_OK):
            _refuse("--export", export, f"{target} exists and is not writable")


def optimizer_from_config(config):
    """Build the optimizer a :class:`~mpitf.config.JobConfig` asks for."""
    from ..ps.optimizers import ExponentialDecay, make_optimizer

    lr = config.lr
    if config.lr_decay is not None:
        lr = ExponentialDecay(config.lr, config.lr_decay_steps, config.lr_decay)
    return make_optimizer(config.optimizer, lr)


def model_from_config(config, x_dim, num_classes, image_shape=None):
    """Build the reference model a :class:`~mpitf.config.JobConfig` asks for, sized for the data."""
    from ..models import build_model

    cnn = config.model == "cnn"
    return build_model(config.model, x_dim, num_classes or 10,
                       image_shape=tuple(image_shape) if cnn and image_shape is not None
                       else None,
                       **({} if cnn else {"hidden": (config.hidden,)}))


def session_from_config(server, model, config, dataset, log_device_placement=False,
                        **overrides):
    """Start the TrainingSession of ``config.training`` (``overrides`` win over it).

    The batch size is the data set's (a tower job's batch spans its towers).
    """
    from ..worker.session import TrainingSession

    batch_size = getattr(dataset, "batch_size", config.training.batch_size)
    sess = TrainingSession(server, model, optimizer_from_config(config), dataset=dataset,
                           config=config.training, batch_size=batch_size, **overrides)
    if log_device_placement and server.is_chief:
        print(sess.placement.describe(), flush=True)
    return sess


def start_job(args, config, check_cluster=None, check_data=None):
    """Start this rank's part of a job: cluster, Server, backend, data; return both.

    ``args`` are the parsed flags (cluster and devices), ``config`` their
    :class:`~mpitf.config.JobConfig` (see :func:`config_from_args`).
    ``check_cluster(cluster)`` may refuse a cluster; every error here is alike on every rank.
    """
    from mpi4py import MPI

    from ..runtime.server import Server

    setup_logging()
    world = MPI.COMM_WORLD
    cluster = resolve_cluster(args, world.Get_size())
    try:
        check_training_cluster(cluster, config.training.checkpoint_dir)
        if check_cluster is not None:
            check_cluster(cluster)
    except MpitfError as exc:
        raise collective(exc) from None
    server = Server(cluster, deadline=config.deadline, fixed_deadline=config.fixed_deadline)
    check_roles(args, server)
    if args.log_device_placement:
        server.describe()  # rank 0 prints the rank -> task -> host table
    backend = setup_backend(args, server)
    if config.training.aggregate_per_node:  # before training, one message, every rank
        from ..worker.node import aggregation_problem
        raise_shared(server.comm, aggregation_problem(server, config.training, backend))
    if config.training.wire_dtype != "float32":  # a 16-bit wire converts in host memory
        from ..wire.dtypes import host_problem
        raise_shared(server.comm, host_problem(config.training.wire_dtype, backend.name))
    path = check_inputs(config, server.comm, chief_rank(server),
                        num_shards=server.num_replicas, check_data=check_data)
    if config.training.checkpoint_dir:
        claim_checkpoint_dir(server, config.training.checkpoint_dir)
    return server, path


def chief_rank(server):
    """Return the rank of the chief replica (see ``Server.is_chief``): it writes the outputs."""
    return server.replica_ranks[0]
