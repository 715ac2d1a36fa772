"""Click-through data in HDF5: written in chunks, checked on read, streamed to workers.

The layout: ``ids_train``/``ids_test`` int64 (N, F), ``dense_train``/``dense_test``
float32 (N, D) (D may be 0, or the datasets absent), ``y_train``/``y_test`` in {0, 1}, and
the file attribute ``ids`` that says what the ids are:

- ``"index"`` (the default when absent): field f's ids are rows of a fixed table,
  ``[0, table_rows[f])`` (the attribute ``table_rows``, one int per field). An id outside
  its field's range is refused, naming the field, the id and the split: never wrapped or
  clipped.
- ``"raw"``: any int64 (Criteo's 32-bit hashes, a vocabulary that grows), for tables that
  grow; the attribute ``vocabulary`` is ``"dynamic"``. A reader for fixed tables refuses
  such a file with one message (its ids are out of any fixed table's range);
  ``raw_ids=True`` takes it, and :func:`hash_ctr` writes its ids hashed into fixed tables.
"""

import os

import numpy as np

from ..config import check_batch_size, check_int
from ..errors import DataError
from .batches import ShardBatches
from .chunks import check_compression, chunk_rows, create_rows
from .stream import ShardReader, buffer_rows

__all__ = ["DYNAMIC", "CtrDataset", "CtrWriter", "auc", "ctr_ids", "load_ctr", "write_ctr"]

DYNAMIC = "dynamic"  # the vocabulary of a file of raw ids: tables that grow


def auc(y, score):
    """Return the area under the ROC curve (Mann-Whitney, ties counted half)."""
    y = np.asarray(y).reshape(-1).astype(bool)
    ranks = np.empty(len(score))
    order = np.argsort(score, kind="mergesort")
    s = np.asarray(score)[order]
    ranks[order] = np.arange(1, len(s) + 1)
    # average ranks of ties
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    for f, c in zip(first[counts > 1], counts[counts > 1]):
        ranks[order[f:f + c]] = f + (c + 1) / 2
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


class CtrWriter:
    """Write a click-through file block by block; ``out.tmp`` becomes ``out`` on success.

    ``table_rows``: one int per field (ids index fixed tables), or :data:`DYNAMIC` (raw
    ids). ``sizes``: ``{"train": N, "test": M}``. Arrays are chunked by whole rows for
    streaming reads; ``compression`` ("gzip" or "lzf") is off by default.
    """

    def __init__(self, out, table_rows, sizes, fields, dense_dim, compression=None, attrs=None):
        import h5py

        check_compression(compression)
        self.out, self.tmp = out, out + ".tmp"
        self.file = f = h5py.File(self.tmp, "w")
        if isinstance(table_rows, str) and table_rows == DYNAMIC:
            f.attrs["ids"], f.attrs["vocabulary"] = "raw", DYNAMIC
        else:
            f.attrs["ids"] = "index"
            f.attrs["table_rows"] = np.asarray(table_rows, np.int64)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        for split, n in sizes.items():
            shapes = {"ids": ((n, fields), np.int64), "dense": ((n, dense_dim), np.float32),
                      "y": ((n,), np.int64)}
            rows = chunk_rows(8 * fields + 4 * dense_dim + 8, n)  # one for the split
            for name, (shape, dtype) in shapes.items():
                create_rows(f, f"{name}_{split}", shape, dtype, rows, compression)

    def write(self, split, start, ids, dense, y):
        """Write rows ``[start, start + len(y))`` of ``split``."""
        stop = start + len(y)
        self.file[f"ids_{split}"][start:stop] = np.asarray(ids, np.int64)
        if self.file[f"dense_{split}"].shape[1]:
            self.file[f"dense_{split}"][start:stop] = np.asarray(dense, np.float32)
        self.file[f"y_{split}"][start:stop] = np.asarray(y, np.int64)

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc_info):
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.out)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)


