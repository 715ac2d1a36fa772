"""Click-through training with embedding tables on the ps tasks (wide & deep style).

The code is the built-in job ``mpitf.jobs.ctr``; this script runs it from a checkout:
    mpitf data synthetic-ctr --out ctr.h5
    mpiexec -n 3 python jobs/ctr.py --data ctr.h5 --num-ps 1 --steps 2000
``--help`` lists the flags.
"""

from mpitf.jobs.ctr import run

if __name__ == "__main__":
    run()
