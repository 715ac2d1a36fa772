"""Multi-device tower training in one process: the batch is split over local devices.

The code is the built-in job ``mpitf.jobs.towers``; this script runs it from a checkout:
    python jobs/towers.py --devices cpu:0,cpu:1 --steps 200
(the same as ``mpitf run -n 1 towers ...``). ``--help`` lists the flags.
"""

from mpitf.jobs.towers import run

if __name__ == "__main__":
    run()