def write_ctr(out, table_rows, splits, compression=None, attrs=None):
    """Write ``splits`` ({"train": (ids, dense, y), "test": ...}) atomically to ``out``.

    ``table_rows``: one int per field, or :data:`DYNAMIC` for raw ids.
    """
    first = np.asarray(next(iter(splits.values()))[0])
    dense_dim = np.asarray(next(iter(splits.values()))[1]).reshape(len(first), -1).shape[1]
    sizes = {split: len(arrays[2]) for split, arrays in splits.items()}
    with CtrWriter(out, table_rows, sizes, first.shape[1], dense_dim, compression,
                   attrs) as w:
        for split, (ids, dense, y) in splits.items():
            w.write(split, 0, ids, np.asarray(dense).reshape(len(y), -1), y)
    return out


def _id_rows(path, f):
    """Return the file's ``table_rows`` (an int64 array), or None for raw ids."""
    kind = f.attrs.get("ids", "index")
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind == "raw":
        return None
    if kind != "index":
        raise DataError(f"data file {path}: attribute ids = {kind!r}, expecting 'index' "
                        "(rows of fixed tables) or 'raw'")
    if "table_rows" not in f.attrs:
        raise DataError(f"data file {path} has no `table_rows` attribute (one int per "
                        "field: the rows of its table)")
    return np.asarray(f.attrs["table_rows"], np.int64).reshape(-1)


def ctr_ids(path):
    """Return what a click-through file's ids are: ``("index", table_rows)`` or ``("raw", None)``.

    A job chooses its tables by it: fixed tables of ``table_rows`` rows, or tables that grow.
    """
    f = _open_ctr(path, "train", None, True)[0]
    with f:
        rows = _id_rows(path, f)
    return ("raw", None) if rows is None else ("index", rows.tolist())


def _open_ctr(path, split, table_rows, raw_ids):
    """Open ``path``; return ``(file, [(name, dataset)], rows)``, the layout checked."""
    import h5py

    if not os.path.isfile(path):
        raise DataError(f"data file {path} not found; write one with `mpitf data "
                        "synthetic-ctr --out FILE` or `mpitf data criteo`")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"cannot open data file {path} as HDF5: {exc}") from None
    try:
        rows = _id_rows(path, f)
        if rows is None and not raw_ids:
            name = f"ids_{split}"
            first = f" (e.g. {name}[0, 0] = {int(f[name][0, 0])})" \
                if name in f and f[name].ndim == 2 and f[name].size else ""
            raise DataError(
                f"data file {path} holds raw ids (attribute ids = 'raw', vocabulary "
                f"{DYNAMIC!r}): they are out of the range of a fixed table's rows{first}, so a "
                "model of fixed tables cannot look them up. Train it with tables that grow, or "
                "hash its ids into fixed tables (`mpitf data hash-ids`, or write it without "
                "--raw-ids)")
        if rows is not None and table_rows is not None and list(rows) != list(table_rows):
            raise DataError(f"data file {path}: table_rows {rows.tolist()} disagrees with the "
                            f"model's {list(table_rows)}")
        names = [f"ids_{split}", f"y_{split}"]
        for name in names:
            if name not in f:
                raise DataError(f"data file {path} has no {name}")
        ds, fields = f[names[0]], (len(rows) if rows is not None else f[names[0]].shape[-1])
        if ds.dtype.kind not in "iu" or ds.ndim != 2 or ds.shape[1] != fields:
            raise DataError(f"data file {path}: {names[0]} must be integer (N, {fields}), got "
                            f"{ds.dtype} {ds.shape}")
        if f"dense_{split}" in f:
            names.insert(1, f"dense_{split}")
        arrays = [(name, f[name]) for name in names]
        lengths = [len(d) for _, d in arrays]
        if len(set(lengths)) != 1 or (len(arrays) == 3 and arrays[1][1].ndim != 2):
            raise DataError(f"data file {path}: ids_{split}, dense_{split} and y_{split} must "
                            f"have one row per example, got {', '.join(map(str, lengths))}")
    except BaseException:
        f.close()
        raise
    return f, arrays, rows


