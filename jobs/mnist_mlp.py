"""Between-graph training of an MLP (or CNN) on the digits set: mpitf's mlp_mnist_dist.py.

The code is the built-in job ``mpitf.jobs.mnist_mlp``; this script runs it from a checkout:
    mpiexec -n 3 python jobs/mnist_mlp.py --num-ps 1 --steps 300 --mode sync
(the same as ``mpitf run -n 3 mnist_mlp ...``). ``--help`` lists the flags.
"""

from mpitf.jobs.mnist_mlp import run

if __name__ == "__main__":
    run()
