"""Push+pull round trip of mpitf against raw MPI between the same ranks, size by size.

Run: mpiexec -n N python -m mpitf.bench.pushpull --num-ps P --json OUT.json [--quick]
(or mpiexec -n N python benchmarks/pushpull.py ... in a checkout)

The first P ranks' worth of tasks are ps (the cluster's own rank map decides which), the
rest workers. For each size B, interleaved in rounds so drift affects every figure alike:

* raw: every worker ``Isend``s B/P bytes to every ps and ``Irecv``s B/P back, at once;
  each ps receives from every worker, then answers each (``Waitall`` on both sides);
* mpitf: the real ps service loop (``mpitf.ps.service.serve``) configured with one
  variable of B/P bytes per ps, the workers doing ``Client.push_pull().wait()``, once
  with ``--optimizer none`` (the ps echoes its parameters) and once with SGD;
* axpy: SGD as two numpy passes on a ps's B/P bytes (the baseline of the first targets),
  and apply: SGD as the ps applies it (its fused kernel, or below 16 Ki elements its ufunc
  passes; one thread), both timed on ps task 0 on private buffers;
* per bucket size of ``--bucket-bytes K1,K2,...``: mpitf per optimizer with the push cut
  in buckets of about K bytes per ps (0: one bucket); by default the bucket size training
  uses first (``DEFAULT_BUCKET_BYTES``, 2 MiB; ``LINK_BUCKET_BYTES``, 128 KiB, where the ranks
  span nodes), then one bucket beside it. With buckets the
  model is made of ``--variable-bytes`` variables (buckets are cut between variables, a
  variable larger than a bucket into pieces), the one-bucket figures on the same ones.

``--wire-dtype float32,bfloat16`` measures each optimizer once per wire dtype in the same
rounds (B is the float32 model's bytes; a 16-bit wire moves half of them, converted on
both sides).

Every figure is a median over repetitions, after an untimed first round and a few untimed
calls per block (the first touch of fresh memory is slow). GB/s counts both directions:
2*B / time. Rank 0 writes the JSON.
"""

import argparse
import datetime
import os
import resource
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpitf.config import (
    DEFAULT_BUCKET_BYTES,
    LINK_BUCKET_BYTES,
    TrainingConfig,
    default_bucket_bytes,
)
from mpitf.placement import Placement
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.service import serve
from mpitf.runtime.exits import run_job
from mpitf.runtime.server import Server
from mpitf.worker.client import Client

from .scaling import write_json

FULL_SIZES = [4 << 10 << (2 * k) for k in range(9)]  # 4 KiB, 16 KiB, ... 256 MiB
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
LR = 1e-6
WARMUP = 2


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-ps", type=int, default=1, help="ps tasks (the rest are workers)")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated model sizes in bytes (default: 4 KiB .. 256 MiB)")
    p.add_argument("--quick", action="store_true", help="sizes up to 16 MiB, fewer repetitions")
    p.add_argument("--optimizers", default="none,sgd", help="ps optimizers to measure")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="consistency mode of the ps (default: sync)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per size (default: 2, quick: 3)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per block")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds before giving up")
    p.add_argument("--ps-threads", type=int, default=None,
                   help="kernel threads of each ps (default: the ps's own default)")
    p.add_argument("--bucket-bytes", default=None,
                   help="comma-separated bucket sizes per ps to measure, in this order (0: "
                        "one bucket; default: training's default size, then one bucket: "
                        f"{DEFAULT_BUCKET_BYTES},0, or {LINK_BUCKET_BYTES},0 where the ranks "
                        "span nodes)")
    p.add_argument("--variable-bytes", type=int, default=64 << 10,
                   help="with buckets: the model's variables are this big (default 64 KiB)")
    p.add_argument("--wire-dtype", default="float32",
                   help="comma-separated dtypes gradients and parameters travel in "
                        "(float32, bfloat16, float16), each measured in the same rounds")
    args = p.parse_args(argv)
    if args.bucket_bytes is None:  # training's default, which depends on the nodes
        hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
        args.bucket_bytes = f"{default_bucket_bytes(across_nodes=len(set(hosts)) > 1)},0"
    args.bucket_bytes = [int(b) for b in args.bucket_bytes.split(",")]
    args.wire_dtypes = args.wire_dtype.split(",")
    if args.sizes:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    else:
        args.sizes = QUICK_SIZES if args.quick else FULL_SIZES
    args.optimizers = args.optimizers.split(",")
    if args.rounds is None:
        args.rounds = 3 if args.quick else 2
    return args


