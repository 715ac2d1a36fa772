"""The ranks of a built-in training job that do not train: the ps, the evaluator, other jobs.

A ps serves and the chief and worker tasks train; an ``evaluator`` task evaluates each
checkpoint (:class:`~mpitf.worker.evaluator.Evaluator`); a task of any other job has no
part in a built-in job, so it says so (once, for all such tasks) and exits 0.
:func:`start_replica` is how every built-in job starts: it runs the ranks that do not train
to their end and hands the training replicas back.
"""


from ..cluster import ClusterSpec
from ..cluster.flags import cluster_from_args
from ..cluster.resolvers import TFConfigClusterResolver
from ..errors import ConfigurationError
from ..runtime.timeline import Timeline


def evaluator_cluster(args, world_size):
    """Return the --num-ps form's cluster with its highest rank an evaluator task."""
    given = [f"--{k}" for k in ("cluster_spec", "ps_hosts", "worker_hosts")
             if getattr(args, k, None) is not None]
    given += ["TF_CONFIG"] if TFConfigClusterResolver().cluster_spec() else []
    if given:
        raise ConfigurationError(
            f"--evaluator makes the highest rank of the --num-ps form an evaluator, but "
            f"{given[0]} gives the cluster: add an 'evaluator' job to it instead")
    num_ps = args.num_ps or 0
    if world_size < num_ps + 2:
        raise ConfigurationError(
            f"--evaluator needs {num_ps} ps, a worker and the evaluator: run with "
            f"mpiexec -n {num_ps + 2} or more")
    spec = cluster_from_args(args, world_size - 1).as_dict()
    return ClusterSpec({**spec, "evaluator": ["localhost:0"]})


def start_replica(args, config, job, check_cluster=None, check_data=None, tables=False):
    """Start this rank's part of ``job``; return ``(server, path, exit code or None)``.

    A ps serves until training ends and an evaluator or another job's task runs its part
    (:func:`run_side_task`): their exit code comes back. A training replica (chief or
    worker) gets None and trains. The arguments are :func:`~mpitf.cli.flags.start_job`'s.
    """
    from .flags import start_job

    server, path = start_job(args, config, check_cluster, check_data, tables)
    if server.job_name == "ps":
        server.join()
        return server, path, server.exit_code
    return server, path, run_side_task(server, config, path, job)


def run_side_task(server, config, path, job):
    """Run this rank's part if it neither serves nor trains; return its exit code, else None.

    ``config`` is the job's :class:`~mpitf.config.JobConfig`, ``path`` its data file and
    ``job`` its name (for the message).
    """
    if server.job_name == "ps" or server.replica_index is not None:
        return None
    if server.job_name == "evaluator":
        code = _evaluate(server, config, path)
    else:
        idle = [r for r, (j, _) in enumerate(server.roles)
                if j not in ("ps", "evaluator") and r not in server.replica_ranks]
        if server.rank == idle[0]:
            tasks = ", ".join(f"/job:{j}/task:{t}" for j, t in (server.roles[r] for r in idle))
            print(f"{job}: {tasks} take{'s' if len(idle) == 1 else ''} no part in training "
                  "(only ps, chief, worker and evaluator tasks do); exiting 0", flush=True)
        code = 0
    timeline = config.training.timeline
    if timeline:  # collective with the training ranks' and the ps's end of training
        Timeline(server.rank, server.device, True).gather_and_write(server.comm, timeline)
    return code


def _evaluate(server, config, path):
    from ..data.sharded import ShardedDataset, load_split
    from ..worker.evaluator import Evaluator
    from .flags import model_from_config

    with ShardedDataset(path, "test", batch_size=1, prefetch=0) as data:
        model = model_from_config(config, data.x_dim, data.num_classes, data.image_shape)
    x, y = load_split(path, "test")
    return Evaluator(server, model, config.training.checkpoint_dir, x, y,
                     config.training.run_dir).run()
