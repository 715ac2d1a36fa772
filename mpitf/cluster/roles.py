"""Map MPI ranks onto the tasks of a cluster: a pure function, the same on every rank.

Any job name runs. ``ps`` tasks serve variables; the *training replicas* are the
``chief`` task (if any; TensorFlow's TF_CONFIG convention: one task that trains, logs and
checkpoints) then the ``worker`` tasks by index, so the chief is replica 0
(:func:`training_replicas`); an ``evaluator`` task evaluates checkpoints and does not
train; a task of any other job runs the user's script with its ``Server`` and no training
role. As in TensorFlow (``multi_worker_util``), a spec has at most one ``chief`` task and
at most one ``evaluator`` task.

Rank mapping policy (:func:`assign_roles`), the same on every rank for the same input:

1. The number of MPI ranks must equal the number of tasks in the spec.
2. Nodes are the distinct processor names of the ranks, ordered by their lowest rank.
3. Jobs are taken in this order: ``ps``, ``chief``, ``worker``, every other job in the
   spec's order, ``evaluator`` last.
4. A task whose host is a real hostname is *pinned*: it must run on that node (exact
   name, or the same short name before the first ``.``). Pinned tasks are placed first,
   in the spec's job order then task order, on the lowest free rank of their node (the
   order TensorFlow's ``SlurmClusterResolver`` gives Slurm tasks, so under ``srun`` MPI
   rank r runs the task it names for ``SLURM_PROCID`` r). A task on
   ``localhost``, ``127.0.0.1`` or no host is *free*.
5. Free ps tasks come next, in task order: the i-th ps task prefers node
   ``i mod num_nodes`` (one ps per node before any node gets a second) and takes the
   lowest free rank there; if that node is full, the next node with a free rank.
6. The other free tasks fill the remaining ranks in rank order, in job order then task
   order: the chief right after the ps tasks, then the workers, then other jobs, and the
   evaluator on the highest free rank.

On one workstation ``{"ps": 1, "chief": 1, "worker": 2, "evaluator": 1}`` gives rank 0 to
the ps, rank 1 to the chief, ranks 2-3 to the workers and rank 4 to the evaluator; on
several nodes the ps tasks are spread over the nodes.
"""

from mpitf.cluster.spec import LOCAL_HOSTS, ClusterSpec, split_address
from mpitf.errors import ConfigurationError

__all__ = ["assign_roles", "check_training_cluster", "describe_roles", "job_order",
           "training_replicas"]

_SINGLE = ("chief", "evaluator")  # TensorFlow allows at most one task of these jobs


def _tasks_of(cluster, job):
    return cluster.task_indices(job) if job in cluster.jobs else []


def job_order(cluster):
    """Return the cluster's jobs in placement order: ps, chief, worker, others, evaluator."""
    first = [j for j in ("ps", "chief", "worker") if j in cluster.jobs]
    others = [j for j in cluster.jobs if j not in ("ps", "chief", "worker", "evaluator")]
    return first + others + (["evaluator"] if "evaluator" in cluster.jobs else [])


def training_replicas(cluster):
    """Return the (job, task) of each training replica: the chief, then workers by index."""
    cluster = ClusterSpec(cluster)
    return [(job, i) for job in ("chief", "worker") for i in _tasks_of(cluster, job)]


def check_training_cluster(cluster, checkpoint_dir=None):
    """Raise ConfigurationError if ``cluster`` cannot train (no chief or worker task).

    A cluster with an evaluator task also needs ``checkpoint_dir``, which it watches.
    """
    cluster = ClusterSpec(cluster)
    if not training_replicas(cluster):
        jobs = ", ".join(f"{j} ({cluster.num_tasks(j)})" for j in cluster.jobs) or "none"
        raise ConfigurationError(
            f"training needs a chief or worker task, but the cluster has none (jobs: {jobs}):"
            " add a 'worker' (or 'chief') job to the spec")
    if _tasks_of(cluster, "evaluator") and not checkpoint_dir:
        raise ConfigurationError(
            "the cluster has an evaluator task, which evaluates checkpoints, but no "
            "checkpoint directory is set: give --checkpoint-dir (and --checkpoint-every)")