def repetitions(nbytes, quick, fixed=None):
    """Return the timed repetitions per block: many for small sizes, a few for large ones."""
    if fixed:
        return fixed
    budget = 1 << 30
    low, high = (6, 2000) if quick else (5, 2000)  # small sizes: blocks of ms, not us
    return max(low, min(high, budget // max(nbytes, 1)))


def _us(seconds):
    return seconds * 1e6


def _reset_peak_rss():
    """Reset this process's peak-RSS mark (Linux ``clear_refs``); return False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Bench:
    """The state of one rank: its server, the raw-MPI communicator, and its role."""

    def __init__(self, args):
        world = MPI.COMM_WORLD
        if world.Get_size() <= args.num_ps:
            raise SystemExit(f"pushpull: need more than --num-ps {args.num_ps} ranks")
        self.args = args
        self.server = Server({"ps": args.num_ps, "worker": world.Get_size() - args.num_ps},
                             deadline=args.deadline)
        self.raw = world.Dup()  # raw traffic and barriers apart from mpitf's communicator
        self.ps_ranks = self.server.ranks_of("ps")
        self.worker_ranks = self.server.ranks_of("worker")
        self.is_ps = self.server.job_name == "ps"
        self.num_ps = len(self.ps_ranks)
        self.rss_reset = True
        self.rss_peak = 0

    # -- raw MPI ---------------------------------------------------------------------------

    def raw_block(self, nbytes, reps):
        """Time the raw Isend/Irecv round trip; return this worker's times (ps: [])."""
        share = nbytes // self.num_ps
        if self.is_ps:
            bufs = [np.ones(share, np.uint8) for _ in self.worker_ranks]
            for _ in range(WARMUP + reps):
                MPI.Request.Waitall([self.raw.Irecv([b, MPI.BYTE], r, 1)
                                     for b, r in zip(bufs, self.worker_ranks)])
                MPI.Request.Waitall([self.raw.Isend([b, MPI.BYTE], r, 2)
                                     for b, r in zip(bufs, self.worker_ranks)])
            return []
        send = [np.ones(share, np.uint8) for _ in self.ps_ranks]
        recv = [np.ones(share, np.uint8) for _ in self.ps_ranks]
        times = []
        for i in range(WARMUP + reps):
            t0 = time.perf_counter()
            reqs = [self.raw.Irecv([b, MPI.BYTE], r, 2) for b, r in zip(recv, self.ps_ranks)]
            reqs += [self.raw.Isend([b, MPI.BYTE], r, 1) for b, r in zip(send, self.ps_ranks)]
            MPI.Request.Waitall(reqs)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        return times

    # -- mpitf -----------------------------------------------------------------------------

    def client_for(self, nbytes, bucket_bytes=0, wire="float32"):
        """Return a Client with float32 variables of nbytes/P per ps (no partition copies).

        One variable per ps, or with ``--bucket-bytes`` variables of ``--variable-bytes``.
        """
        n = nbytes // 4 // self.num_ps
        per = max(1, self.args.variable_bytes // 4) if any(self.args.bucket_bytes) else n
        variables = [(f"w{p}_{k}", (min(per, n - lo),), "float32")
                     for p in range(self.num_ps) for k, lo in enumerate(range(0, n, per))]
        placement = Placement(variables, self.num_ps)
        config = TrainingConfig(mode=self.args.mode, ps_threads=self.args.ps_threads,
                                bucket_bytes=bucket_bytes, wire_dtype=wire)
        client = Client(self.server, placement, config, deadline=self.args.deadline)
        client.params_flat[...] = 0  # touch both buffers before timing
        client.grads_flat[...] = 0
        return client

    def mpitf_block(self, client, optimizer, reps):
        """Serve one configuration (ps) or time push+pull round trips on it (workers)."""
        if self.is_ps:
            self.rss_reset = _reset_peak_rss() and self.rss_reset
            serve(self.server)
            self.rss_peak = max(self.rss_peak, _peak_rss())
            return []
        client.start(make_optimizer(optimizer, LR).config(), initial_values=client.params)
        times = []
        for i in range(WARMUP + reps):
            t0 = time.perf_counter()
            client.push_pull().wait()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        client.done()
        return times

    def axpy_block(self, nbytes, reps):
        """Time SGD on one ps's share (ps task 0 only): median seconds (axpy, the ps's apply).

        axpy is two numpy passes (``multiply`` into a scratch, ``subtract``); apply is the
        ps's own (:meth:`~mpitf.ps.optimizers.Optimizer.apply`, one thread: the fused kernel,
        or the ufunc passes below ``FUSED_MIN_SIZE`` elements), which is what a push with
        ``sgd`` pays.
        """
        if not (self.is_ps and self.server.task_index == 0):
            return None
        n = nbytes // 4 // self.num_ps
        params, grad, tmp = (np.ones(n, np.float32) for _ in range(3))
        sgd = make_optimizer("sgd", learning_rate=LR)
        axpy, applied = [], []
        for i in range(WARMUP + reps):
            t0 = time.perf_counter()
            np.multiply(grad, LR, out=tmp)  # as the reference passes of GradientDescent
            np.subtract(params, tmp, out=params)
            t1 = time.perf_counter()
            sgd.apply(params, grad, {}, 0)
            if i >= WARMUP:
                axpy.append(t1 - t0)
                applied.append(time.perf_counter() - t1)
        return statistics.median(axpy), statistics.median(applied)

    # -- one size --------------------------------------------------------------------------

    def measure(self, nbytes):
        """Return this rank's samples at one size: raw, per optimizer, and axpy."""
        args = self.args
        reps = repetitions(nbytes, args.quick, args.reps)
        per_round = max(1, reps // args.rounds)
        clients = {(b, w): None if self.is_ps else self.client_for(nbytes, b, w)
                   for b in args.bucket_bytes for w in args.wire_dtypes}
        samples = {"raw": [], "axpy": [], "apply": [],
                   **{label(*c): [] for c in configurations(args)}}
        # Round 0 is run and thrown away: fresh buffers, the first kernel calls and the
        # kernel's own work on new memory (huge pages) made a first round's 16 MiB SGD
        # round trips 1.8x the later rounds' here.
        for timed in [False] + [True] * args.rounds:
            kept = samples if timed else {key: [] for key in samples}
            self.raw.Barrier()
            kept["raw"] += self.raw_block(nbytes, per_round)
            for opt, b, w in configurations(args):
                self.raw.Barrier()
                kept[label(opt, b, w)] += self.mpitf_block(clients[(b, w)], opt, per_round)
            self.raw.Barrier()
            a = self.axpy_block(nbytes, per_round)
            if a is not None:
                kept["axpy"].append(a[0])
                kept["apply"].append(a[1])
        return samples, per_round * args.rounds


def configurations(args):
    """Return the (optimizer, bucket bytes, wire dtype) triples measured, in running order."""
    return [(o, b, w) for o in args.optimizers for b in args.bucket_bytes
            for w in args.wire_dtypes]


def label(optimizer, bucket_bytes, wire="float32"):
    """Return the name of one configuration: ``sgd``, ``sgd@1024K`` buckets, ``sgd/bfloat16``."""
    name = optimizer if not bucket_bytes else f"{optimizer}@{bucket_bytes >> 10}K"
    return name if wire == "float32" else f"{name}/{wire}"


def _limit(optimizer, bucket_bytes, raw, apply, share=None):
    """Return the best ratio to raw a push in buckets can reach on one core per rank.

    Raw MPI's round trip is two copies, one each way, each by its receiver (CMA), one after
    the other: ``raw / 2`` each. In buckets the worker copies replies out while the ps
    copies the next bucket in, so the two directions overlap, but the ps's core must copy
    every bucket in and apply it: at best ``raw / 2 + apply`` (the ps's apply time on
    the shard, one thread). So ``none`` can reach 2x raw, SGD ``raw / (raw / 2 + apply)``.
    None for one bucket (``share``, a ps's bytes, within one) and for optimizers whose
    apply was not timed.
    """
    if not bucket_bytes or optimizer not in ("none", "sgd") or (share or 0) <= bucket_bytes:
        return None
    return raw / (raw / 2 + (apply if optimizer == "sgd" else 0.0))


def _worker_median(per_rank, key, worker_ranks):
    """Return the largest over workers of each worker's median (what a sync step sees)."""
    return max(statistics.median(per_rank[r][key]) for r in worker_ranks)


def main(argv=None):
    """Run the benchmark on every rank; rank 0 prints a table and writes the JSON."""
    args = parse_args(argv)
    bench = Bench(args)
    rank = MPI.COMM_WORLD.Get_rank()
    results, reps_used = [], {}
    started = time.monotonic()
    for nbytes in args.sizes:
        if nbytes % (4 * bench.num_ps):
            raise SystemExit(f"pushpull: size {nbytes} is not a multiple of 4 * num_ps")
        samples, reps = bench.measure(nbytes)
        gathered = bench.raw.gather(samples, root=0)
        if rank != 0:
            continue
        reps_used[nbytes] = reps
        raw = _worker_median(gathered, "raw", bench.worker_ranks)
        axpy = statistics.median(next(g["axpy"] for g in gathered if g["axpy"]))
        apply = statistics.median(next(g["apply"] for g in gathered if g["apply"]))
        for opt, b, wire in configurations(args):
            t = _worker_median(gathered, label(opt, b, wire), bench.worker_ranks)
            row = dict(bytes=nbytes, num_ps=bench.num_ps, num_workers=len(bench.worker_ranks),
                       optimizer=opt, mode=args.mode, bucket_bytes=b, wire_dtype=wire,
                       mpitf_gbps=2 * nbytes / t / 1e9, raw_mpi_gbps=2 * nbytes / raw / 1e9,
                       ratio=raw / t, mpitf_us=_us(t), raw_mpi_us=_us(raw), axpy_us=_us(axpy),
                       apply_us=_us(apply), repetitions=reps,
                       limit=_limit(opt, b, raw, apply, nbytes // bench.num_ps))
            results.append(row)
            limit = "" if row["limit"] is None else f" (limit {row['limit']:.2f})"
            print(f"{nbytes:>10} B  {label(opt, b, wire):<14} mpitf {row['mpitf_us']:10.1f} us "
                  f"{row['mpitf_gbps']:6.2f} GB/s   raw {row['raw_mpi_us']:10.1f} us "
                  f"{row['raw_mpi_gbps']:6.2f} GB/s   ratio {row['ratio']:.2f}{limit}   "
                  f"axpy {row['axpy_us']:9.1f} us", flush=True)
    rss = bench.raw.gather((bench.server.task_index, bench.rss_peak, bench.rss_reset)
                           if bench.is_ps else None, root=0)
    if rank != 0:
        return 0
    ps_rss = {str(r): v[1] for r, v in enumerate(rss) if v is not None}
    out = dict(
        results=results, ps_peak_rss=ps_rss,
        ps_peak_rss_scope=("service loop only (peak reset before each serve)"
                           if all(v[2] for v in rss if v) else "whole process"),
        largest_ps_share_bytes=max(args.sizes) // bench.num_ps,
        metadata=dict(
            mpi_library=MPI.Get_library_version().strip().splitlines()[0],
            mpi4py=__import__("mpi4py").__version__, numpy=np.__version__,
            hostname=socket.gethostname(), cpus=os.cpu_count(),
            ranks=MPI.COMM_WORLD.Get_size(),
            oversubscribed=MPI.COMM_WORLD.Get_size() > (os.cpu_count() or 1),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            repetitions={str(k): v for k, v in reps_used.items()}, warmup=WARMUP,
            rounds=args.rounds, quick=args.quick, mode=args.mode, statistic="median",
            seconds=time.monotonic() - started, argv=sys.argv[1:]))
    write_json(args.json, out)
    return 0


def run():
    """Run from the command line (``python -m``, benchmarks/); every rank ends on an error."""
    run_job(main)


if __name__ == "__main__":
    run()
