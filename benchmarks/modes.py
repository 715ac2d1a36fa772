"""Consistency modes compared: throughput, and the loss each reaches in a fixed wall time.

The code is ``mpitf.bench.modes`` (what ``mpitf bench`` runs); this script runs it from a
checkout, with the same flags: ``python benchmarks/modes.py --json md.json``.
"""

from mpitf.bench.modes import run

if __name__ == "__main__":
    run()
