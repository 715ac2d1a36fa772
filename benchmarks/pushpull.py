"""Push+pull round trip of mpitf against raw MPI between the same ranks, size by size.

The code is ``mpitf.bench.pushpull`` (what ``mpitf bench`` runs); this script runs it from a
checkout, with the same flags: ``mpiexec -n 2 python benchmarks/pushpull.py --json pp.json``.
"""

from mpitf.bench.pushpull import run

if __name__ == "__main__":
    run()
