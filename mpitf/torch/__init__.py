"""PyTorch on mpitf: ``DistributedOptimizer`` runs a torch.optim update on the ps.

The only package that imports torch (install the ``torch`` extra).
"""

from .optimizer import DistributedOptimizer, share_threads

__all__ = ["DistributedOptimizer", "share_threads"]
