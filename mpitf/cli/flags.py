"""The training flags every job shares, with the TensorFlow example scripts' names kept."""

import os

from ..cluster import add_cluster_arguments
from ..cluster.flags import check_claimed_role, cluster_from_args
from ..cluster.roles import check_training_cluster
from ..config import JobConfig
from ..errors import ConfigurationError, MpitfError
from ..options import add_flags, values_from_args
from ..runtime.exits import collective, setup_logging


def add_training_arguments(parser, steps=None, batch_size=None, lr=None):
    """Add data, optimiser, consistency, checkpoint, logging and device flags to ``parser``.

    The flags are the options of :class:`~mpitf.config.JobConfig` (names, defaults and help
    written there, once); ``steps``, ``batch_size`` and ``lr`` give a job's own defaults.
    Build the configuration from the parsed flags with :func:`config_from_args`, which
    checks every value.
    """
    add_cluster_arguments(parser)
    return add_flags(parser, JobConfig,
                     defaults=dict(last_step=steps, batch_size=batch_size, lr=lr))


def add_growth_arguments(parser):
    """Add ``--dynamic-tables`` and the flags of :class:`~mpitf.tables.growth.Growth`."""
    from ..tables.growth import Growth

    parser.add_argument("--dynamic-tables", action="store_true",
                        help="tables that grow: ids are raw int64 (any value), a ps makes a "
                             "row when an id is admitted (the flags below)")
    add_flags(parser, Growth)


def growth_from_args(args):
    """Return the tables' Growth with --dynamic-tables, else None (refusing its flags)."""
    from ..tables.growth import Growth

    growth = Growth(**values_from_args(Growth, args))
    if not args.dynamic_tables and growth != Growth():
        raise collective(ConfigurationError(
            "--admit-min-count, --admit-probability, --evict-after-steps, --table-capacity "
            "and --evict-every are for tables that grow: add --dynamic-tables"))
    return growth if args.dynamic_tables else None


def setup_backend(args, server, comm=None):
    """Choose this rank's array backend from the flags, make it current, log it on rank 0.

    Collective over ``comm`` (default ``server.comm``): a rank that cannot have the device
    it asked for (``--device gpu`` without a working CuPy and GPU) ends every rank with one
    message and exit 2.
    """
    import logging

    from ..runtime.backend import describe_backend, select_backend, set_backend

    be, problem = None, None
    try:
        be = select_backend(args.device, server.local_rank, rank=server.rank,
                            allow_soft_placement=args.allow_soft_placement,
                            memory_fraction=args.gpu_memory_fraction,
                            allow_growth=args.allow_growth)
    except ConfigurationError as exc:  # handed to every rank just below
        problem = exc
    raise_shared(server.comm if comm is None else comm, problem)
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
    from ..ps.optimizers import make_optimizer
    from ..ps.schedules import ExponentialDecay

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


def start_job(args, config, check_cluster=None, check_data=None, tables=False):
    """Start this rank's part of a job: cluster, Server, backend, data; return both.

    ``args`` are the parsed flags (cluster and devices), ``config`` their
    :class:`~mpitf.config.JobConfig` (see :func:`config_from_args`); ``tables``: the job's
    model has embedding tables. ``check_cluster(cluster)`` may refuse a cluster; every
    error here is alike on every rank.
    """
    from mpi4py import MPI

    from ..runtime import heal
    from ..runtime.server import Server

    setup_logging()
    cluster = resolve_cluster(args, heal.world_size())
    try:
        check_training_cluster(cluster, config.training.checkpoint_dir)
        if check_cluster is not None:
            check_cluster(cluster)
    except MpitfError as exc:
        raise collective(exc) from None
    server = Server(cluster, deadline=config.deadline, fixed_deadline=config.fixed_deadline)
    if server.replacement is not None:  # spawned for a lost rank: the job's checks passed
        setup_backend(args, server, MPI.COMM_SELF)
        return server, check_inputs(config, MPI.COMM_SELF, chief=None,  # the job's own check
                                    num_shards=server.num_replicas, check_data=check_data)
    check_roles(args, server)
    if args.log_device_placement:
        server.describe()  # rank 0 prints the rank -> task -> host table
    backend = setup_backend(args, server)
    from .facts import check_options

    check_options(config.training, server, backend, tables)
    path = check_inputs(config, server.comm, chief_rank(server),
                        num_shards=server.num_replicas, check_data=check_data)
    if config.training.checkpoint_dir:
        claim_checkpoint_dir(server, config.training.checkpoint_dir)
    return server, path


def chief_rank(server):
    """Return the rank of the chief replica (see ``Server.is_chief``): it writes the outputs."""
    return server.replica_ranks[0]
