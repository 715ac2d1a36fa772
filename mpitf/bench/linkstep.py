"""One configuration's training step over links: mpitf's push+pull against MPI_Iallreduce.

Run under the launcher with W + P ranks (``--num-ps P``), one per node or the ps beside
the workers (``mpitf.bench.boxscaling`` chooses the hosts):

    mpiexec -n 8 -hosts n1,...,n8 python -m mpitf.bench.linkstep --num-ps 4 --json out.json

Each step is a worker's *emulated compute* (a fixed wait, not arithmetic: a third of it
"forward", then "backward" in eight equal parts, each finishing an eighth of the model's
variables, last layers first), then the exchange of the model's gradient. So eight workers
on a machine of two cores measure communication, not the cores' contention. mpitf pushes
each bucket as backward finishes it (``Client.start_push``; its progress thread moves them
while the worker waits) to the ps tasks (sync, SGD) and takes the parameters back; the
peer, in the same run and on the same workers, sums the same bytes with ``MPI_Iallreduce``
in buckets started as backward finishes them (Horovod's way, the MPI library's own
algorithms; the wait polls the requests every ``POLL_SECONDS``, as Horovod's background
thread does) and applies SGD on every worker. The two alternate block by block, in rounds,
so a slow spell of the machine hits both. A step's time is the slowest worker's.
"""

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpitf.config import LINK_BUCKET_BYTES, TrainingConfig
from mpitf.placement import Placement
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.service import serve
from mpitf.runtime.exits import run_job
from mpitf.runtime.server import Server
from mpitf.worker.client import Client

from .scaling import write_json

LR = 1e-3
LAYERS = 8  # backward finishes the model in this many equal parts
FORWARD_SHARE = 1.0 / 3.0  # of the emulated compute: forward, before any bucket is final
POLL_SECONDS = 0.0005  # the allreduce's progress: as often as mpitf's progress thread
# The peer's buckets: its best of 1, 4 and 16 MiB on the box (benchmarks/README.md).
ALLREDUCE_BUCKET_BYTES = 1 << 20


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-ps", type=int, default=1, help="ps tasks (the rest are workers)")
    p.add_argument("--sizes", default=str(4 << 20), help="model sizes in bytes, comma-separated")
    p.add_argument("--compute-ms", default="0",
                   help="emulated compute per step, milliseconds, comma-separated; 'link' is "
                        "the model's bytes at --link-bytes-per-s (about one push+pull)")
    p.add_argument("--link-bytes-per-s", type=float, default=None,
                   help="a link's payload rate, for --compute-ms link")
    p.add_argument("--bucket-bytes", default=str(LINK_BUCKET_BYTES),
                   help="mpitf's buckets per ps, comma-separated sizes each measured "
                        "(default: training's across nodes)")
    p.add_argument("--allreduce-bucket-bytes", type=int, default=ALLREDUCE_BUCKET_BYTES,
                   help="the peer's buckets (default 1 MiB)")
    p.add_argument("--variable-bytes", type=int, default=128 << 10,
                   help="the model's variables are this big (default 128 KiB)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (each: both)")
    p.add_argument("--systems", default="mpitf,allreduce", help="what to measure")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds before giving up")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    buckets = [int(b) for b in args.bucket_bytes.split(",")]
    args.systems = [(name, b) for name in args.systems.split(",")
                    for b in (buckets if name == "mpitf" else [args.allreduce_bucket_bytes])]
    args.computes = []
    for text in args.compute_ms.split(","):
        if text == "link":
            if not args.link_bytes_per_s:
                raise SystemExit("linkstep: --compute-ms link needs --link-bytes-per-s")
            args.computes.append(None)  # per size
        else:
            args.computes.append(float(text) / 1e3)
    return args


def compute_seconds(compute, nbytes, args):
    """Return the emulated compute of a step: given, or the model's bytes at the link rate."""
    return nbytes / args.link_bytes_per_s if compute is None else compute


def emulated_wait(seconds, poll=None):
    """Wait ``seconds`` (the emulated compute), calling ``poll()`` every POLL_SECONDS."""
    end = time.perf_counter() + seconds
    while True:
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, POLL_SECONDS) if poll else left)
        if poll:
            poll()


