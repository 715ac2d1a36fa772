"""What every front end checks of a table's ids before a lookup: integers, in range.

Framework-free (numpy): mpitf.torch's and mpitf.jax's tables call it on the worker before
anything is pulled, so a refusal is one ConfigurationError naming the table, the id and
its position (the front end then ends every rank).
"""

import numpy as np

from ..errors import ConfigurationError

__all__ = ["check_range", "position"]


def position(shape, flat):
    """Return index ``flat`` of an array of ``shape`` as numpy or torch would print it."""
    where = np.unravel_index(int(flat), shape)
    return int(where[0]) if len(where) == 1 else tuple(int(i) for i in where)


def check_range(name, rows, ids):
    """Refuse an id of table ``name`` outside ``[0, rows)`` (None: it grows, any int64).

    ``ids`` is an integer numpy array; the message names the id and its position.
    """
    if rows is not None and ids.size and (ids.min() < 0 or ids.max() >= rows):
        flat = ids.reshape(-1)
        bad = int(np.flatnonzero((flat < 0) | (flat >= rows))[0])
        raise ConfigurationError(
            f"table {name!r}: id {int(flat[bad])} at position {position(ids.shape, bad)} is "
            f"outside [0, {rows}) (ids are never wrapped or clipped)")
