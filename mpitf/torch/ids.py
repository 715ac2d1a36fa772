"""What an mpitf.torch table checks of its input: ids, offsets, per-sample weights, growth.

Each refusal is one ConfigurationError naming the table, the value and its position, raised
on the worker before anything is pulled or pushed (the front end then ends every rank).
"""

import numpy as np
import torch

from ..errors import ConfigurationError
from ..tables.growth import Growth
from ..worker.ids import check_range

__all__ = ["check_ids", "growth_of"]

_INT = (torch.int64, torch.int32)


def check_ids(name, rows, input, offsets=None, per_sample_weights=None,
              include_last_offset=False, bag=True):
    """Refuse ids, offsets or weights torch would reject or read wrongly, naming the value.

    ``name`` is the table, ``rows`` its size (None: a table that grows, any int64). Raises
    ConfigurationError with the table, the value and its position: an id outside
    ``[0, rows)``, a float id tensor, offsets that do not start at 0, go down or point past
    the ids, per_sample_weights of another shape.
    """
    if not isinstance(input, torch.Tensor) or input.dtype not in _INT:
        kind = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
        raise ConfigurationError(f"table {name!r}: ids must be an integer tensor (torch.long "
                                 f"or torch.int), got {kind}")
    if bag:
        _check_bags(name, input, offsets, per_sample_weights, include_last_offset)
    check_range(name, rows, input.numpy())


def growth_of(num_embeddings, dynamic, padding_idx, weight):
    """Return the Growth of a table that grows (``num_embeddings`` None), else None."""
    if num_embeddings is not None and dynamic in (None, False):
        return None
    if num_embeddings is not None:
        raise ConfigurationError(f"a table that grows (dynamic={dynamic!r}) has no row count: "
                                 f"give num_embeddings=None, not {num_embeddings!r}")
    growth = Growth() if dynamic in (None, True) else dynamic
    if not isinstance(growth, Growth):
        raise ConfigurationError(f"dynamic must be True or a mpitf.Growth, got {dynamic!r}")
    if padding_idx is not None or weight is not None:
        raise ConfigurationError("a table that grows takes no padding_idx or _weight: its "
                                 "rows are drawn on the ps from (seed, table, id)")
    return growth


def _check_bags(name, input, offsets, per_sample_weights, include_last_offset):
    if input.dim() == 2:
        if offsets is not None:
            raise ConfigurationError(f"table {name!r}: offsets must be None when the ids are "
                                     f"2-D (one bag per row), got {tuple(offsets.shape)}")
    elif input.dim() == 1:
        if offsets is None:
            raise ConfigurationError(f"table {name!r}: 1-D ids need offsets (where each bag "
                                     "starts)")
        if not isinstance(offsets, torch.Tensor) or offsets.dtype not in _INT \
                or offsets.dim() != 1:
            raise ConfigurationError(f"table {name!r}: offsets must be a 1-D integer tensor")
        o, n = offsets.numpy(), input.shape[0]
        if len(o) and o[0] != 0:
            raise ConfigurationError(f"table {name!r}: offsets[0] is {int(o[0])}: the first "
                                     "bag starts at position 0")
        down = np.flatnonzero(np.diff(o) < 0)
        if len(down):
            i = int(down[0]) + 1
            raise ConfigurationError(f"table {name!r}: offsets are not monotone: offsets[{i}] "
                                     f"= {int(o[i])} < offsets[{i - 1}] = {int(o[i - 1])}")
        if len(o) and o[-1] > n:
            raise ConfigurationError(f"table {name!r}: offsets[{len(o) - 1}] = {int(o[-1])} "
                                     f"is past the {n} ids")
        if include_last_offset and (not len(o) or o[-1] != n):
            raise ConfigurationError(
                f"table {name!r}: with include_last_offset the last offset is the number of "
                f"ids, {n}, got {int(o[-1]) if len(o) else 'no offsets'}")
    else:
        raise ConfigurationError(f"table {name!r}: ids must be 1-D (with offsets) or 2-D, "
                                 f"got {input.dim()}-D")
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        raise ConfigurationError(
            f"table {name!r}: per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
            f"the ids {tuple(input.shape)}: one weight per id")
