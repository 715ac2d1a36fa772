"""How a node's cores are shared among its ranks: each rank's share, decided here only.

Several ranks on a node that each take every core (torch's threads, XLA's pool, the ps's
kernel threads) only take turns. So each gets ``cores // ranks on its node``, at least 1:
the cores this process may use (its affinity mask), divided by the ranks the gathered host
names place on its node, or, before MPI has started (XLA sizes its pool at the first
computation), by the ranks the launcher says it started there.
"""

import os

__all__ = ["launcher_local_ranks", "node_share", "ranks_on_host", "usable_cores"]

# What launchers tell a rank about its node: MPICH/Hydra, Open MPI, MVAPICH, Slurm's srun.
_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
               "SLURM_NTASKS_PER_NODE")


def usable_cores():
    """Return the cores this process may run on (its affinity mask, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def ranks_on_host(hosts, rank):
    """Return how many ranks share ``rank``'s host (``hosts``: a server's host per rank)."""
    return hosts.count(hosts[rank])


def launcher_local_ranks(environ=os.environ):
    """Return how many ranks the launcher started on this node (1 when it does not say)."""
    for key in _LOCAL_SIZE:
        text = environ.get(key, "")
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def node_share(ranks):
    """Return this rank's share of its node's cores among ``ranks`` ranks there (at least 1)."""
    return max(1, usable_cores() // max(1, ranks))
