"""Click-through data in HDF5: checked on read, sharded over workers, synthetic or Criteo's.

The layout: ``ids_train``/``ids_test`` int64 (N, F), ``dense_train``/``dense_test``
float32 (N, D) (D may be 0, or the datasets absent), ``y_train``/``y_test`` in {0, 1},
and the file attribute ``table_rows`` (one int per field: field f's ids lie in
``[0, table_rows[f])``). Ids are never wrapped or clipped: one outside its field's range
is refused, naming the field, the id and the split. For tables that grow (the ctr job's
``--dynamic-tables``) the ids are raw: any int64 (``bounded=False``).
"""

import os

import numpy as np

from ..config import check_batch_size, check_int
from ..errors import DataError

__all__ = ["CtrDataset", "auc", "convert_criteo", "load_ctr", "synthetic_ctr", "write_ctr"]


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


def write_ctr(out, table_rows, splits):
    """Write ``splits`` ({"train": (ids, dense, y), "test": ...}) atomically to ``out``."""
    import h5py

    tmp = out + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["table_rows"] = np.asarray(table_rows, np.int64)
        for split, (ids, dense, y) in splits.items():
            f[f"ids_{split}"] = np.asarray(ids, np.int64)
            f[f"dense_{split}"] = np.asarray(dense, np.float32)
            f[f"y_{split}"] = np.asarray(y, np.int64)
    os.replace(tmp, out)
    return out


def load_ctr(path, split, table_rows=None, start=0, stop=None, bounded=True):
    """Return ``(ids, dense, y, table_rows)`` of rows ``[start, stop)`` of a split, checked.

    ``table_rows`` (the model's) must agree with the file's attribute when given.
    ``bounded`` False: the ids may be any int64 (tables that grow); only the count of
    fields is taken from ``table_rows``.
    """
    import h5py

    if not os.path.isfile(path):
        raise DataError(f"data file {path} not found; write one with `mpitf data "
                        "synthetic-ctr --out FILE` or `mpitf data criteo`")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"cannot open data file {path} as HDF5: {exc}") from None
    with f:
        if "table_rows" not in f.attrs:
            raise DataError(f"data file {path} has no `table_rows` attribute (one int per "
                            "field: the rows of its table)")
        rows = np.asarray(f.attrs["table_rows"], np.int64).reshape(-1)
        if table_rows is not None and list(rows) != list(table_rows):
            raise DataError(f"data file {path}: table_rows {rows.tolist()} disagrees with the "
                            f"model's {list(table_rows)}")
        name = f"ids_{split}"
        if name not in f:
            raise DataError(f"data file {path} has no {name}")
        ds = f[name]
        if ds.dtype.kind not in "iu" or ds.ndim != 2 or ds.shape[1] != len(rows):
            raise DataError(f"data file {path}: {name} must be integer (N, {len(rows)}), got "
                            f"{ds.dtype} {ds.shape}")
        ids = ds[start:stop].astype(np.int64)
        n = len(ids)
        dense = f[f"dense_{split}"][start:stop].astype(np.float32) \
            if f"dense_{split}" in f else np.zeros((n, 0), np.float32)
        if f"y_{split}" not in f:
            raise DataError(f"data file {path} has no y_{split}")
        y = f[f"y_{split}"][start:stop]
    if len(dense) != n or len(y) != n or dense.ndim != 2:
        raise DataError(f"data file {path}: ids_{split}, dense_{split} and y_{split} must "
                        f"have one row per example, got {n}, {len(dense)}, {len(y)}")
    if not np.isin(y, (0, 1)).all():
        raise DataError(f"data file {path}: y_{split} must hold labels 0 or 1")
    bad = (ids < 0) | (ids >= rows) if bounded else np.zeros(1, bool)
    if bad.any():
        row, field = map(int, np.argwhere(bad)[0])
        raise DataError(f"data file {path}: id {int(ids[row, field])} of field {field} in "
                        f"split {split!r} (example {start + row}) is outside "
                        f"[0, {int(rows[field])}) (ids are never wrapped or clipped)")
    return ids, dense, y.astype(np.float32), rows


