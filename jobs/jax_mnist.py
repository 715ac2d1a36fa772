"""A plain-jax MLP on the digits set, trained on mpitf's parameter servers.

The code is the built-in job ``mpitf.jobs.jax_mnist``; this script runs it from a checkout:
    mpiexec -n 3 python jobs/jax_mnist.py --num-ps 1 --steps 300
(the same as ``mpitf run -n 3 jax_mnist ...``). ``--help`` lists the flags.
"""

from mpitf.jobs.jax_mnist import run

if __name__ == "__main__":
    run()
