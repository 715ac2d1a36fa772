"""The datasets of shard files as pieces: found, read with their crc32 checked, and tiled.

A piece is one dataset, ``params|slots/<slot>|average`` / ``<variable>`` / ``part<k>``,
holding the elements ``[start, stop)`` of its variable. Verification and restore both see
a checkpoint this way, and both ask :func:`cover` whether pieces tile a range.
"""

import os
import re
from collections import defaultdict, namedtuple

import numpy as np

from ..errors import CheckpointError
from .files import crc32

_PART_RE = re.compile(r"^part(\d+)$")

# One dataset of a shard file, as its attributes describe it.
Piece = namedtuple("Piece", "file ps_task path kind slot var start stop shape dtype crc")


def walk(f, entry):
    """Return the pieces of an open shard file and the problems with their attributes.

    ``entry`` is the shard's manifest entry (its ``file`` and ``ps_task`` name the pieces).
    """
    import h5py

    pieces, problems = [], []

    def visit(path, obj):
        if not isinstance(obj, h5py.Dataset):
            return
        kind, _, rest = path.partition("/")
        if kind == "tables":  # embedding tables: checked by ckpt/tables.py
            return
        slot, var, leaf = None, *rest.rpartition("/")[::2]
        if kind == "slots":
            slot, _, var = var.partition("/")
        if kind not in ("params", "slots", "average") or not var or not _PART_RE.match(leaf):
            problems.append(f"unexpected dataset {path}")
            return
        try:
            a = obj.attrs
            p = Piece(entry["file"], entry["ps_task"], path, kind, slot, var,
                      int(a["start"]), int(a["stop"]), tuple(int(d) for d in a["shape"]),
                      np.dtype(str(a["dtype"])).str, int(a["crc32"]))
        except (KeyError, OSError, TypeError, ValueError) as e:
            problems.append(f"attributes of {path} missing or unreadable ({e})")
            return
        size = int(np.prod(p.shape, dtype=np.int64))
        if not 0 <= p.start <= p.stop <= size:
            problems.append(f"{path} holds elements [{p.start}:{p.stop}] of a variable of "
                            f"{size}")
        if obj.ndim != 1 or obj.shape[0] != p.stop - p.start or np.dtype(obj.dtype) != p.dtype:
            problems.append(f"{path} holds {obj.shape} {obj.dtype}, its attributes say "
                            f"[{p.start}:{p.stop}] {np.dtype(p.dtype).name}")
        pieces.append(p)

    f.visititems(visit)
    return pieces, problems


def read_piece(f, p):
    """Read a piece's elements and check its crc32; raise CheckpointError naming it."""
    try:
        data = f[p.path][...]
    except (OSError, KeyError) as e:
        raise CheckpointError(f"{p.file}: cannot read {p.path} ({e})") from e
    if crc32(data, p.dtype) != p.crc:
        raise CheckpointError(f"{p.file}: checksum mismatch in {p.path}")
    return data


def cover(pieces, lo, hi):
    """Return ``(pieces, None)`` if the pieces meeting ``[lo, hi)`` tile it, else ``(None, why)``.

    The pieces come back in order. The first may start before ``lo`` and the last end after
    ``hi`` (a slice needs part of a piece); between them there is no gap and no overlap.
    """
    over = sorted((p for p in pieces if p.start < hi and p.stop > lo),
                  key=lambda p: (p.start, p.stop))
    pos = lo
    for i, p in enumerate(over):
        if p.start > pos:
            return None, f"gap at element {pos}"
        if p.start < pos and i:
            return None, f"overlap at element {pos}"
        pos = p.stop
    if pos < hi:
        return None, f"covered up to element {pos} of {hi}"
    return over, None


def index_pieces(ckpt_dir, manifest):
    """Return ``{(kind, slot, var): [pieces]}`` for every dataset of the checkpoint."""
    import h5py

    groups = defaultdict(list)
    for entry in manifest["shards"]:
        path = os.path.join(ckpt_dir, entry["file"])
        try:
            with h5py.File(path, "r") as f:
                pieces, problems = walk(f, entry)
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable HDF5 ({e})") from e
        if problems:
            raise CheckpointError(f"{path}: {problems[0]}")
        for p in pieces:
            groups[(p.kind, p.slot, p.var)].append(p)
    return groups
