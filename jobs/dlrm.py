"""DLRM (bottom MLP, tables on the ps, pairwise dot interactions, top MLP) in torch.

The code is the built-in job ``mpitf.jobs.dlrm``; this script runs it from a checkout:
    mpitf data synthetic-ctr --out ctr.h5
    mpiexec -n 3 python jobs/dlrm.py --data ctr.h5 --num-ps 1
``--help`` lists the flags.
"""

from mpitf.jobs.dlrm import run

if __name__ == "__main__":
    run()
