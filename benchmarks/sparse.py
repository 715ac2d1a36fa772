"""Sparse step (embedding rows by id) against raw MPI and the dense push+pull of the table.

The code is ``mpitf.bench.sparse``; this script runs it from a checkout:
``mpiexec -n P+1 python benchmarks/sparse.py --rows R --dim D --batch B --fields F
--zipf A --num-ps P --json FILE``.
"""

from mpitf.bench.sparse import run

if __name__ == "__main__":
    run()
