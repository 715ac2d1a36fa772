"""Where a row of a table that grows lives, and its initial values: hashes of the id.

A dynamic table's ids are any int64, so no row range can place them: id ``x`` lives on
ps ``owner_of(x, P)`` (a hash, :func:`~mpitf.tables.dynkernels.owner_of`), and its
initial row is a counter-based draw of (seed, table name, id) (:func:`initial_values`), so
a row is the same whichever ps holds it and whenever it is made.
"""

import zlib

import numpy as np

from ..errors import ConfigurationError

__all__ = ["HashPlacement", "init_key", "initial_values", "owners"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def owners(ids, num_ps):
    """Return the owner ps of each id (numpy; the same as the compiled ``owner_of``)."""
    z = np.asarray(ids, np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
        return (((z >> np.uint64(32)) * np.uint64(num_ps)) >> np.uint64(32)).astype(np.int64)


def init_key(seed, name):
    """Return the key of a table's draws: (seed, crc32 of its name), mixed."""
    return int(np.uint64(((int(seed) & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode())))


def initial_values(out, ids, key, initializer, scale, slots=None):
    """Write the initial rows of ``ids`` into ``out`` (where ``slots[j] < 0``, if given)."""
    if slots is None:
        slots = _NONE[:len(ids)] if len(ids) <= len(_NONE) else np.full(len(ids), -1, np.int64)
    if initializer == "zeros":
        out[slots < 0] = 0
        return out
    from . import dynkernels  # numba loads only in a process that has tables

    if out.dtype in (np.float32, np.float64):
        dynkernels.init_rows(out, ids, slots, key, float(scale), initializer == "normal")
        return out
    wide = out.astype(np.float64)  # float16: drawn in float64, then rounded
    dynkernels.init_rows(wide, ids, slots, key, float(scale), initializer == "normal")
    out[...] = wide
    return out


_NONE = np.full(1 << 16, -1, np.int64)


class HashPlacement:
    """The split of a dynamic table's ids over ``num_ps`` ps tasks, by a hash of the id."""

    kind = "hash"

    def __init__(self, num_ps, negatives=True):
        if int(num_ps) < 1:
            raise ConfigurationError(f"a table needs at least one ps, got num_ps={num_ps}")
        self.num_ps, self.negatives = int(num_ps), bool(negatives)

    def __repr__(self):
        return f"HashPlacement(num_ps={self.num_ps})"

    def owner(self, ids):
        """Return the ps task of each id."""
        return owners(ids, self.num_ps)

    def route(self, dedup, ids):
        """Return ``(unique ids grouped by owner, offsets per ps, bad)`` (inverse: ``finish``)."""
        return dedup.group(ids, self.num_ps, self.negatives)

    def refusal(self, name, x):
        """Return the message for a bad id ``x`` (a negative one where the table takes none)."""
        return (f"table {name!r}: id {x} is negative, and this table takes ids >= 0 only "
                "(its Growth says negative_ids=False)")

    def ids_of_keys(self, keys, ps, out):
        """Write ps ``ps``'s ids into ``out`` (here the keys are the ids); return ``out``."""
        out[...] = keys
        return out
