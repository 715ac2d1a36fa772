"""JAX on mpitf: ``DistributedOptimizer`` takes a pytree of parameters and of gradients.

The only package that imports jax (install the ``jax`` extra). Importing it selects jax's
CPU platform and gives XLA this rank's share of its node's cores (``NPROC``; see
:mod:`.threads`) unless set, so import it before jax first computes.

A step copies each gradient leaf once into the push buffer and each pulled parameter once
into a new jax array (see :func:`.tree.to_jax`). Measured (``python benchmarks/jax_copy.py``):
FILLED IN BELOW.
"""

from .threads import share_threads

share_threads()

from .optimizer import DistributedOptimizer  # noqa: E402 - after the threads are set

__all__ = ["DistributedOptimizer", "share_threads"]
