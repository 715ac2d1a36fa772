"""numexpr against numba for the ps's fused Adam and SGD: why ps/kernels.py uses numba.

Run: python benchmarks/kernel_libraries.py [--mib 64]  (needs ``pip install numexpr``)

numexpr evaluates one output per expression, so Adam (outputs m, v and the parameters) is
three ``evaluate`` calls: three passes over memory. The numba kernel is the ps's own
(``mpitf.ps.kernels``), one pass. Times are medians of 7, one thread each, same run.
"""

import argparse
import os
import statistics

import numexpr as ne
import numpy as np

from mpitf.bench.timing import timed
from mpitf.ps.kernels import warm_up
from mpitf.ps.optimizers import make_optimizer

F32 = np.float32


def median(fn, reps=7):
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up run."""
    return statistics.median(timed(fn, reps, warmup=1))


def main():
    """Print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    n = p.parse_args().mib << 18
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n, dtype=F32)
    grad = (rng.standard_normal(n, dtype=F32) * 1e-3).astype(F32)
    adam, sgd = make_optimizer("adam", 0.001), make_optimizer("sgd", 0.01)
    slots = adam.make_slots(n, np, F32)
    m, v = slots["m"], slots["v"]
    warm_up(adam, F32)
    warm_up(sgd, F32)
    c1, c2, eps, lr = F32(0.1), F32(0.001), F32(1e-8), F32(0.001)

    def ne_adam():
        ne.evaluate("m + (g - m) * c1", dict(m=m, g=grad, c1=c1), out=m)
        ne.evaluate("v + (g * g - v) * c2", dict(v=v, g=grad, c2=c2), out=v)
        ne.evaluate("p - (m / (sqrt(v) + eps)) * lr", dict(p=params, m=m, v=v, eps=eps, lr=lr),
                    out=params)

    def ne_sgd():
        ne.evaluate("p - g * lr", dict(p=params, g=grad, lr=lr), out=params)

    rows = []
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        ne.set_num_threads(threads)
        rows.append((f"numexpr, {threads} thread(s)", median(ne_sgd), median(ne_adam)))
    g2 = grad.copy()
    rows.append(("numpy ufunc passes (reference)",
                 median(lambda: sgd.reference_update(np, params, g2, {}, 0)),
                 median(lambda: adam.reference_update(np, params, grad, slots, 0))))
    rows.append(("numba fused (ps/kernels.py), 1 thread",
                 median(lambda: sgd.apply(params, grad, {}, 0)),
                 median(lambda: adam.apply(params, grad, slots, 0))))
    print(f"{n * 4 >> 20} MiB of float32 parameters; load average {os.getloadavg()[0]:.2f}")
    print("| kernel | SGD ms | SGD params GB/s | Adam ms | Adam params GB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, ts, ta in rows:
        print(f"| {name} | {ts * 1e3:.1f} | {n * 4 / ts / 1e9:.2f} | {ta * 1e3:.1f} | "
              f"{n * 4 / ta / 1e9:.2f} |")


if __name__ == "__main__":
    main()
