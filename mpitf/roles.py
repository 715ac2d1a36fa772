"""Map MPI ranks onto the tasks of a cluster: a pure function, the same on every rank.

Rank mapping policy (:func:`assign_roles`), the same on every rank for the same input:

1. The number of MPI ranks must equal the number of tasks in the spec. A spec may
   hold any job, but only ``ps`` and ``worker`` tasks run so far; a spec with
   tasks in another job is refused here, and one without a worker task too.
2. Nodes are the distinct processor names of the ranks, ordered by their
   lowest rank.
3. A task whose host is a real hostname is *pinned*: it must run on that node
   (exact name, or the same short name before the first ``.``). Pinned tasks
   are placed first, ps before worker, each in task order, on the lowest free
   rank of their node. A task on ``localhost``, ``127.0.0.1`` or no host is
   *free*.
4. Free ps tasks come next, in task order: the i-th ps task prefers node
   ``i mod num_nodes`` (one ps per node before any node gets a second) and
   takes the lowest free rank there; if that node is full, the next node with
   a free rank.
5. Free worker tasks fill the remaining ranks in rank order, in task order.

On one workstation this gives ranks ``0..num_ps-1`` to the ps tasks and the rest
to the workers; on several nodes the ps tasks are spread over the nodes.
"""

from mpitf.cluster import JOBS, LOCAL_HOSTS, ClusterSpec, check_run_job, split_address
from mpitf.errors import ConfigurationError

__all__ = ["assign_roles", "describe_roles"]


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
    for job in cluster.jobs:
        if cluster.num_tasks(job):
            check_run_job(job)
    if cluster and not ("worker" in cluster.jobs and cluster.num_tasks("worker")):
        raise ConfigurationError("the cluster spec has no worker task: mpitf needs one")
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
             for job in JOBS if job in cluster.jobs for i in cluster.task_indices(job)]
    for job, i, node in tasks:  # pinned tasks first
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
    workers = [(job, i) for job, i, node in tasks if job == "worker" and node is None]
    for rank, role in zip(open_ranks, workers):
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
