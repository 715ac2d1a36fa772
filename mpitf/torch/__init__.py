"""PyTorch on mpitf: ``DistributedOptimizer`` runs a torch.optim update on the ps.

``EmbeddingBag`` and ``Embedding`` are torch's, with their weight on the ps by rows (a
table: each step pulls and updates the rows it looks up). ``EmbeddingBagCollection``,
``EmbeddingCollection`` and ``distribute`` are TorchRec's collections on such tables
(:mod:`.keyed`; they need the ``torchrec`` extra and load it on first use). The only
package that imports torch (install the ``torch`` extra).
"""

from .optimizer import DistributedOptimizer, share_threads
from .tables import Embedding, EmbeddingBag

__all__ = ["DistributedOptimizer", "Embedding", "EmbeddingBag", "EmbeddingBagCollection",
           "EmbeddingCollection", "distribute", "share_threads"]

_KEYED = ("EmbeddingBagCollection", "EmbeddingCollection", "distribute")


def __getattr__(name):
    """Load TorchRec's collections (:mod:`.keyed`) when first asked for."""
    if name in _KEYED:
        from . import keyed

        return getattr(keyed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
