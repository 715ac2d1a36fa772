r"""Hello, distributed TensorFlow! -- on MPI.

Every rank finds its task in the cluster and greets rank 0, which prints the placement
table and then the greetings of every task of every job, in the spec's job order then task
order. Any job name runs, as in the tutorial's two-task cluster::

    mpiexec -n 2 python jobs/hello.py --cluster_spec='local|localhost:2222;localhost:2223'

    mpiexec -n 5 python jobs/hello.py \
        --cluster_spec='ps|localhost:2222;localhost:2223,worker|localhost:2224;localhost:2225;localhost:2226'
    mpiexec -n 3 python jobs/hello.py --ps_hosts=localhost:2222 \
        --worker_hosts=localhost:2223,localhost:2224
    mpiexec -n 4 python jobs/hello.py --num-ps 2

Without a spec, one rank is a single worker and more ranks get ``--num-ps`` ps tasks
(default 1). A spec that does not fit the world, or a bad flag, ends every rank with one
message printed by rank 0; a greeting that does not come within ``--deadline`` seconds ends
the job with a message naming the silent rank.
"""

import argparse

from mpi4py import MPI

from mpitf.cli.flags import check_roles, resolve_cluster
from mpitf.cluster import add_cluster_arguments
from mpitf.config import check_deadline
from mpitf.errors import ConfigurationError
from mpitf.runtime.exits import RankParser, abort_on_error, setup_logging
from mpitf.runtime.server import Server
from mpitf.wire.protocol import TAG_CONTROL, recv_object


def parse_args(argv=None):
    parser = RankParser(description="Print which MPI rank runs which task of the cluster.")
    add_cluster_arguments(parser)
    parser.set_defaults(num_ps=None)  # resolved below: 0 on one rank, else 1
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="seconds rank 0 waits for a greeting before ending the job"
                             " (default: 60)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log mpitf's notes")
    # Test hook: this rank withholds its greeting, so tests can check the deadline.
    parser.add_argument("--drop-greeting", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        check_deadline(args.deadline)
    except ConfigurationError as exc:
        parser.error(f"argument --deadline: {exc}")
    return args


def greet(server):
    """Return this rank's greeting."""
    return (f"Hello, distributed TensorFlow! from {server.device} on "
            f"{server.host_of(server.rank)} (rank {server.rank})")


def collect_greetings(server):
    """Receive every rank's greeting on rank 0, in job then task order, within the deadline."""
    greetings = []
    for job in server.cluster.jobs:
        for rank in server.ranks_of(job):
            if rank == 0:
                greetings.append(greet(server))
                continue
            greetings.append(recv_object(server.comm, rank, TAG_CONTROL, server.deadline,
                                         lambda r=rank: server.peer(r, "the hello greeting")))
    return greetings


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.verbose)
    world = MPI.COMM_WORLD
    with abort_on_error():
        if args.num_ps is None:
            args.num_ps = 1 if world.Get_size() > 1 else 0
        cluster = resolve_cluster(args, world.Get_size())
        server = Server(cluster, deadline=args.deadline)
        check_roles(args, server)
        if server.rank == 0:
            server.describe()
            for line in collect_greetings(server):
                print(line, flush=True)
        elif server.rank == args.drop_greeting:
            server.comm.barrier()  # never completes: rank 0 gives up at the deadline
        else:
            server.comm.send(greet(server), dest=0, tag=TAG_CONTROL)
    return 0


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    raise SystemExit(main())


if __name__ == "__main__":
    run()
