"""The ps's optimizer kernels against a memcpy, per optimizer and thread count.

The code is ``mpitf.bench.kernels`` (what ``mpitf bench --suite kernels`` runs); this
script runs it from a checkout, with the same flags: ``python benchmarks/kernels.py``.
"""

from mpitf.bench.kernels import run

if __name__ == "__main__":
    run()
