"""Hello, distributed TensorFlow! -- on MPI: every rank greets rank 0.

The code is the built-in job ``mpitf.jobs.hello``; this script runs it from a checkout:
    mpiexec -n 3 python jobs/hello.py [--num-ps 1]
(the same as ``mpitf run -n 3 hello``). ``--help`` lists the flags.
"""

from mpitf.jobs.hello import run

if __name__ == "__main__":
    run()
