"""In-graph replication on the digits set: one client (worker task 0) drives every worker.

The code is the built-in job ``mpitf.jobs.in_graph``; this script runs it from a checkout:
    mpiexec -n 4 python jobs/in_graph.py --num-ps 1 --steps 200
(the same as ``mpitf run -n 4 in_graph ...``). ``--help`` lists the flags.
"""

from mpitf.jobs.in_graph import run

if __name__ == "__main__":
    run()
