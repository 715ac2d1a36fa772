"""The ps's optimizer kernels against the memory bandwidth, per optimizer and thread count.

Run: python -m mpitf.bench.kernels --json OUT.json [--quick] [--mib M] [--threads 1,2]
(or python benchmarks/kernels.py ... in a checkout; one process, no MPI)

For each optimizer and each thread count (1 .. the cores this process may use), the ps's
apply (``Optimizer.apply`` on ``--mib`` MiB of float32 parameters, over a
:class:`~mpitf.ps.threads.KernelPool`) is timed against a memcpy (``np.copyto``) of the
same number of bytes (read + written) on the same threads, in the same run. An optimizer's
traffic is the buffers it reads and writes: SGD reads parameters and gradient and writes
the parameters (3 streams); Adam reads parameters, gradient, m and v and writes three (7).
The ratio memcpy time / apply time is the fraction of the bandwidth limit it reaches.
The reference ufunc passes (the ps before the fused kernels) are timed on one thread.
"""

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import numpy as np

from mpitf.ps.kernels import warm_up
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.threads import KernelPool

from .scaling import write_json

# name -> (make_optimizer arguments, buffers read + buffers written per element)
OPTIMIZERS = {
    "sgd": (("sgd", 0.01, {}), 3),
    "momentum": (("momentum", 0.01, {}), 5),
    "nesterov": (("momentum", 0.01, {"use_nesterov": True}), 5),
    "adam": (("adam", 0.001, {}), 7),
    "adagrad": (("adagrad", 0.01, {}), 5),
    "ftrl": (("ftrl", 0.1, {}), 7),
}


def _copy(lo, hi, dst, src):
    np.copyto(dst[lo:hi], src[lo:hi])  # libc memcpy, the GIL released


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="16 MiB, 3 repetitions")
    p.add_argument("--mib", type=int, default=None, help="MiB of parameters (default 64)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 9)")
    p.add_argument("--threads", default=None,
                   help="thread counts, e.g. 1,2,4 (default 1 .. the cores present)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = p.parse_args(argv)
    args.mib = args.mib or (16 if args.quick else 64)
    args.reps = args.reps or (3 if args.quick else 9)
    cores = len(os.sched_getaffinity(0))
    args.threads = ([int(t) for t in args.threads.split(",")] if args.threads
                    else list(range(1, cores + 1)))
    args.optimizers = args.optimizers.split(",")
    return args


def _median_seconds(fn, reps):
    fn()  # warm: first touch of the pages, the kernel's dispatch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name, n, threads, reps):
    """Return one row: the apply and the copy of its traffic on ``threads`` threads."""
    (opt_name, lr, kw), streams = OPTIMIZERS[name]
    opt = make_optimizer(opt_name, lr, **kw)
    warm_up(opt, np.float32)
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n, dtype=np.float32)
    grad = (rng.standard_normal(n, dtype=np.float32) * 1e-3).astype(np.float32)
    slots = opt.make_slots(n, np, np.float32)
    half = streams * n // 2  # a copy of `half` elements reads and writes the same bytes
    src, dst = np.ones(half, np.float32), np.empty(half, np.float32)
    pool = KernelPool(threads)
    try:
        t_apply = _median_seconds(lambda: opt.apply(params, grad, slots, 1, pool), reps)
        t_copy = _median_seconds(lambda: pool.run(_copy, half, (dst, src)), reps)
        t_ref = (_median_seconds(lambda: opt.reference_update(np, params, grad, slots, 1), reps)
                 if threads == 1 else None)
    finally:
        pool.close()
    nbytes = n * 4
    return dict(optimizer=name, threads=threads, param_bytes=nbytes,
                traffic_bytes=streams * nbytes, apply_s=t_apply, copy_s=t_copy,
                params_gbps=nbytes / t_apply / 1e9,
                traffic_gbps=streams * nbytes / t_apply / 1e9,
                copy_gbps=streams * nbytes / t_copy / 1e9,
                ratio_to_copy=t_copy / t_apply,
                reference_s=t_ref,
                reference_params_gbps=None if t_ref is None else nbytes / t_ref / 1e9)


def main(argv=None):
    """Measure every optimizer at every thread count; print a table; return the results."""
    args = parse_args(argv)
    n = args.mib << 18  # float32 elements
    start = time.perf_counter()
    opt = make_optimizer("adam", 0.001)
    compile_s = warm_up(opt, np.float32)
    rows = []
    print(f"{'optimizer':>9} {'thr':>3} {'param GB/s':>10} {'traffic GB/s':>12} "
          f"{'copy GB/s':>9} {'ratio':>5} {'numpy passes GB/s':>17}")
    for name in args.optimizers:
        for threads in args.threads:
            r = measure(name, n, threads, args.reps)
            rows.append(r)
            ref = "" if r["reference_params_gbps"] is None else \
                f"{r['reference_params_gbps']:17.2f}"
            print(f"{name:>9} {threads:>3} {r['params_gbps']:10.2f} {r['traffic_gbps']:12.2f} "
                  f"{r['copy_gbps']:9.2f} {r['ratio_to_copy']:5.2f} {ref}", flush=True)
    result = dict(
        suite="kernels", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        hostname=socket.gethostname(), cpus=os.cpu_count(),
        cores_usable=len(os.sched_getaffinity(0)), loadavg=os.getloadavg(),
        command=" ".join([sys.executable, "-m", "mpitf.bench.kernels", *(argv or sys.argv[1:])]),
        mib=args.mib, reps=args.reps, warm_up_s=compile_s,
        seconds=time.perf_counter() - start, results=rows)
    if args.json:
        write_json(args.json, result)
    return result


def run():
    """Entry point of ``python -m mpitf.bench.kernels``."""
    main()


if __name__ == "__main__":
    run()
