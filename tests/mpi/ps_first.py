"""Start a driver's Server before it imports its framework: a ps rank never loads torch or jax.

A ps only serves; importing torch costs it ~2 s of a core, which on 2 cores delays the
workers' own start (a 3-rank launch that imports torch: 5.1-5.9 s, with the ps skipping
it: 3.5 s). Every driver of torch or jax calls :func:`serve_if_ps` before those imports.
"""

import argparse
import sys

from mpi4py import MPI

from mpitf import ClusterSpec, Server, abort_on_error


def flag(name, default):
    """Return the value of ``name`` on the command line (read before the driver's parser)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(name, type=type(default), default=default)
    return vars(parser.parse_known_args()[0])[name.lstrip("-").replace("-", "_")]


def serve_if_ps(deadline=45, sessions=1):
    """Start this rank's Server (``--num-ps`` ps tasks, default 1; the other ranks workers).

    ``deadline``: how long a rank waits on a silent peer, start-up included: a ps of
    embedding tables compiles their numba kernels before it answers anything, 20-30 s of
    a loaded core on a fresh clone's empty cache (a pull waited out 30 s once so, in a
    fresh clone's full suite); below the tests' own 60-90 s, so a hang still fails named.
    A ps serves ``sessions`` trainings in turn (the workers train that many, one after
    the other, in one launch) and exits; a worker gets the Server.
    """
    num_ps = flag("--num-ps", 1)
    with abort_on_error():
        workers = MPI.COMM_WORLD.Get_size() - num_ps
        server = Server(ClusterSpec({"ps": num_ps, "worker": workers}), deadline=deadline)
        if server.job_name == "ps":
            for _ in range(sessions):
                server.join()
                if server.exit_code:
                    break
            sys.exit(server.exit_code)
    return server
