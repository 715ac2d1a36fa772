"""Communication hidden behind backward: one bucket against one bucket per layer.

The code is ``mpitf.bench.overlap``; this script runs it from a checkout:
``OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python benchmarks/overlap.py --json overlap.json``.
"""

from mpitf.bench.overlap import run

if __name__ == "__main__":
    run()
