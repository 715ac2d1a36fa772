"""The passes a 16-bit wire adds, against a memcpy of the float32 bytes, in one process.

Run: python benchmarks/wire_convert.py [--mib 64] [--reps 15]

A worker narrows its float32 gradient into the push frame and widens the reply into its
float32 parameters (``mpitf.wire.convert``); the ps's fused SGD kernel reads the 16-bit
gradient and writes the float32 master and the 16-bit reply. Each is timed interleaved with
the others (median and minimum of ``--reps``), beside a numpy copy of the float32 buffer.
"""

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from mpitf.ps.kernels import fused_apply
from mpitf.ps.optimizers import make_optimizer
from mpitf.wire.convert import narrow_into, widen_into


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="float32 parameters, MiB")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    n = (args.mib << 20) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    y, params = np.zeros(n, np.float32), np.ones(n, np.float32)
    sgd = make_optimizer("sgd", 1e-6)
    passes = {"memcpy float32": lambda: np.copyto(y, x),
              "sgd float32 (fused)": lambda: fused_apply(sgd, params, x, {}, 0)}
    for name in ("bfloat16", "float16"):
        w = np.zeros(n, np.dtype(getattr(ml_dtypes, name, None) or name))
        reply = np.zeros_like(w)
        passes[f"narrow -> {name}"] = lambda w=w: narrow_into(x, w)
        passes[f"widen {name}"] = lambda w=w: widen_into(w, y)
        passes[f"sgd {name} + reply"] = lambda w=w, r=reply: fused_apply(sgd, params, w, {}, 0,
                                                                           None, r)
    times = {k: [] for k in passes}
    for f in passes.values():
        f()  # compile, first touch
    for _ in range(args.reps):
        for k, f in passes.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    print(f"{args.mib} MiB of float32 ({n} elements), {args.reps} reps, ms:")
    for k, v in times.items():
        print(f"  {k:24s} median {statistics.median(v) * 1e3:7.2f}   min {min(v) * 1e3:7.2f}")


if __name__ == "__main__":
    main()
