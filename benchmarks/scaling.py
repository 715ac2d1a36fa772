"""Training throughput of the reference MLP and CNN over worker and ps counts.

The code is ``mpitf.bench.scaling`` (what ``mpitf bench`` runs); this script runs it from a
checkout, with the same flags: ``python benchmarks/scaling.py --json sc.json``.
"""

from mpitf.bench.scaling import run

if __name__ == "__main__":
    run()