class Bench:
    """One rank's part: the ps service or a worker with its mpitf client and its peer."""

    def __init__(self, args):
        world = MPI.COMM_WORLD
        if world.Get_size() <= args.num_ps:
            raise SystemExit(f"linkstep: need more than --num-ps {args.num_ps} ranks")
        self.args = args
        self.server = Server({"ps": args.num_ps, "worker": world.Get_size() - args.num_ps},
                             deadline=args.deadline)
        self.raw = world.Dup()
        self.is_ps = self.server.job_name == "ps"
        self.workers = self.raw.Split(0 if self.is_ps else 1, world.Get_rank())
        self.worker_ranks = self.server.ranks_of("worker")
        self.num_ps = args.num_ps

    def variables(self, nbytes):
        """Return the model's float32 variables of ``--variable-bytes``, layer by layer.

        LAYERS layers, each of variables cut so that every ps holds a part of every layer.
        """
        n = nbytes // 4
        per = max(1, min(self.args.variable_bytes // 4, n // (LAYERS * self.num_ps)))
        count = n // per
        sizes = [per] * count
        sizes[-1] += n - per * count
        return [(f"v{k}", (s,), "float32") for k, s in enumerate(sizes)]

    def client_for(self, nbytes, bucket_bytes):
        """Return a worker's mpitf Client and its variables' names by layer, last first."""
        variables = self.variables(nbytes)
        placement = Placement(variables, self.num_ps)
        config = TrainingConfig(mode="sync", bucket_bytes=bucket_bytes, across_nodes=True)
        client = Client(self.server, placement, config, deadline=self.args.deadline)
        client.params_flat[...] = 0
        client.grads_flat[...] = 0
        names = [name for name, _, _ in variables]
        per_layer = -(-len(names) // LAYERS)
        return client, [names[k:k + per_layer] for k in range(0, len(names), per_layer)][::-1]

    # -- mpitf -------------------------------------------------------------------------

    def mpitf_block(self, nbytes, compute, steps, bucket_bytes):
        """Serve (ps) or time ``steps`` mpitf steps (workers); return this rank's times."""
        if self.is_ps:
            serve(self.server)
            return []
        client, layers = self.client_for(nbytes, bucket_bytes)
        client.start(make_optimizer("sgd", LR).config(), initial_values=client.params)
        times = []
        for i in range(self.args.warmup + steps):
            t0 = time.perf_counter()
            if client.bucketed_push is None:  # every shard within one bucket
                emulated_wait(compute)
                client.push_pull().wait()
            else:
                push = client.start_push()
                emulated_wait(compute * FORWARD_SHARE)
                for names in layers:
                    emulated_wait(compute * (1 - FORWARD_SHARE) / LAYERS)
                    push.final(names)
                push.wait()
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
        client.done()
        return times

    # -- the peer ----------------------------------------------------------------------

    def allreduce_block(self, nbytes, compute, steps, bucket_bytes):
        """Time ``steps`` steps of bucketed MPI_Iallreduce and SGD on the workers (ps: [])."""
        if self.is_ps:
            return []
        comm = self.workers
        n = nbytes // 4
        grad, summed, params = (np.zeros(n, np.float32) for _ in range(3))
        bucket = bucket_bytes // 4
        bucket = bucket if bucket > 0 else n
        # buckets from the end (the last layers' gradients are final first)
        cuts = [(max(0, hi - bucket), hi) for hi in range(n, 0, -bucket)]
        layer = -(-n // LAYERS)
        scale = np.float32(LR / comm.Get_size())
        times = []
        for i in range(self.args.warmup + steps):
            t0 = time.perf_counter()
            requests, started = [], 0

            def poll(requests=requests):
                if requests:
                    MPI.Request.Testall(requests)

            emulated_wait(compute * FORWARD_SHARE, poll)
            for k in range(LAYERS):
                emulated_wait(compute * (1 - FORWARD_SHARE) / LAYERS, poll)
                final_from = max(0, n - (k + 1) * layer)  # backward has finished [from, n)
                while started < len(cuts) and cuts[started][0] >= final_from:
                    lo, hi = cuts[started]
                    requests.append(comm.Iallreduce(grad[lo:hi], summed[lo:hi], MPI.SUM))
                    started += 1
            for lo, hi in cuts[started:]:
                requests.append(comm.Iallreduce(grad[lo:hi], summed[lo:hi], MPI.SUM))
            MPI.Request.Waitall(requests)
            np.multiply(summed, scale, out=summed)  # SGD on the mean, on every worker
            np.subtract(params, summed, out=params)
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
        return times


def step_times(per_rank, worker_ranks):
    """Return each step's time: the slowest worker's (a sync step ends with the last)."""
    rows = [per_rank[r] for r in worker_ranks]
    return [max(col) for col in zip(*rows)]


def main(argv=None):
    """Run every (size, compute) on both systems in alternated rounds; rank 0 writes JSON."""
    args = parse_args(argv)
    bench = Bench(args)
    rank = MPI.COMM_WORLD.Get_rank()
    blocks = {(s, c, system): [] for s in args.sizes for c in range(len(args.computes))
              for system in args.systems}
    started = time.monotonic()
    for _ in range(args.rounds):
        for nbytes in args.sizes:
            for c, compute in enumerate(args.computes):
                seconds = compute_seconds(compute, nbytes, args)
                for system in args.systems:
                    bench.raw.Barrier()
                    run = bench.mpitf_block if system[0] == "mpitf" else bench.allreduce_block
                    times = run(nbytes, seconds, args.steps, system[1])
                    gathered = bench.raw.gather(times, root=0)
                    if rank == 0:
                        blocks[(nbytes, c, system)].append(
                            step_times(gathered, bench.worker_ranks))
    if rank != 0:
        return 0
    results = []
    workers = len(bench.worker_ranks)
    for (nbytes, c, (system, bucket_bytes)), rounds in blocks.items():
        medians = [statistics.median(r) for r in rounds]
        results.append(dict(
            system=system, bytes=nbytes, workers=workers, num_ps=bench.num_ps,
            compute_s=compute_seconds(args.computes[c], nbytes, args),
            step_s=statistics.median(medians), round_medians_s=medians,
            steps=[t for r in rounds for t in r], bucket_bytes=bucket_bytes))
        print(f"{system:<9} K={bucket_bytes >> 10:>5}K W={workers} P={bench.num_ps} "
              f"{nbytes >> 20:>4} MiB "
              f"compute {results[-1]['compute_s'] * 1e3:7.1f} ms: step "
              f"{results[-1]['step_s'] * 1e3:8.1f} ms (rounds "
              f"{', '.join(f'{m * 1e3:.1f}' for m in medians)})", flush=True)
    write_json(args.json, dict(results=results, metadata=dict(
        mpi_library=MPI.Get_library_version().strip().splitlines()[0],
        hostname=socket.gethostname(), cpus=os.cpu_count(), ranks=MPI.COMM_WORLD.Get_size(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rounds=args.rounds, steps=args.steps, warmup=args.warmup, statistic="median",
        seconds=time.monotonic() - started, argv=sys.argv[1:],
        compute="emulated (a fixed wait per step)")))
    return 0


def run():
    """Run from the command line; every rank ends on an error."""
    run_job(main)


if __name__ == "__main__":
    run()
