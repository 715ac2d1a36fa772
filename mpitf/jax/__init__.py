"""JAX on mpitf: ``DistributedOptimizer`` takes a pytree of parameters and of gradients.

Embedding tables (:class:`Table`) live on the ps by rows: ``opt.lookup(name, ids)`` pulls
a step's rows, ``jax.grad`` takes their gradient, ``step(..., table_grads=...)`` pushes it.

The only package that imports jax (install the ``jax`` extra). Importing it selects jax's
CPU platform and gives XLA this rank's share of its node's cores (``NPROC``; see
:mod:`.threads`) unless set, so import it before jax first computes.

A step copies each gradient leaf once into the push buffer (``np.copyto``; a CPU jax array
reads without a copy) and each pulled parameter once into a new jax array
(:func:`.tree.to_jax`: jax arrays are immutable, so the pulled buffer, which the next pull
overwrites, cannot be handed out as it is). Measured (``python benchmarks/jax_copy.py``,
2 shared cores at load 11, medians): the digits MLP (38 KB) 0.011 ms push + 0.095 ms pull
a step, about 1 % of its step; 64 MiB in one leaf 80 ms push (1.9x a memcpy of the same
bytes) + 101 ms pull (2.5x: the new arrays' fresh pages are touched for the first time),
against 485 ms for ``jnp.array``.
"""

from .threads import share_threads

share_threads()

from .optimizer import DistributedOptimizer  # noqa: E402 - after the threads are set
from .tables import Table  # noqa: E402

__all__ = ["DistributedOptimizer", "Table", "share_threads"]
