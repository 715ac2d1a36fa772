"""The facts a job's options are checked against, gathered once on every rank."""

from ..config import JobFacts
from ..errors import ConfigurationError
from ..runtime.exits import collective
from ..worker.node import nodes_problem


def check_options(training, server, backend, tables=False):
    """Check the options of ``training`` against this job's facts, once on every rank.

    Collective over ``server.comm``: the ranks share their backends (and, to aggregate per
    node, their memory domains), so :meth:`~mpitf.config.TrainingConfig.check_job` sees
    the same facts everywhere and a refusal is one message (rank 0's), exit 2 on each rank.
    """
    names = server.comm.allgather(backend.name)
    facts = JobFacts(
        num_ps=len(server.ranks_of("ps")), num_replicas=server.num_replicas, ulfm=server.ulfm,
        tables=tables, backends=tuple(sorted(set(names))),
        replica_backends=tuple(sorted({names[r] for r in server.replica_ranks})),
        nodes_problem=nodes_problem(server) if training.aggregate_per_node else None)
    try:
        training.check_job(facts)
    except ConfigurationError as exc:
        raise collective(exc) from None