class CtrDataset:
    """One worker's contiguous shard of the train split, shuffled per (seed, epoch, shard)."""

    def __init__(self, path, shard_index, num_shards, batch_size, seed=0, table_rows=None,
                 bounded=True):
        import h5py

        self.batch_size = check_batch_size(batch_size)
        check_int("num_shards", num_shards, 1)
        with h5py.File(path, "r") as f:
            n = len(f["ids_train"]) if "ids_train" in f else 0
        lo, hi = shard_index * n // num_shards, (shard_index + 1) * n // num_shards
        self.ids, self.dense, self.y, self.table_rows = load_ctr(path, "train", table_rows,
                                                                 lo, hi, bounded)
        if len(self.y) < self.batch_size:
            raise DataError(f"data file {path}: worker {shard_index}'s shard has "
                            f"{len(self.y)} examples, fewer than a batch of {batch_size}")
        self.seed, self.shard = seed, shard_index
        self.epoch = self.cursor = 0
        self._perm = None

    @property
    def dense_dim(self):
        return self.dense.shape[1]

    def _order(self):
        if self._perm is None:
            rng = np.random.default_rng((self.seed, self.epoch, self.shard))
            self._perm = rng.permutation(len(self.y))
        return self._perm

    def next_batch(self):
        """Return the next ``(ids, dense, y)`` batch (an epoch ends at its last full one)."""
        if self.cursor + self.batch_size > len(self.y):
            self.epoch, self.cursor, self._perm = self.epoch + 1, 0, None
        take = self._order()[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.ids[take], self.dense[take], self.y[take]

    def state(self):
        """Return the position of the next batch."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def restore(self, state):
        """Continue from a saved position."""
        self.epoch, self.cursor, self._perm = int(state["epoch"]), int(state["cursor"]), None


def synthetic_ctr(out, train=200000, test=5000, fields=8, rows=1000, dense=4, dim=4,
                  zipf=1.2, seed=0):
    """Write power-law CTR data from a planted model; return the planted model's test AUC.

    Field f's ids are Zipf(``zipf``) over ``rows`` rows; each id has a planted vector of
    ``dim`` values and the logit is a planted MLP-free model: the sum over fields of
    ``<e_f[id], u>`` plus ``<dense, v>``; labels are drawn from its sigmoid, so its AUC on
    the test split is the ceiling a learner can reach. The default 200 000 training
    examples give the rare rows of the power law enough examples to learn: with 20 000
    (25 per row of 1000 on average, most of them on the few popular ids) a learner
    overfits the rare ids and falls well short of the ceiling (benchmarks/README.md).
    """
    rng = np.random.default_rng(seed)
    table_rows = [int(rows)] * fields
    planted = [rng.normal(0, 1.0, (rows, dim)) for _ in range(fields)]
    u, v = rng.normal(0, 1.0, dim), rng.normal(0, 0.5, dense)
    splits = {}
    for split, n in (("train", train), ("test", test)):
        ids = (rng.zipf(zipf, (n, fields)) - 1) % rows
        x = rng.normal(0, 1.0, (n, dense)).astype(np.float32)
        logit = sum(planted[f][ids[:, f]] @ u for f in range(fields)) / np.sqrt(fields) \
            + x @ v - 1.0
        y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        splits[split] = (ids, x, y)
        if split == "test":
            ceiling = auc(y, logit)
    write_ctr(out, table_rows, splits)
    return ceiling


def convert_criteo(tsv, out, rows_per_field, test_fraction=0.1):
    """Convert Criteo's display-advertising TSV (label, 13 ints, 26 hashed categories).

    Integer features become ``log(1 + max(x, 0))`` (missing: 0); each categorical value
    (hexadecimal, missing: its own id) is hashed with crc32 into ``rows_per_field`` rows.
    The last ``test_fraction`` of the lines is the test split. Returns the example count.
    """
    import zlib

    check_int("rows_per_field", rows_per_field, 2)
    labels, dense, ids = [], [], []
    with open(tsv) as f:
        for number, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 40:
                raise DataError(f"{tsv}:{number}: expecting 40 tab-separated fields (label, "
                                f"13 integers, 26 categories), got {len(parts)}")
            try:
                labels.append(int(parts[0]))
                dense.append([np.log1p(max(int(p), 0)) if p else 0.0 for p in parts[1:14]])
            except ValueError:
                raise DataError(f"{tsv}:{number}: label and integer features must be "
                                "integers") from None
            ids.append([1 + zlib.crc32(p.encode()) % (rows_per_field - 1) if p else 0
                        for p in parts[14:]])
    n = len(labels)
    if n < 2:
        raise DataError(f"{tsv}: needs at least 2 lines, got {n}")
    cut = n - max(1, int(round(n * test_fraction)))
    arrays = np.asarray(ids, np.int64), np.asarray(dense, np.float32), np.asarray(labels)
    write_ctr(out, [rows_per_field] * 26, {
        "train": tuple(a[:cut] for a in arrays), "test": tuple(a[cut:] for a in arrays)})
    return n
