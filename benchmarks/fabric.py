"""The fabric's latency and bandwidth by ping-pong between two ranks (one per node).

The code is ``mpitf.bench.fabric`` (what ``mpitf bench --suite fabric`` runs); this
script runs it from a checkout, with the same flags:
``srun -N 2 --ntasks-per-node=1 python benchmarks/fabric.py --json fabric.json``.
"""

from mpitf.bench.fabric import run

if __name__ == "__main__":
    run()