def _checked(path, split, arrays, rows, row_of):
    """Return ``(ids, dense, y)`` as int64, float32, float32, checked (``row_of``: file row)."""
    ids, y = arrays[0].astype(np.int64, copy=False), arrays[-1]
    dense = arrays[1].astype(np.float32, copy=False) if len(arrays) == 3 \
        else np.zeros((len(ids), 0), np.float32)
    if not np.isin(y, (0, 1)).all():
        raise DataError(f"data file {path}: y_{split} must hold labels 0 or 1")
    if rows is not None:
        bad = (ids < 0) | (ids >= rows)
        if bad.any():
            row, field = map(int, np.argwhere(bad)[0])
            raise DataError(f"data file {path}: id {int(ids[row, field])} of field {field} in "
                            f"split {split!r} (example {row_of(row)}) is outside "
                            f"[0, {int(rows[field])}) (ids are never wrapped or clipped)")
    return ids, dense, y.astype(np.float32)


def load_ctr(path, split, table_rows=None, start=0, stop=None, raw_ids=False):
    """Return ``(ids, dense, y, table_rows)`` of rows ``[start, stop)`` of a split, checked.

    ``table_rows`` (the model's) must agree with the file's attribute when given. A file of
    raw ids is refused unless ``raw_ids`` (tables that grow); its ``table_rows`` is None.
    A bad ``$MPITF_DATA_BUFFER_MIB`` is refused too: a job's up-front check of its file.
    """
    buffer_rows(None, 1)
    f, arrays, rows = _open_ctr(path, split, table_rows, raw_ids)
    with f:
        read = [d[start:stop] for _, d in arrays]
    return (*_checked(path, split, read, rows, lambda i: start + i), rows)


class CtrDataset(ShardBatches):
    """One worker's contiguous shard of the train split, shuffled per (seed, epoch, shard).

    Streamed through a shuffle buffer of ``buffer`` examples, each window checked as read
    (see :class:`~mpitf.data.sharded.ShardedDataset` for ``buffer`` and ``prefetch``). Batches
    are ``(ids, dense, y)``; an epoch ends at its last full batch. ``raw_ids`` takes a file of
    raw ids (``table_rows`` is then None).
    """

    def __init__(self, path, shard_index, num_shards, batch_size, seed=0, table_rows=None,
                 buffer=None, prefetch=2, raw_ids=False):
        self.batch_size = check_batch_size(batch_size)
        check_int("num_shards", num_shards, 1)
        f, arrays, self.table_rows = _open_ctr(path, "train", table_rows, raw_ids)
        try:
            n = len(arrays[0][1])
            lo, hi = shard_index * n // num_shards, (shard_index + 1) * n // num_shards
            if hi - lo < self.batch_size:
                raise DataError(f"data file {path}: worker {shard_index}'s shard has "
                                f"{hi - lo} examples, fewer than a batch of {batch_size}")
            self.dense_dim = arrays[1][1].shape[1] if len(arrays) == 3 else 0
            self.fields = arrays[0][1].shape[1]
            self.path, self.shard_index, self.num_shards = path, shard_index, num_shards
            self.start, self.stop, self.num_samples, self.seed = lo, hi, hi - lo, seed
            self.total_samples = n
            rows = self.table_rows
            reader = ShardReader(path, arrays, lo, hi, self.batch_size, seed, shard_index,
                                 buffer, prepare=lambda a, row_of: _checked(
                                     path, "train", a, rows, row_of))
            super().__init__(reader, prefetch, f)
        except BaseException:
            f.close()
            raise


# The writers of click-through files live beside it and write with CtrWriter; they are
# importable from here too, imported on first use (no import cycle).
_ELSEWHERE = {"MISSING_RAW": "ctr_convert", "convert_criteo": "ctr_convert",
              "hash_ctr": "ctr_convert", "synthetic_ctr": "ctr_synthetic"}


def __getattr__(name):
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(f".{_ELSEWHERE[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
