"""Ranks that end in different ways, for the lifeline tests.

Run: mpiexec -n 3 python tests/mpi/lifeline_driver.py MODE
MODE uncaught: rank 2 raises (no mpitf guard) while the others wait; staggered: every
rank finishes normally, rank r after r * 0.3 s.
"""

import sys
import time

from mpitf.runtime.server import Server

mode = sys.argv[1]
server = Server({"ps": 1, "worker": 2}, deadline=60)
if mode == "uncaught":
    if server.rank == 2:
        raise RuntimeError("boom in user code")
    time.sleep(30)  # the lifeline must end the job long before this
    print(f"rank {server.rank} waited it out", flush=True)
else:
    time.sleep(0.3 * server.rank)
    print(f"rank {server.rank} done", flush=True)
