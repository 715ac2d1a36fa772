"""A checkpoint as torch loads it for inference: ``mpitf ckpt export --format torch``.

:func:`write_state_dict` saves the arrays of a checkpoint (:mod:`mpitf.ckpt.commands` reads
them, full or full + deltas) as one ``torch.save``'d dict of CPU tensors by state_dict key:
the dense parameters and buffers as the model names them, a fixed table whole
(``"emb.weight"``, rows x dim), and a table that grows as its rows (``"<key>"``, one per id
held, ids ascending) with their ids (``"<key>/ids"``, int64). A model built with plain
torch modules loads the file with ``model.load_state_dict(torch.load(path))``.
"""

import numpy as np
import torch

__all__ = ["write_state_dict"]


def write_state_dict(arrays, path):
    """``torch.save`` ``arrays`` (name -> numpy array) to ``path`` as a dict of tensors."""
    torch.save({name: torch.from_numpy(np.array(value, copy=True))
                for name, value in arrays.items()}, path)
