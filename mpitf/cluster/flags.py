"""A job's cluster from its flags and environment, and the role each rank was told to run.

The cluster comes from the first of: ``--cluster_spec``; ``--ps_hosts/--worker_hosts``;
the ``cluster`` of TF_CONFIG; the Slurm job step when the MPI world is that step's tasks
(srun); ``--num-ps`` and the world size. A role claim (``--job_name/--task_index``, the
``task`` of TF_CONFIG) is checked against the role the rank runs, which comes from its
MPI rank (:mod:`mpitf.cluster.roles`).
"""

import json
import os

from mpitf.cluster.resolvers import SlurmClusterResolver, TFConfigClusterResolver
from mpitf.cluster.spec import ClusterSpec
from mpitf.errors import ConfigurationError

__all__ = ["add_cluster_arguments", "check_claimed_role", "claimed_roles", "cluster_from_args"]

_CLUSTER_FLAGS = ("cluster_spec", "ps_hosts", "worker_hosts")


def _in_slurm_step(env, world_size):
    """Return True when the MPI world is the tasks of the current Slurm job step (srun).

    The batch shell of a job has no ``SLURM_STEP_*`` variables, and ranks that mpiexec
    starts inside an allocation see a step of another size (its launcher's), so both
    fall through to ``--num-ps`` and the world size.
    """
    names = ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
    return all(str(env.get(n) or "").strip() for n in names) and str(
        env.get("SLURM_STEP_NUM_TASKS") or "").strip() == str(world_size)


def cluster_from_args(args, world_size, env=os.environ):
    """Resolve the cluster spec from flags, TF_CONFIG, Slurm, or --num-ps and the world size.

    A TF_CONFIG without a cluster (``{}``: TensorFlow's empty spec) leaves the cluster to
    what follows it. Under srun the spec is `SlurmClusterResolver`'s with ``--num-ps`` ps
    and the other tasks workers: real host names and ports, each task pinned to its node.
    A spec with a worker job but no ps job gets an empty ps job: it trains without ps.
    """
    spec = _resolve(args, world_size, env)
    if "worker" in spec.jobs and "ps" not in spec.jobs:
        spec = ClusterSpec({"ps": [], **spec.as_dict()})
    return spec


def _resolve(args, world_size, env):
    spec_flag, ps_hosts, worker_hosts = (getattr(args, f, None) for f in _CLUSTER_FLAGS)
    # A flag given empty ('') is an error, never "not given": it would train with defaults.
    if spec_flag is not None and (ps_hosts is not None or worker_hosts is not None):
        raise ConfigurationError(
            "--cluster_spec and --ps_hosts/--worker_hosts both given: pass only one of them")
    if spec_flag is not None:
        return ClusterSpec.from_string(spec_flag)
    if ps_hosts is not None and worker_hosts is None:
        raise ConfigurationError("--ps_hosts needs --worker_hosts: give both")
    if worker_hosts is not None:
        return ClusterSpec.from_hosts(ps_hosts, worker_hosts)
    spec = TFConfigClusterResolver(env=env).cluster_spec()
    if spec:
        return spec
    num_ps = getattr(args, "num_ps", 1)
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise ConfigurationError(f"bad --num-ps={num_ps!r}: expecting an integer >= 0")
    if num_ps >= world_size:
        raise ConfigurationError(
            f"--num-ps={num_ps} needs more MPI ranks than the world's {world_size}"
            f" (num_ps ps and at least one worker): run with mpiexec -n {num_ps + 1}"
            " or more, or lower --num-ps (0 trains locally)")
    if _in_slurm_step(env, world_size):
        jobs = {"ps": num_ps, "worker": world_size - num_ps}
        return SlurmClusterResolver(jobs, gpus_per_node=0, auto_set_gpu=False,
                                    env=env).cluster_spec()
    return ClusterSpec.from_counts(num_ps, world_size - num_ps)


def claimed_roles(args, env=os.environ):
    """Return the roles this rank was told to run: ``[(source, job, index)]``.

    The sources are ``--job_name/--task_index`` and, when no cluster flag is given, the
    ``task`` entry of TF_CONFIG; either may leave out the job or the index (None).
    """
    claims = []
    job, task = getattr(args, "job_name", None), getattr(args, "task_index", None)
    if job is not None or task is not None:
        claim = " ".join(f"--{k}={v}" for k, v in (("job_name", job), ("task_index", task))
                         if v is not None)
        claims.append((claim, job, task))
    if all(getattr(args, f, None) is None for f in _CLUSTER_FLAGS):
        resolver = TFConfigClusterResolver(env=env)
        job, task = resolver.task_type, resolver.task_id
        if job is not None or task is not None:
            entry = {k: v for k, v in (("type", job), ("index", task)) if v is not None}
            claims.append((f"TF_CONFIG task {json.dumps(entry)}", job, task))
    return claims


def check_claimed_role(args, job, task_index, rank=None, env=os.environ):
    """Raise if --job_name/--task_index or TF_CONFIG's task disagree with this rank's role.

    A claim without a job or an index agrees with any: ``{"type": "worker"}`` holds on
    every worker task.
    """
    for claim, claimed_job, claimed_task in claimed_roles(args, env):
        if (claimed_job is None or claimed_job == job) and (
                claimed_task is None or claimed_task == task_index):
            continue
        who = "this MPI rank" if rank is None else f"MPI rank {rank}"
        raise ConfigurationError(
            f"{claim} but {who} runs /job:{job}/task:{task_index}; roles come from the MPI "
            "rank (see mpitf.cluster.roles for the mapping policy): drop the claim or fix the spec")


def add_cluster_arguments(parser):
    """Add the cluster flags of TensorFlow's example scripts to an argparse parser."""
    group = parser.add_argument_group("cluster")
    group.add_argument("--cluster_spec", "--cluster-spec", dest="cluster_spec", default=None,
                       help="cluster in flag form 'ps|host:port;...,worker|host:port;...'")
    group.add_argument("--ps_hosts", "--ps-hosts", dest="ps_hosts", default=None,
                       help="comma-separated host:port list of the ps job")
    group.add_argument("--worker_hosts", "--worker-hosts", dest="worker_hosts", default=None,
                       help="comma-separated host:port list of the worker job")
    group.add_argument("--num-ps", "--num_ps", dest="num_ps", type=int, default=1,
                       help="ps tasks when no spec is given; the other MPI ranks are workers"
                            " (default: 1)")
    group.add_argument("--job_name", "--job-name", dest="job_name", default=None,
                       help="accepted for TF scripts; checked against the role of the MPI rank")
    group.add_argument("--task_index", "--task-index", dest="task_index", type=int, default=None,
                       help="accepted for TF scripts; checked against the role of the MPI rank")
    return group
