"""The two copies of an mpitf.jax step, against a memcpy of the same bytes (one process).

    python benchmarks/jax_copy.py [--json jc.json] [--quick]

push: each gradient leaf (a jax array) into the client's flat push buffer
(``np.copyto(view, np.asarray(leaf))``, what ``DistributedOptimizer.step`` does);
pull: each pulled parameter view into a new jax array (``mpitf.jax.tree.to_jax``);
memcpy: ``np.copyto`` of the same bytes between two numpy buffers; jnp.array: the plain
way to make the pull's jax arrays, for comparison. Models: the digits MLP of
jobs/jax_mnist.py (4 leaves, 37 KiB) and one to four large leaves. Medians of --reps
after warm-ups, the four ways interleaved in rounds.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import mpitf.jax  # noqa: F401 - the CPU platform and threads, before jax first computes
from mpitf.jax.tree import to_jax

MODELS = {
    "digits MLP": [(64, 128), (128,), (128, 10), (10,)],
    "4 MiB x 4": [(1024, 1024)] * 4,
    "16 MiB": [(1024, 4096)],
    "64 MiB": [(4096, 4096)],
}


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def measure(shapes, reps):
    """Return median milliseconds of push, pull, memcpy and jnp.array for one model."""
    size = sum(int(np.prod(s)) for s in shapes)
    flat, flat2 = np.zeros(size, np.float32), np.ones(size, np.float32)
    views, offset = [], 0
    for s in shapes:
        n = int(np.prod(s))
        views.append(flat[offset:offset + n].reshape(s))
        offset += n
    leaves = [jnp.ones(s, jnp.float32) for s in shapes]

    def push():
        for view, leaf in zip(views, leaves):
            np.copyto(view, np.asarray(leaf))

    ways = {"push": push, "pull": lambda: [to_jax(v) for v in views],
            "memcpy": lambda: np.copyto(flat2, flat),
            "jnp.array": lambda: [jnp.array(v) for v in views]}
    for fn in ways.values():  # warm-up: first touch of fresh memory, compiles
        for _ in range(2):
            jax.block_until_ready(fn())
    times = {k: [] for k in ways}
    for _ in range(reps):
        for k, fn in ways.items():
            times[k] += _median_ms(fn, 1)
    out = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    out["bytes"] = size * 4
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="5 repetitions")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    reps = 5 if args.quick else args.reps
    results = {}
    print(f"{'model':12} {'bytes':>10} {'push ms':>9} {'pull ms':>9} {'memcpy ms':>10} "
          f"{'jnp.array ms':>13} {'push/memcpy':>12} {'pull/memcpy':>12}")
    for name, shapes in MODELS.items():
        r = results[name] = measure(shapes, reps)
        print(f"{name:12} {r['bytes']:>10} {r['push']:9.3f} {r['pull']:9.3f} "
              f"{r['memcpy']:10.3f} {r['jnp.array']:13.3f} {r['push'] / r['memcpy']:12.2f} "
              f"{r['pull'] / r['memcpy']:12.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