def _check_single_tasks(cluster):
    for job in _SINGLE:
        count = len(_tasks_of(cluster, job))
        if count > 1:
            raise ConfigurationError(
                f"the cluster spec has {count} {job!r} tasks: TensorFlow allows at most one"
                f" {job} task; keep one and move the others to 'worker'")


def _node_of(host, nodes, task):
    """Return the index of the node a pinned host names, or None for a free task."""
    if host.lower() in LOCAL_HOSTS:
        return None
    names = [n.lower() for n in nodes]
    if host.lower() in names:
        return names.index(host.lower())
    short = [n.split(".")[0] for n in names]
    if host.lower().split(".")[0] in short:
        return short.index(host.lower().split(".")[0])
    raise ConfigurationError(
        f"{task} is pinned to host {host!r}, but no MPI rank runs there; the ranks run on"
        f" {', '.join(nodes)}: fix the host, or use 'localhost' to let mpitf place the task")


def assign_roles(cluster, rank_hosts):
    """Map each MPI rank to its (job, task_index) by the module's documented policy.

    Args:
        cluster: the `ClusterSpec`.
        rank_hosts: ``rank_hosts[r]`` is the processor name of MPI rank r.

    Returns:
        A list of (job, task_index), one per rank.
    """
    cluster = ClusterSpec(cluster)
    _check_single_tasks(cluster)
    size = len(rank_hosts)
    if size != cluster.total_tasks:
        counts = ", ".join(f"{cluster.num_tasks(j)} {j}" for j in cluster.jobs)
        raise ConfigurationError(
            f"the cluster spec has {cluster.total_tasks} tasks ({counts}) but the MPI world"
            f" has {size} ranks: run with mpiexec -n {cluster.total_tasks} or change the spec")
    nodes = list(dict.fromkeys(rank_hosts))
    free = [[r for r in range(size) if rank_hosts[r] == n] for n in nodes]  # ascending
    roles = [None] * size
    tasks = [(job, i, _node_of(split_address(cluster.task_address(job, i))[0], nodes,
                               f"/job:{job}/task:{i}"))
             for job in job_order(cluster) for i in cluster.task_indices(job)]
    # Pinned tasks first, in the spec's job order: the order TensorFlow's SlurmClusterResolver
    # gives Slurm tasks, so MPI rank r (srun's SLURM_PROCID r) runs the task it names for r.
    spec_order = {job: k for k, job in enumerate(cluster.jobs)}
    for job, i, node in sorted(tasks, key=lambda t: spec_order[t[0]]):
        if node is not None:
            if not free[node]:
                raise ConfigurationError(
                    f"/job:{job}/task:{i} is pinned to {nodes[node]!r}, which has no free rank"
                    f" left ({len([h for h in rank_hosts if h == nodes[node]])} ranks):"
                    " start more ranks there or pin fewer tasks to it")
            roles[free[node].pop(0)] = (job, i)
    ps_order = {i: k for k, (job, i, _) in enumerate(t for t in tasks if t[0] == "ps")}
    for job, i, node in tasks:
        if job == "ps" and node is None:
            start = ps_order[i] % len(nodes)
            node = next(n % len(nodes) for n in range(start, start + len(nodes))
                        if free[n % len(nodes)])
            roles[free[node].pop(0)] = (job, i)
    open_ranks = sorted(r for ranks in free for r in ranks)
    rest = [(job, i) for job, i, node in tasks if job != "ps" and node is None]
    for rank, role in zip(open_ranks, rest):
        roles[rank] = role
    return roles


def describe_roles(roles, rank_hosts):
    """Return a text table of rank -> /job:x/replica:0/task:i -> host."""
    names = [f"/job:{job}/replica:0/task:{i}" for job, i in roles]
    rank_w = max(len("rank"), len(str(len(roles) - 1)))
    name_w = max([len("task")] + [len(n) for n in names])
    lines = [f"{'rank':>{rank_w}}  {'task':<{name_w}}  host"]
    for r, (name, host) in enumerate(zip(names, rank_hosts)):
        lines.append(f"{r:>{rank_w}}  {name:<{name_w}}  {host}")
    return "\n".join(lines)
