"""PyTorch on mpitf: ``DistributedOptimizer`` runs a torch.optim update on the ps.

``EmbeddingBag`` and ``Embedding`` are torch's, with their weight on the ps by rows (a
table: each step pulls and updates the rows it looks up). The only package that imports
torch (install the ``torch`` extra).
"""

from .optimizer import DistributedOptimizer, share_threads
from .tables import Embedding, EmbeddingBag

__all__ = ["DistributedOptimizer", "Embedding", "EmbeddingBag", "share_threads"]
