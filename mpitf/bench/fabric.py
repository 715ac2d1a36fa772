"""The fabric's latency and bandwidth: a ping-pong between two ranks, written for the planner.

Run across two nodes of an allocation, one rank per node:
    srun -N 2 --ntasks-per-node=1 python -m mpitf.bench.fabric --json fabric.json
    mpiexec -n 2 -host nodeA,nodeB python -m mpitf.bench.fabric --json fabric.json
(``mpitf bench --suite fabric`` runs it on two ranks of the launcher.)

Rank 0 sends B bytes, rank 1 sends them back; the one-way time is half the median round
trip. A least-squares fit of ``time = latency + bytes / bandwidth`` over the sizes gives
the two figures ``mpitf bench --plan --fabric FILE`` reads. Two ranks on one node measure
shared memory, not the network: the file says so (``same_node``).
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

FULL_SIZES = [8 << (2 * k) for k in range(12)]  # 8 B .. 32 MiB
QUICK_SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 8 << 20]


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the fabric file here (rank 0)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--reps", type=int, default=None, help="timed round trips per size")
    return p.parse_args(argv)


def pingpong(comm, nbytes, reps):
    """Return rank 0's median one-way seconds for ``nbytes`` (rank 1: None)."""
    import numpy as np
    from mpi4py import MPI

    buf = np.ones(max(nbytes, 1), np.uint8)[:nbytes]
    rank, times = comm.Get_rank(), []
    for i in range(reps + 3):  # three warm-up trips
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send([buf, MPI.BYTE], 1, 7)
            comm.Recv([buf, MPI.BYTE], 1, 8)
        elif rank == 1:
            comm.Recv([buf, MPI.BYTE], 0, 7)
            comm.Send([buf, MPI.BYTE], 0, 8)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times) if rank == 0 else None


def main(argv=None):
    """Measure, fit and write the fabric file (rank 0); other ranks past 1 only wait."""
    from mpi4py import MPI

    from .costmodel import fit_alpha_beta

    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise SystemExit("fabric: needs two ranks (one per node: srun -N 2 "
                         "--ntasks-per-node=1, or mpiexec -n 2 -host a,b)")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    hosts = comm.allgather(socket.gethostname())[:2]
    rows = []
    for nbytes in sizes:
        reps = args.reps or max(5, min(1000 if not args.quick else 200,
                                       (256 << 20) // max(nbytes, 1 << 16)))
        t = pingpong(comm, nbytes, reps)
        if comm.Get_rank() == 0:
            rows.append(dict(bytes=nbytes, one_way_s=t, reps=reps))
            print(f"{nbytes:>10} B  {t * 1e6:10.2f} us one way  "
                  f"{nbytes / t / 1e9:7.3f} GB/s", flush=True)
    if comm.Get_rank() != 0:
        return 0
    latency, beta, err = fit_alpha_beta([r["bytes"] for r in rows],
                                        [r["one_way_s"] for r in rows])
    out = dict(suite="fabric", latency_s=latency,
               bytes_per_s=1.0 / beta if beta > 0 else float("inf"), max_fit_error=err,
               hosts=hosts, same_node=hosts[0] == hosts[1], results=rows,
               mpi_library=MPI.Get_library_version().strip().splitlines()[0],
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               loadavg=os.getloadavg(), argv=sys.argv[1:])
    print(f"fabric: latency {latency * 1e6:.2f} us, bandwidth {out['bytes_per_s'] / 1e9:.2f} "
          f"GB/s per direction between {hosts[0]} and {hosts[1]}"
          + (" (one node: shared memory, not the network)" if out["same_node"] else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def run():
    """Entry point of ``python -m mpitf.bench.fabric``: every rank ends on an error."""
    from mpitf.runtime.exits import run_job

    run_job(main)


if __name__ == "__main__":
    run()
